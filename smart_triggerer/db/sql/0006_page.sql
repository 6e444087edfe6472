-- smart_triggerer schema, version 6: what the Smart Triggerer page shows.
-- description: what a trigger waits on in plain words (triggers/describe.py; only the kwargs its class
-- chose to show, never secrets), computed with its identity.
ALTER TABLE smart_triggerer.trigger_identity ADD COLUMN description text;

-- Each instance's waiters, groups and polls saved, once a minute, for the page's last-hour chart; an
-- instance drops its own samples after two hours.
CREATE TABLE smart_triggerer.sample (
    job_id                 integer NOT NULL,
    at                     timestamptz NOT NULL DEFAULT now(),
    waiters                integer NOT NULL,
    groups                 integer NOT NULL,
    polls_saved_per_minute double precision NOT NULL,
    PRIMARY KEY (job_id, at)
);
CREATE INDEX sample_at ON smart_triggerer.sample (at);
