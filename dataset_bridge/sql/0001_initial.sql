-- The dataset bridge's tables in Airflow's metadata database, as releases up to 0.2.0 created them
-- from Python (each part its own, with IF NOT EXISTS): a deployment made by one of them upgrades in
-- place, this file creating what is missing and changing nothing that is there.

CREATE SCHEMA IF NOT EXISTS dataset_bridge;

-- the task-success bridge and the reconciler: one asset event per (asset, success), the horizons, the
-- reconciler's decisions
CREATE TABLE IF NOT EXISTS dataset_bridge.emitted (
    asset_id integer NOT NULL,
    idempotency_key text NOT NULL,
    source text NOT NULL,
    asset_event_id integer,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (asset_id, idempotency_key)
);
CREATE INDEX IF NOT EXISTS emitted_key ON dataset_bridge.emitted (idempotency_key);
CREATE INDEX IF NOT EXISTS emitted_created ON dataset_bridge.emitted (created_at);
CREATE TABLE IF NOT EXISTS dataset_bridge.task_horizon (
    dag_id text NOT NULL,
    task_id text NOT NULL,
    since timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (dag_id, task_id)
);
CREATE TABLE IF NOT EXISTS dataset_bridge.reconciled (
    asset_event_id integer NOT NULL,
    dag_id text NOT NULL,
    queued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (asset_event_id, dag_id)
);
ALTER TABLE dataset_bridge.reconciled ADD COLUMN IF NOT EXISTS outcome text NOT NULL DEFAULT 'requeued';
ALTER TABLE dataset_bridge.reconciled ADD COLUMN IF NOT EXISTS reason text;
CREATE INDEX IF NOT EXISTS reconciled_queued ON dataset_bridge.reconciled (queued_at);

-- the inbox: one asset event per (source, source event)
CREATE TABLE IF NOT EXISTS dataset_bridge.inbox (
    source text NOT NULL,
    source_event_id bigint NOT NULL,
    asset_event_id integer,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, source_event_id)
);
CREATE INDEX IF NOT EXISTS inbox_received ON dataset_bridge.inbox (received_at);

-- the outbox and the relay's targets
CREATE TABLE IF NOT EXISTS dataset_bridge.outbox (
    id bigserial PRIMARY KEY,
    target text NOT NULL,
    asset_event_id integer NOT NULL,
    asset_uri text NOT NULL,
    asset_name text NOT NULL,
    extra jsonb NOT NULL DEFAULT '{}',
    event_timestamp timestamptz NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    UNIQUE (target, asset_event_id)
);
CREATE INDEX IF NOT EXISTS outbox_pending ON dataset_bridge.outbox (target, id) WHERE status = 'pending';
CREATE TABLE IF NOT EXISTS dataset_bridge.relay_target (
    target text PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE dataset_bridge.relay_target ADD COLUMN IF NOT EXISTS swept_until timestamptz;
CREATE INDEX IF NOT EXISTS outbox_delivered ON dataset_bridge.outbox (delivered_at)
    WHERE status = 'delivered';
-- NULL: the event's extra could not be copied (jsonb refuses it), so the row is dead and never sent
ALTER TABLE dataset_bridge.outbox ALTER COLUMN extra DROP NOT NULL;
-- server errors (a 5xx that is not an outage) of this row: the relay dead-letters it at max_server_errors
ALTER TABLE dataset_bridge.outbox ADD COLUMN IF NOT EXISTS server_errors integer NOT NULL DEFAULT 0;
-- the sweeper's cursor: every asset_event id up to it has committed (or never will) and was swept
ALTER TABLE dataset_bridge.relay_target ADD COLUMN IF NOT EXISTS swept_id bigint;
-- A target first seen now is swept from the events after those committed now. Its registering transaction's
-- own are left out: the manager registers in a producer's transaction, whose event may need the sweep.
CREATE OR REPLACE FUNCTION dataset_bridge.asset_events_before() RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT coalesce(max(id), 0) FROM asset_event
            WHERE xmin <> coalesce(xid(pg_current_xact_id_if_assigned()), CAST('0' AS xid)));
END
$$;
ALTER TABLE dataset_bridge.relay_target
    ALTER COLUMN swept_id SET DEFAULT dataset_bridge.asset_events_before();

-- Airflow stores an asset event's extra as json, which takes a NUL character (\u0000), an unpaired UTF-16
-- surrogate or a number beyond numeric's range; jsonb refuses them. Whatever casts an event's extra to
-- jsonb asks this first: NULL when the cast works, else PostgreSQL's reason (for json input, the message
-- and detail name the cause, never the value).
CREATE OR REPLACE FUNCTION dataset_bridge.jsonb_error(value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    detail text;
BEGIN
    PERFORM CAST(value AS jsonb);
    RETURN NULL;
EXCEPTION WHEN data_exception THEN
    GET STACKED DIAGNOSTICS detail = PG_EXCEPTION_DETAIL;
    RETURN concat_ws(': ', SQLERRM, nullif(detail, ''));
END
$$;
