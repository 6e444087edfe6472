-- smart_triggerer schema, version 3.
-- Leases per queue set: instances started with different --queues own disjoint shard spaces ('' is the
-- space of instances without --queues).
ALTER TABLE smart_triggerer.shard_lease ADD COLUMN queues text NOT NULL DEFAULT '';
ALTER TABLE smart_triggerer.shard_lease DROP CONSTRAINT shard_lease_pkey;
ALTER TABLE smart_triggerer.shard_lease ADD PRIMARY KEY (queues, shard);
-- The transaction that stored each identity: new waiters are read by transaction id against the
-- previous read's snapshot xmin, so a row that commits late with a lower trigger id is never skipped.
ALTER TABLE smart_triggerer.trigger_identity ADD COLUMN xid xid8 NOT NULL DEFAULT pg_current_xact_id();
CREATE INDEX trigger_identity_xid ON smart_triggerer.trigger_identity (xid);
