-- Each instance's lease_seconds, so that one joining with another refuses to start: its peers would judge
-- its membership by their own lease (a crashed instance's shards wait for the longest lease), and it
-- theirs by its own. NULL: an instance of an earlier release (not checked).
ALTER TABLE smart_triggerer.instance ADD COLUMN lease_seconds double precision;
