-- Events of asset watchers that could not be stored, again and again (the database refuses what they
-- carry, a listener raises on them): set aside here, then acknowledged so that the watcher's source moves
-- on to its later rows instead of replaying the same event for ever. payload: the event as JSON text that
-- jsonb refused, kept for an operator to replay by hand (asset events are what Airflow would have stored).
CREATE TABLE IF NOT EXISTS smart_triggerer.dead_event (
    id bigserial PRIMARY KEY,
    trigger_id integer NOT NULL,
    asset_ids integer[] NOT NULL,
    payload text NOT NULL,
    attempts integer NOT NULL,
    cause text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
