-- name: lock_schema
-- Serialises migrations and shard-count checks of instances that start at once.
SELECT pg_advisory_xact_lock(7405412771);

-- name: applied_migrations
-- Versions already applied.
SELECT version FROM smart_triggerer.migration;

-- name: get_setting
-- One deployment-wide setting.
SELECT value FROM smart_triggerer.setting WHERE key = :key;

-- name: put_setting
-- Stores a deployment-wide setting the first time it is seen.
INSERT INTO smart_triggerer.setting (key, value) VALUES (:key, :value) ON CONFLICT (key) DO NOTHING;

-- name: raise_setting
-- A deployment-wide integer setting that only ever grows (the oldest release that can run on the schema).
INSERT INTO smart_triggerer.setting (key, value) VALUES (:key, :value)
ON CONFLICT (key) DO UPDATE SET value = GREATEST(setting.value::integer, EXCLUDED.value::integer)::text;

-- name: create_shards
-- One lease row per virtual shard of a queue set's shard space.
INSERT INTO smart_triggerer.shard_lease (queues, shard)
SELECT :queues, generate_series(0, :shards - 1)
ON CONFLICT (queues, shard) DO NOTHING;

-- name: register_instance
-- Joins the membership (a restarted job id starts afresh). feed_xmin: from here on the change feed is kept
-- for this instance (it reads everything before that once, when it starts).
INSERT INTO smart_triggerer.instance (job_id, hostname, capacity, queues, health_url, feed_xmin, placement,
                                      lease_seconds)
VALUES (:job_id, :hostname, :capacity, :queues, :health_url, pg_snapshot_xmin(pg_current_snapshot()),
        :placement, :lease_seconds)
ON CONFLICT (job_id) DO UPDATE SET hostname = EXCLUDED.hostname, capacity = EXCLUDED.capacity,
    queues = EXCLUDED.queues, health_url = EXCLUDED.health_url, heartbeat_at = now(), stopped_at = NULL,
    feed_xmin = EXCLUDED.feed_xmin, placement = EXCLUDED.placement, lease_seconds = EXCLUDED.lease_seconds;

-- name: other_leases
-- Live instances (by the longer of the two leases) whose lease_seconds differs from :lease_seconds.
SELECT job_id, hostname, lease_seconds FROM smart_triggerer.instance
WHERE stopped_at IS NULL AND job_id <> :job_id AND lease_seconds IS NOT NULL
  AND lease_seconds <> :lease_seconds
  AND heartbeat_at > now() - make_interval(secs => greatest(lease_seconds, :lease_seconds))
ORDER BY job_id;

-- name: heartbeat_instance
-- Renews membership on the database clock and publishes this instance's counters. was_live: the membership
-- had not lapsed before this renewal (by the database clock), so peers kept the change feed for it
-- (prune_feed); otherwise the instance reads everything again.
WITH previous AS (
    SELECT stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => :lease_seconds) AS live
    FROM smart_triggerer.instance WHERE job_id = :job_id
)
UPDATE smart_triggerer.instance
SET heartbeat_at = now(), runner_alive = :runner_alive, waiters = :waiters, groups = :groups,
    events_total = :events_total, resumed_total = :resumed_total, failures_total = :failures_total,
    watchers_failing = :watchers_failing, watcher_restarts_total = :watcher_restarts_total,
    health_url = :health_url, feed_xmin = coalesce(CAST(:feed_xmin AS xid8), feed_xmin),
    lag_p99_ms = :lag_p99_ms, rss_mb = :rss_mb, accepting = :accepting, limit_groups = :limit_groups,
    shedding = :shedding, fleet_full = :fleet_full
FROM previous
WHERE job_id = :job_id
RETURNING previous.live AS was_live, extract(epoch FROM clock_timestamp()) AS db_now;

-- name: db_clock
-- The database clock, in epoch seconds (timeouts are judged on it).
SELECT extract(epoch FROM clock_timestamp());

-- name: live_instances
-- Instances whose membership has not lapsed, as placement reads them (placement.py); lapses_in: seconds
-- until each one's membership lapses unless renewed (a crashed instance's shards are free from then on).
SELECT job_id, capacity, placement, accepting, limit_groups,
       extract(epoch FROM heartbeat_at + make_interval(secs => :lease_seconds) - now()) AS lapses_in
FROM smart_triggerer.instance
WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => :lease_seconds)
  AND coalesce(queues, '') = coalesce(:queues, '');

-- name: live_queue_sets
-- The --queues sets of live instances ('' for none).
SELECT DISTINCT coalesce(queues, '') FROM smart_triggerer.instance
WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => :lease_seconds);

-- name: claim_shards
-- Renews the leases this instance holds among :shards and takes those that are free or expired. Database
-- clock only. A row another transaction locks is skipped, never waited for: only a lapsed owner's open
-- transaction (its fence) or a competing claim can lock it, and a frozen host must not stall the fleet;
-- the row is taken in a later loop, once the server has ended that transaction.
WITH candidates AS (
    SELECT shard FROM smart_triggerer.shard_lease
    WHERE queues = :queues AND shard = ANY(:shards)
      AND (owner_job_id = :job_id OR owner_job_id IS NULL OR expires_at < clock_timestamp())
    ORDER BY shard
    FOR UPDATE SKIP LOCKED
)
UPDATE smart_triggerer.shard_lease AS l
SET owner_job_id = :job_id, expires_at = clock_timestamp() + make_interval(secs => :lease_seconds),
    acquired_at = CASE WHEN l.owner_job_id = :job_id THEN l.acquired_at ELSE clock_timestamp() END,
    -- the groups the owner holds in each shard it has loaded (placement.py weighs shards by them); a shard
    -- just taken keeps the count its last owner published until it is loaded here
    groups = coalesce(
        (CAST(:load_groups AS integer[]))[array_position(CAST(:load_shards AS integer[]), l.shard)], l.groups)
FROM candidates c
WHERE l.queues = :queues AND l.shard = c.shard
RETURNING l.shard;

-- name: shard_loads
-- Every shard of a queue set's space: its owner by the database clock (NULL when the lease lapsed or was
-- released) and the groups its owner last published: with live_instances, the placement's input.
SELECT shard, CASE WHEN expires_at > clock_timestamp() THEN owner_job_id END AS owner_job_id, groups
FROM smart_triggerer.shard_lease
WHERE queues = :queues;

-- name: fence_shards
-- The shards among :shards whose lease this instance still holds by the database clock, share-locked
-- until the transaction ends: every write for a member runs after this in the same transaction, so a
-- process paused past its lease can never write for a shard another instance took over (the taker's
-- claim skips the row while this transaction lasts, then finds the lease expired). A claim in flight on
-- the row (it expired) is waited for, at most lock_timeout (bounded.py): then the step is retried.
SELECT shard FROM smart_triggerer.shard_lease
WHERE queues = :queues AND shard = ANY(:shards) AND owner_job_id = :job_id
  AND expires_at > clock_timestamp()
ORDER BY shard
FOR SHARE;

-- name: held_shards
-- Among :shards, those this instance holds by the database clock, read without a lock: a claim skips its
-- own rows while a session of its own that lost its client (a connection blip) still locks them; they
-- are kept, not handed over, and renewed once the server has ended that session.
SELECT shard FROM smart_triggerer.shard_lease
WHERE queues = :queues AND shard = ANY(:shards) AND owner_job_id = :job_id
  AND expires_at > clock_timestamp();

-- name: release_shards
-- Gives up leases at once (handover, graceful stop) so the next owner need not wait for expiry. A row a
-- session of its own still locks (a fence whose client gave up after a blip) is skipped, never waited
-- for: it expires with its lease instead, and the renewal around this statement goes on.
WITH mine AS (
    SELECT shard FROM smart_triggerer.shard_lease
    WHERE owner_job_id = :job_id AND queues = :queues AND shard = ANY(:shards)
    FOR UPDATE SKIP LOCKED
)
UPDATE smart_triggerer.shard_lease AS l
SET owner_job_id = NULL, expires_at = NULL
FROM mine
WHERE l.queues = :queues AND l.shard = mine.shard;

-- name: stop_instance
-- Leaves the membership and releases every lease it can at once (graceful stop); rows a lingering session
-- of its own still locks are skipped and expire with their lease (see release_shards).
WITH mine AS (
    SELECT queues, shard FROM smart_triggerer.shard_lease WHERE owner_job_id = :job_id
    FOR UPDATE SKIP LOCKED
), released AS (
    UPDATE smart_triggerer.shard_lease AS l SET owner_job_id = NULL, expires_at = NULL
    FROM mine WHERE l.queues = mine.queues AND l.shard = mine.shard
)
UPDATE smart_triggerer.instance SET stopped_at = now() WHERE job_id = :job_id;

-- name: notify_membership
-- Tells listening instances that the membership or the leases changed (a join, a stop, shards handed over):
-- they renew at once rather than at their next loop (smart_triggerer/db/notices.py). Sent when the transaction
-- commits, never for one that rolls back.
SELECT pg_notify(:channel, :payload);

-- name: unhashed_triggers
-- Trigger rows without an identity yet, after :after_id in id order: every one with :after_xid NULL (a
-- sweep, which goes on from where its last batch ended), otherwise those the change feed reports as new
-- since :after_xid. SKIP LOCKED so instances share the decrypting.
SELECT t.id, t.classpath, t.kwargs, t.team_name
FROM trigger t
LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id
WHERE i.trigger_id IS NULL AND t.id > :after_id
  AND (CAST(:after_xid AS xid8) IS NULL OR t.id IN (
       SELECT trigger_id FROM smart_triggerer.trigger_change
       WHERE created AND xid >= CAST(:after_xid AS xid8)))
  AND ((:queues)::text[] IS NULL AND t.queue IS NULL OR t.queue = ANY((:queues)::text[]))
  AND (NOT CAST(:multi_team AS boolean) OR t.team_name IS NOT DISTINCT FROM CAST(:team AS text))
ORDER BY t.id
LIMIT :limit
FOR UPDATE OF t SKIP LOCKED;

-- name: insert_identities
-- Stores the identities of many triggers in one statement (computed once: their kwargs are decrypted once).
INSERT INTO smart_triggerer.trigger_identity (trigger_id, identity_hash, shard, dedupable, execution, error,
                                             description)
SELECT * FROM unnest(CAST(:trigger_ids AS integer[]), CAST(:hashes AS bigint[]), CAST(:shards AS integer[]),
                     CAST(:dedupable AS boolean[]), CAST(CAST(:executions AS text[]) AS jsonb[]),
                     CAST(:errors AS text[]), CAST(:descriptions AS text[]))
ON CONFLICT (trigger_id) DO NOTHING;

-- name: hold_events
-- Stores events held for young members (0013_held_events.sql), each released after its own hold (seconds,
-- from now by the database clock) or a second before its deferred task's trigger_timeout, whichever comes
-- first; returns each member's seconds until release.
INSERT INTO smart_triggerer.held_event (trigger_id, event, release_at)
SELECT m.trigger_id, m.event,
       least(clock_timestamp() + make_interval(secs => m.hold),
             (SELECT min(ti.trigger_timeout) - interval '1 second' FROM task_instance ti
              WHERE ti.trigger_id = m.trigger_id AND ti.state = 'deferred'))
FROM unnest(CAST(:trigger_ids AS integer[]), CAST(:events AS text[]), CAST(:holds AS float8[]))
     AS m(trigger_id, event, hold)
JOIN trigger t ON t.id = m.trigger_id
ON CONFLICT (trigger_id) DO UPDATE SET event = excluded.event, release_at = excluded.release_at
RETURNING trigger_id, greatest(0, extract(epoch FROM release_at - clock_timestamp()))::float AS release_in;

-- name: release_held_events
-- The held events of members resumed (or gone): removed in the resume's own transaction.
DELETE FROM smart_triggerer.held_event WHERE trigger_id = ANY(CAST(:trigger_ids AS integer[]));

-- name: dead_event
-- Sets aside an asset watcher's event that could not be stored after many tries (see 0010_dead_events.sql).
INSERT INTO smart_triggerer.dead_event (trigger_id, asset_ids, payload, attempts, cause)
SELECT :trigger_id, coalesce(array_agg(aw.asset_id ORDER BY aw.asset_id), '{}'), :payload, :attempts, :cause
FROM asset_watcher aw WHERE aw.trigger_id = :trigger_id;

-- name: ping
-- Whether the database answers (after a lost connection: an outage, or one session ended by the server).
SELECT 1;

-- name: snapshot_xmin
-- Every transaction with a lower id had ended when this ran: the next incremental read starts here.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text;

-- name: waiting_triggers
-- The waiters of the given shards and queues: triggers something still waits on (a deferred task, an
-- asset, a callback). With :after_xid NULL every one of them (shards just taken, a lost feed position);
-- otherwise only those whose identity was stored, or that the change feed reports as new or newly
-- watched, by a transaction at or after :after_xid (the previous read's snapshot xmin: a row that commits
-- late is never skipped), read through the xid indexes: nothing changed, nothing read.
-- error: its kwargs could not be read (its tasks are failed with the cause). hold_left: seconds until a
-- member is old enough to resume (database clock; identities are stored after the deferral committed, so
-- this never releases early). timeout_in: seconds until its deferred task's trigger_timeout, if any.
-- held_event, held_in: an event stored for the member while it was held (0013_held_events.sql) and seconds
-- until it may resume it: such a member is resumed from it, never started again.
-- The task instances of each trigger are read once, through ti_trigger_id only: conditions on ti.state
-- outside the aggregate let the planner AND in ti_state, which scans every deferred task for each trigger
-- when its statistics lag a burst of deferrals (50,000 waiters: minutes per read). execution as text: the
-- reader parses each distinct text once (most rows of a takeover carry the same few).
SELECT i.trigger_id, i.identity_hash, i.shard, i.dedupable, i.execution::text AS execution, i.error,
       greatest(0, :hold_seconds - extract(epoch FROM clock_timestamp() - i.created_at))::float AS hold_left,
       coalesce(task.has_task, false) AS has_task,
       extract(epoch FROM task.timeout_at - clock_timestamp())::float AS timeout_in,
       h.event AS held_event, extract(epoch FROM h.release_at - clock_timestamp())::float AS held_in
FROM smart_triggerer.trigger_identity i
JOIN trigger t ON t.id = i.trigger_id
LEFT JOIN smart_triggerer.held_event h ON h.trigger_id = i.trigger_id
LEFT JOIN LATERAL (
    SELECT true AS has_task, bool_or(ti.state = 'deferred') AS deferred,
           min(ti.trigger_timeout) FILTER (WHERE ti.state = 'deferred') AS timeout_at
    FROM task_instance ti WHERE ti.trigger_id = t.id
    HAVING count(*) > 0
) task ON true
WHERE i.shard = ANY(:shards)
  AND (CAST(:after_xid AS xid8) IS NULL OR i.trigger_id IN (
       SELECT trigger_id FROM smart_triggerer.trigger_identity WHERE xid >= CAST(:after_xid AS xid8)
       UNION
       SELECT trigger_id FROM smart_triggerer.trigger_change
       WHERE created AND xid >= CAST(:after_xid AS xid8)))
  AND ((:queues)::text[] IS NULL AND t.queue IS NULL OR t.queue = ANY((:queues)::text[]))
  AND (NOT CAST(:multi_team AS boolean) OR t.team_name IS NOT DISTINCT FROM CAST(:team AS text))
  AND (coalesce(task.deferred, false)
       OR i.error IS NULL AND EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
       OR i.error IS NULL AND EXISTS (SELECT 1 FROM callback c WHERE c.trigger_id = t.id));

-- name: deleted_triggers
-- Trigger rows deleted (Airflow's clean_unused: nothing waits on them any more) by a transaction at or
-- after :after_xid.
SELECT DISTINCT trigger_id FROM smart_triggerer.trigger_change
WHERE NOT created AND xid >= CAST(:after_xid AS xid8);

-- name: feed_probe
-- The one statement of a loop in which nothing happened: this statement's snapshot xmin, and whether an
-- identity was stored since :load_after or the feed has a row since the older of :load_after and
-- :hash_after (the two read positions). Nothing: both positions move to xmin.
WITH s AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
SELECT s.xmin::text AS xmin,
       EXISTS (SELECT 1 FROM smart_triggerer.trigger_identity WHERE xid >= CAST(:load_after AS xid8))
       OR EXISTS (SELECT 1 FROM smart_triggerer.trigger_change
                  WHERE xid >= least(CAST(:load_after AS xid8), CAST(:hash_after AS xid8))) AS changed
FROM s;

-- name: feed_position
-- This statement's snapshot xmin, and how many rows the feed reports as new since :after_xid that have no
-- identity yet (those a concurrent instance is hashing count too): none, and hashing may move on to xmin.
WITH s AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
SELECT s.xmin::text AS xmin,
       (SELECT count(*) FROM smart_triggerer.trigger_change c
        JOIN trigger t ON t.id = c.trigger_id
        LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = c.trigger_id
        WHERE c.created AND c.xid >= CAST(:after_xid AS xid8) AND i.trigger_id IS NULL
          AND ((:queues)::text[] IS NULL AND t.queue IS NULL OR t.queue = ANY((:queues)::text[]))
          AND (NOT CAST(:multi_team AS boolean) OR t.team_name IS NOT DISTINCT FROM CAST(:team AS text))) AS unhashed
FROM s;

-- name: sweep_position
-- As feed_position, over every trigger row (at start, and after this instance lost track of the feed):
-- rows without an identity that the feed will not report from this statement's xmin on.
WITH s AS (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
SELECT s.xmin::text AS xmin,
       (SELECT count(*) FROM trigger t
        LEFT JOIN smart_triggerer.trigger_identity i ON i.trigger_id = t.id
        WHERE i.trigger_id IS NULL
          AND ((:queues)::text[] IS NULL AND t.queue IS NULL OR t.queue = ANY((:queues)::text[]))
          AND (NOT CAST(:multi_team AS boolean) OR t.team_name IS NOT DISTINCT FROM CAST(:team AS text))
          AND NOT EXISTS (SELECT 1 FROM smart_triggerer.trigger_change c
                          WHERE c.trigger_id = t.id AND c.created AND c.xid >= s.xmin)) AS unhashed
FROM s;

-- name: prune_feed
-- Drops feed rows every live instance has read (each publishes its position with its heartbeat; one whose
-- membership lapsed re-reads everything when it comes back, see Supervisor._renew_leases).
DELETE FROM smart_triggerer.trigger_change
WHERE xid < (SELECT min(feed_xmin) FROM smart_triggerer.instance
             WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => :lease_seconds));

-- name: record_sample
-- One point of the page's chart, and points older than two hours dropped.
WITH old AS (  -- every instance's (a restarted one has a new job id), by the holder of shard 0 only
    DELETE FROM smart_triggerer.sample WHERE :prune AND at < now() - interval '2 hours'
)
INSERT INTO smart_triggerer.sample (job_id, waiters, groups, polls_saved_per_minute)
VALUES (:job_id, :waiters, :groups, :polls_saved);

-- name: claim_triggers
-- Marks the triggers this instance runs as its own (the UI and trigger-log paths read triggerer_id).
UPDATE trigger SET triggerer_id = :job_id
WHERE id = ANY(:ids) AND triggerer_id IS DISTINCT FROM :job_id;

-- name: instances
-- Every known instance and what it owns, for `smart-triggerer status`.
SELECT i.job_id, i.hostname, i.capacity, i.queues, i.health_url, i.started_at, i.heartbeat_at,
       i.stopped_at, i.runner_alive, i.waiters, i.groups, i.events_total, i.resumed_total,
       i.failures_total, i.watchers_failing, i.watcher_restarts_total, i.lag_p99_ms, i.rss_mb,
       i.accepting, i.limit_groups, i.shedding, i.fleet_full,
       (i.stopped_at IS NULL AND i.heartbeat_at > now() - make_interval(secs => :lease_seconds)
        AND i.runner_alive) AS healthy,
       (SELECT count(*) FROM smart_triggerer.shard_lease l
        WHERE l.owner_job_id = i.job_id AND l.expires_at > now()) AS shards_owned,
       (SELECT max(l.expires_at) FROM smart_triggerer.shard_lease l
        WHERE l.owner_job_id = i.job_id AND l.expires_at > now()) AS lease_expires_at
FROM smart_triggerer.instance i
WHERE i.stopped_at IS NULL OR i.stopped_at > now() - make_interval(secs => :keep_stopped_seconds)
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
-- Times out deferred members of these (fenced) shards one by one, exactly as the scheduler does, and
-- returns their trigger ids; rows locked in id order like every other writer of ours, rows someone else
-- holds are left to the next loop.
WITH due AS (
    SELECT ti.id, ti.trigger_id FROM task_instance ti
    JOIN smart_triggerer.trigger_identity i ON i.trigger_id = ti.trigger_id
    JOIN trigger t ON t.id = ti.trigger_id
    WHERE ti.state = 'deferred' AND ti.trigger_timeout < clock_timestamp() AND i.shard = ANY(:shards)
      AND ((:queues)::text[] IS NULL AND t.queue IS NULL OR t.queue = ANY((:queues)::text[]))
      AND (NOT CAST(:multi_team AS boolean) OR t.team_name IS NOT DISTINCT FROM CAST(:team AS text))
      -- its event came in time and is held (released before the deadline): not a time-out
      AND NOT EXISTS (SELECT 1 FROM smart_triggerer.held_event h WHERE h.trigger_id = ti.trigger_id)
    ORDER BY ti.id
    FOR UPDATE OF ti SKIP LOCKED
)
UPDATE task_instance AS ti
SET state = 'scheduled', next_method = '__fail__', next_kwargs = CAST(:next_kwargs AS jsonb),
    trigger_id = NULL, scheduled_dttm = now()
FROM due
WHERE ti.id = due.id
RETURNING due.trigger_id;

-- name: claim_asset_event_key
-- Returns a row only for the first claimant; a concurrent claimant waits on the unique index until the
-- first transaction ends, then gets nothing (or the key, if the first rolled back).
INSERT INTO smart_triggerer.asset_event_key (asset_id, idempotency_key, trigger_id)
VALUES (:asset_id, :key, :trigger_id)
ON CONFLICT DO NOTHING
RETURNING asset_id;

-- name: feed_triggers_present
-- How many of the change feed's three triggers exist with this version's function (Airflow recreating a
-- table drops them; a database upgraded from schema version 10 has them with the old functions, which the
-- next start re-installs with feed_change once).
SELECT count(*) FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
WHERE t.tgname IN ('smart_triggerer_feed_created', 'smart_triggerer_feed_deleted',
                   'smart_triggerer_feed_watched')
  AND NOT t.tgisinternal AND p.proname = 'feed_change';

-- name: install_feed_created
-- New trigger rows go into the feed (statement level: one insert per Airflow statement).
DROP TRIGGER IF EXISTS smart_triggerer_feed_created ON public.trigger;
CREATE TRIGGER smart_triggerer_feed_created AFTER INSERT ON public.trigger
REFERENCING NEW TABLE AS changed_rows FOR EACH STATEMENT EXECUTE FUNCTION smart_triggerer.feed_change();

-- name: install_feed_deleted
-- Deleted trigger rows (Airflow's clean_unused) go into the feed: their waiters left.
DROP TRIGGER IF EXISTS smart_triggerer_feed_deleted ON public.trigger;
CREATE TRIGGER smart_triggerer_feed_deleted AFTER DELETE ON public.trigger
REFERENCING OLD TABLE AS changed_rows FOR EACH STATEMENT EXECUTE FUNCTION smart_triggerer.feed_change();

-- name: install_feed_watched
-- A trigger row an asset watcher now refers to is read again (it may be waited on only from now).
DROP TRIGGER IF EXISTS smart_triggerer_feed_watched ON public.asset_watcher;
CREATE TRIGGER smart_triggerer_feed_watched AFTER INSERT ON public.asset_watcher
REFERENCING NEW TABLE AS changed_rows FOR EACH STATEMENT EXECUTE FUNCTION smart_triggerer.feed_change();

-- name: live_feed_readers
-- Instances other than this one (of any queue set) that read the change feed (an older version does not
-- publish feed_xmin, nor prune) and whose membership has not lapsed.
SELECT count(*) FROM smart_triggerer.instance
WHERE job_id <> :job_id AND stopped_at IS NULL AND feed_xmin IS NOT NULL
  AND heartbeat_at > now() - make_interval(secs => :lease_seconds);

-- name: startup_lock_timeout
-- A migration's lock waits are short: statements queue behind a DDL statement that waits for its lock,
-- running instances' heartbeats too. The instance starting tries the whole migration again instead.
SET LOCAL lock_timeout = '500ms';

-- name: short_lock_timeout
-- Dropping or creating a trigger on Airflow's tables waits for every open transaction on them, and every
-- deferral would queue behind it: give up quickly instead (the caller retries or leaves it).
SET LOCAL lock_timeout = '1s';

-- name: not_waited_on
-- Triggers of these shards whose row still exists although nothing waits on it: a task cleared while
-- deferred keeps its trigger_id with state NULL, which Airflow's clean_unused never deletes (NULL is not
-- "!= 'deferred'"). Read once a minute, so that such a coroutine stops polling.
SELECT i.trigger_id
FROM smart_triggerer.trigger_identity i
JOIN trigger t ON t.id = i.trigger_id
WHERE i.shard = ANY(:shards)
  AND NOT EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
  AND NOT EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
  AND NOT EXISTS (SELECT 1 FROM callback c WHERE c.trigger_id = t.id);

-- name: remove_feed
-- The last instance stopped: nothing reads the feed any more, so Airflow's tables lose its triggers (the
-- next instance to start installs them again, then reads every trigger row once).
DROP TRIGGER IF EXISTS smart_triggerer_feed_created ON public.trigger;
DROP TRIGGER IF EXISTS smart_triggerer_feed_deleted ON public.trigger;
DROP TRIGGER IF EXISTS smart_triggerer_feed_watched ON public.asset_watcher;
DELETE FROM smart_triggerer.trigger_change;

-- name: page_group_order
-- The Smart Triggerer page's groups: identity groups of deferred tasks of the DAGs in :dag_ids, biggest
-- first (then the longest waiting), each with its DAGs and oldest member's deferral: what every page is cut
-- from (page.py keeps it a few seconds). Keys and counts only, no member's details. A group is one identity
-- within one queue set's shard space (each set runs its own coroutine); a waiter not deduplicated is a group
-- of one (alone: its trigger id).
WITH per_dag AS (
    SELECT i.identity_hash, CASE WHEN NOT i.dedupable THEN i.trigger_id END AS alone,
           coalesce(t.queue, '') AS queue, ti.dag_id, count(*) AS members, min(t.created_date) AS since
    FROM task_instance ti
    JOIN smart_triggerer.trigger_identity i ON i.trigger_id = ti.trigger_id
    JOIN trigger t ON t.id = ti.trigger_id
    WHERE ti.state = 'deferred' AND ti.dag_id = ANY(:dag_ids)
    GROUP BY 1, 2, 3, 4
)
SELECT identity_hash, alone, queue, sum(members)::integer AS members, count(*)::integer AS dags,
       min(since) AS waiting_since
FROM per_dag
GROUP BY identity_hash, alone, queue
ORDER BY members DESC, waiting_since, identity_hash, alone, queue;

-- name: page_groups
-- One page of the groups page_group_order found (as arrays, in page order): each one's trigger class,
-- description and shard from its first member, the instance serving it, and its first :members deferred
-- tasks in the DAGs :dag_ids among its first :scanned, in the order they deferred. Reads the page's groups
-- only, and of their triggers and tasks only as many as it shows: each group's member ids are listed in
-- order (from trigger_identity_hash_member, at most :scanned of them, so a big group whose first members
-- are in DAGs the user may not read costs :scanned lookups, not the whole group; none when :dag_ids is
-- empty), and each member's trigger and task are then looked up by key alone, one member after the other
-- until enough are found. A group's hash is matched as a range of one value: with equality the planner,
-- misled by another shape's statistics, walked the whole primary key (trigger_id order) per group. Every
-- step is a subquery with OFFSET 0 or LIMIT, a fence the
-- planner cannot flatten or push other conditions into: on rows autovacuum has not analysed yet (minutes
-- after 50,000 waiters arrive) it guessed `state = 'deferred' AND dag_id = ANY(...)` matched one row and
-- read every waiter through ti_dag_state once per group, or once per member: seconds per page.
SELECT g.n, first.classpath, first.description, serving.owner_job_id, serving.hostname,
       (SELECT json_agg(json_build_object('dag_id', m.dag_id, 'run_id', m.run_id, 'task_id', m.task_id,
                                          'map_index', m.map_index, 'since', m.created_date)
                        ORDER BY m.trigger_id)
        FROM (SELECT i.trigger_id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, t.created_date
              FROM (SELECT i.identity_hash, i.trigger_id FROM smart_triggerer.trigger_identity i
                    WHERE i.identity_hash >= g.identity_hash AND i.identity_hash <= g.identity_hash
                      AND i.trigger_id = coalesce(g.alone, i.trigger_id)
                      AND cardinality(CAST(:dag_ids AS text[])) > 0
                    ORDER BY i.identity_hash, i.trigger_id LIMIT :scanned) i
              CROSS JOIN LATERAL (
                  SELECT t.created_date, t.queue FROM trigger t WHERE t.id = i.trigger_id OFFSET 0) t
              CROSS JOIN LATERAL (
                  SELECT ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.state FROM task_instance ti
                  WHERE ti.trigger_id = i.trigger_id OFFSET 0) ti
              WHERE coalesce(t.queue, '') = g.queue AND ti.state = 'deferred' AND ti.dag_id = ANY(:dag_ids)
              ORDER BY i.identity_hash, i.trigger_id  -- the index's order: nothing to sort, pulled as needed
              LIMIT :members) m) AS first_members
FROM unnest(CAST(:hashes AS bigint[]), CAST(:alone AS integer[]), CAST(:queues AS text[]))
     WITH ORDINALITY AS g(identity_hash, alone, queue, n)
LEFT JOIN LATERAL (  -- the first member (a big group's triggers are not read whole)
    SELECT t.classpath, i.description, i.shard, t.team_name
    FROM (SELECT i.identity_hash, i.trigger_id, i.description, i.shard FROM smart_triggerer.trigger_identity i
          WHERE i.identity_hash >= g.identity_hash AND i.identity_hash <= g.identity_hash
            AND i.trigger_id = coalesce(g.alone, i.trigger_id)
          ORDER BY i.identity_hash, i.trigger_id LIMIT :scanned) i
    CROSS JOIN LATERAL (
        SELECT t.classpath, t.queue, t.team_name FROM trigger t WHERE t.id = i.trigger_id OFFSET 0) t
    WHERE coalesce(t.queue, '') = g.queue
    ORDER BY i.identity_hash, i.trigger_id
    LIMIT 1
) first ON true
LEFT JOIN LATERAL (
    SELECT l.owner_job_id, inst.hostname FROM smart_triggerer.shard_lease l
    JOIN smart_triggerer.instance inst ON inst.job_id = l.owner_job_id
    WHERE l.shard = first.shard AND l.expires_at > now()
      -- the lease's space: its queue set, then '@<team>' for a team's instances (store.space_key)
      -- (without [core] multi_team every instance runs rows of any team, in the team-less spaces)
      AND split_part(l.queues, '@', 2) = CASE WHEN CAST(:multi_team AS boolean)
                                              THEN coalesce(first.team_name, '') ELSE '' END
      AND (g.queue = '' AND split_part(l.queues, '@', 1) = ''
           OR g.queue = ANY(string_to_array(split_part(l.queues, '@', 1), ',')))
    LIMIT 1
) serving ON true
ORDER BY g.n;

-- name: page_chart
-- The last hour's samples (and 150 s before it, to carry into its first minute), each instance's latest of
-- each minute, how old each is, and when its instance stopped (a stopped instance's last sample is not
-- carried past its stop: its successor has a new job id).
SELECT DISTINCT ON (s.job_id, date_trunc('minute', s.at))
       s.job_id, date_trunc('minute', s.at) AS minute, s.waiters, s.groups,
       s.polls_saved_per_minute AS polls_saved, extract(epoch FROM now() - s.at) AS age_seconds,
       i.stopped_at, i.queues AS space, i.job_id IS NOT NULL AS known, now() AS read_at
FROM smart_triggerer.sample s
LEFT JOIN smart_triggerer.instance i ON i.job_id = s.job_id
WHERE s.at > now() - interval '1 hour 150 seconds'
ORDER BY s.job_id, date_trunc('minute', s.at), s.at DESC;

-- name: delete_unused_triggers
-- Trigger rows among these that nothing refers to any more (their tasks resumed, failed or timed out in
-- this transaction, or released by release_left_waits): deleted now, as Airflow's clean_unused would a few
-- seconds later by reading every trigger row. Rows someone else holds are left to the sweep.
DELETE FROM trigger WHERE id IN (
    SELECT t.id FROM trigger t
    WHERE t.id = ANY(:trigger_ids)
      AND NOT EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM callback c WHERE c.trigger_id = t.id)
    ORDER BY t.id
    FOR UPDATE SKIP LOCKED
)
RETURNING id;

-- name: release_left_waits
-- Task instances no longer deferred (cleared, marked by hand, a state NULL included: Airflow's clean_unused
-- misses those) that still name a trigger: the name is cleared and the trigger ids returned. The WHERE is
-- the predicate of the partial index smart_triggerer_ti_left, which holds only such rows: this reads a
-- handful of rows, not every waiting task.
WITH left_rows AS (
    SELECT id, trigger_id FROM task_instance
    WHERE trigger_id IS NOT NULL AND state IS DISTINCT FROM 'deferred'
    ORDER BY id
    FOR UPDATE SKIP LOCKED
)
UPDATE task_instance AS ti SET trigger_id = NULL
FROM left_rows l
WHERE ti.id = l.id
RETURNING l.trigger_id;

-- name: left_index_state
-- The partial index behind release_left_waits: valid, still being built (or failed: invalid), or missing.
SELECT i.indisvalid,
       EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = c.oid) AS building
FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid
WHERE c.relname = 'smart_triggerer_ti_left' AND c.relnamespace = 'public'::regnamespace;

-- name: try_lock_left_index
-- One builder of the index at a time, across instances (a session lock: the build runs outside any
-- transaction).
SELECT pg_try_advisory_lock(7405412772);

-- name: unlock_left_index
SELECT pg_advisory_unlock(7405412772);

-- name: drop_left_index
-- A build that failed leaves an invalid index behind: dropped before building again.
DROP INDEX CONCURRENTLY IF EXISTS public.smart_triggerer_ti_left;

-- name: create_left_index
-- Only task rows that left deferred but still name a trigger (normally none or a few): tiny, and built
-- without blocking Airflow's writes. Kept when instances stop (docs/reference.md, uninstall).
CREATE INDEX CONCURRENTLY IF NOT EXISTS smart_triggerer_ti_left ON public.task_instance (id)
WHERE trigger_id IS NOT NULL AND state IS DISTINCT FROM 'deferred';
