-- smart_triggerer schema, version 1: instances, shard leases, per-trigger identity.
-- Only our own tables reference trigger(id) ON DELETE CASCADE; Airflow's rows are never deleted by us.

CREATE TABLE smart_triggerer.setting (
    key   text PRIMARY KEY,
    value text NOT NULL
);

CREATE TABLE smart_triggerer.instance (
    job_id         integer PRIMARY KEY,
    hostname       text NOT NULL,
    capacity       integer NOT NULL,
    queues         text,
    health_url     text,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now(),
    stopped_at     timestamptz,
    runner_alive   boolean NOT NULL DEFAULT true,
    waiters        integer NOT NULL DEFAULT 0,
    groups         integer NOT NULL DEFAULT 0,
    events_total   bigint NOT NULL DEFAULT 0,
    resumed_total  bigint NOT NULL DEFAULT 0,
    failures_total bigint NOT NULL DEFAULT 0
);

CREATE TABLE smart_triggerer.shard_lease (
    shard        integer PRIMARY KEY,
    owner_job_id integer,
    expires_at   timestamptz,
    acquired_at  timestamptz
);

CREATE TABLE smart_triggerer.trigger_identity (
    trigger_id    integer PRIMARY KEY REFERENCES public.trigger (id) ON DELETE CASCADE,
    identity_hash bigint NOT NULL,
    shard         integer NOT NULL,
    dedupable     boolean NOT NULL,
    -- numeric execution settings only (poll intervals...): numbers carry no secrets
    execution     jsonb NOT NULL DEFAULT '{}',
    error         text,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX trigger_identity_shard ON smart_triggerer.trigger_identity (shard, trigger_id);
CREATE INDEX trigger_identity_hash ON smart_triggerer.trigger_identity (identity_hash);
CREATE INDEX trigger_identity_error ON smart_triggerer.trigger_identity (trigger_id) WHERE error IS NOT NULL;
