-- name: lock_schema
-- Serialises migrations and shard-count checks of instances that start at once.
SELECT pg_advisory_xact_lock(7405412771);

-- name: applied_migrations
-- Versions already applied.
SELECT version FROM smart_triggerer.migration;

-- name: record_migration
-- Marks one migration as applied.
INSERT INTO smart_triggerer.migration (version, name) VALUES (:version, :name);

-- name: get_setting
-- One deployment-wide setting.
SELECT value FROM smart_triggerer.setting WHERE key = :key;

-- name: put_setting
-- Stores a deployment-wide setting the first time it is seen.
INSERT INTO smart_triggerer.setting (key, value) VALUES (:key, :value) ON CONFLICT (key) DO NOTHING;

-- name: create_shards
-- One lease row per virtual shard.
INSERT INTO smart_triggerer.shard_lease (shard)
SELECT generate_series(0, :shards - 1)
ON CONFLICT (shard) DO NOTHING;

-- name: register_instance
-- Joins the membership (a restarted job id starts afresh).
INSERT INTO smart_triggerer.instance (job_id, hostname, capacity, queues, health_url)
VALUES (:job_id, :hostname, :capacity, :queues, :health_url)
ON CONFLICT (job_id) DO UPDATE SET hostname = EXCLUDED.hostname, capacity = EXCLUDED.capacity,
    queues = EXCLUDED.queues, health_url = EXCLUDED.health_url, heartbeat_at = now(), stopped_at = NULL;

-- name: heartbeat_instance
-- Renews membership on the database clock and publishes this instance's counters.
UPDATE smart_triggerer.instance
SET heartbeat_at = now(), runner_alive = :runner_alive, waiters = :waiters, groups = :groups,
    events_total = :events_total, resumed_total = :resumed_total, failures_total = :failures_total,
    health_url = :health_url
WHERE job_id = :job_id
RETURNING now() AS db_now;

-- name: live_instances
-- Instances whose membership has not lapsed: the rendezvous hashing input.
SELECT job_id, capacity FROM smart_triggerer.instance
WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => :lease_seconds)
  AND coalesce(queues, '') = coalesce(:queues, '');

-- name: claim_shards
-- Renews the leases this instance holds among :shards and takes those that are free or expired.
UPDATE smart_triggerer.shard_lease
SET owner_job_id = :job_id, expires_at = now() + make_interval(secs => :lease_seconds),
    acquired_at = CASE WHEN owner_job_id = :job_id THEN acquired_at ELSE now() END
WHERE shard = ANY(:shards)
  AND (owner_job_id = :job_id OR owner_job_id IS NULL OR expires_at < now())
RETURNING shard;

-- name: release_shards
-- Gives up leases at once (handover, graceful stop) so the next owner need not wait for expiry.
UPDATE smart_triggerer.shard_lease
SET owner_job_id = NULL, expires_at = NULL
WHERE owner_job_id = :job_id AND shard = ANY(:shards);

-- name: stop_instance
-- Leaves the membership and releases every lease (graceful stop).
WITH released AS (
    UPDATE smart_triggerer.shard_lease SET owner_job_id = NULL, expires_at = NULL
    WHERE owner_job_id = :job_id
)
UPDATE smart_triggerer.instance SET stopped_at = now() WHERE job_id = :job_id;

-- name: unhashed_triggers
-- New trigger rows without an identity yet; SKIP LOCKED so instances share the decrypting.
SELECT t.id, t.classpath, t.kwargs
FROM trigger t
LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id
WHERE i.trigger_id IS NULL
  AND ((:queues)::text[] IS NULL AND t.queue IS NULL OR t.queue = ANY((:queues)::text[]))
ORDER BY t.id
LIMIT :limit
FOR UPDATE OF t SKIP LOCKED;

-- name: insert_identity
-- Stores one trigger's identity (computed once: its kwargs are decrypted once).
INSERT INTO smart_triggerer.trigger_identity (trigger_id, identity_hash, shard, dedupable, execution, error)
VALUES (:trigger_id, :identity_hash, :shard, :dedupable, CAST(:execution AS jsonb), :error)
ON CONFLICT (trigger_id) DO NOTHING;

-- name: waiting_triggers
-- Triggers of the given shards that something still waits on (a deferred task, an asset, a callback).
SELECT i.trigger_id, i.identity_hash, i.shard, i.dedupable, i.execution, t.created_date,
       EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id) AS has_task
FROM smart_triggerer.trigger_identity i
JOIN trigger t ON t.id = i.trigger_id
WHERE i.shard = ANY(:shards) AND i.error IS NULL AND i.trigger_id > :after_id
  AND (EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
       OR EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
       OR EXISTS (SELECT 1 FROM callback c WHERE c.trigger_id = t.id));

-- name: failed_identities
-- Triggers whose identity could not be computed (undecryptable kwargs) and whose tasks still wait.
SELECT i.trigger_id, i.error
FROM smart_triggerer.trigger_identity i
JOIN task_instance ti ON ti.trigger_id = i.trigger_id AND ti.state = 'deferred'
WHERE i.error IS NOT NULL AND i.shard = ANY(:shards);

-- name: claim_triggers
-- Marks the triggers this instance runs as its own (the UI and trigger-log paths read triggerer_id).
UPDATE trigger SET triggerer_id = :job_id
WHERE id = ANY(:ids) AND triggerer_id IS DISTINCT FROM :job_id;

-- name: instances
-- Every known instance and what it owns, for `smart-triggerer status`.
SELECT i.job_id, i.hostname, i.capacity, i.queues, i.health_url, i.started_at, i.heartbeat_at,
       i.stopped_at, i.runner_alive, i.waiters, i.groups, i.events_total, i.resumed_total,
       i.failures_total,
       (i.stopped_at IS NULL AND i.heartbeat_at > now() - make_interval(secs => :lease_seconds)
        AND i.runner_alive) AS healthy,
       (SELECT count(*) FROM smart_triggerer.shard_lease l
        WHERE l.owner_job_id = i.job_id AND l.expires_at > now()) AS shards_owned
FROM smart_triggerer.instance i
ORDER BY i.job_id;

-- name: lock_deferred
-- Deferred task instances of these triggers, row-locked in id order: a concurrent submitter waits, then
-- re-checks the state and skips them, so no task is resumed twice.
SELECT id, trigger_id, next_kwargs FROM task_instance
WHERE trigger_id = ANY(:trigger_ids) AND state = 'deferred'
ORDER BY id
FOR UPDATE;

-- name: resume_task_instances
-- Resumes many task instances in one statement, as Airflow's handle_event_submit does one by one.
UPDATE task_instance AS ti
SET state = 'scheduled', next_kwargs = CAST(v.next_kwargs AS jsonb), trigger_id = NULL, scheduled_dttm = now()
FROM unnest(CAST(:ids AS uuid[]), CAST(:next_kwargs AS text[])) AS v(id, next_kwargs)
WHERE ti.id = v.id;

-- name: fail_task_instances
-- Fails many task instances through Airflow's __fail__ resume path (the worker runs failure callbacks).
UPDATE task_instance
SET state = 'scheduled', next_method = '__fail__', next_kwargs = CAST(:next_kwargs AS jsonb),
    trigger_id = NULL, scheduled_dttm = now()
WHERE id = ANY(CAST(:ids AS uuid[]));

-- name: timeout_members
-- Times out deferred members of this instance's shards one by one, exactly as the scheduler does.
UPDATE task_instance
SET state = 'scheduled', next_method = '__fail__', next_kwargs = CAST(:next_kwargs AS jsonb),
    trigger_id = NULL, scheduled_dttm = now()
WHERE state = 'deferred' AND trigger_timeout < now()
  AND trigger_id IN (SELECT trigger_id FROM smart_triggerer.trigger_identity WHERE shard = ANY(:shards));

-- name: claim_asset_event_key
-- Returns a row only for the first claimant; a concurrent claimant waits on the unique index until the
-- first transaction ends, then gets nothing (or the key, if the first rolled back).
INSERT INTO smart_triggerer.asset_event_key (asset_id, idempotency_key, trigger_id)
VALUES (:asset_id, :key, :trigger_id)
ON CONFLICT DO NOTHING
RETURNING asset_id;
