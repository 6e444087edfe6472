-- The dataset bridge's named queries (dataset_bridge/store.py): each follows a "-- name:" line.

-- name: present_tables
-- Which of these tables exist.
SELECT t FROM unnest(CAST(:tables AS text[])) t WHERE to_regclass(t) IS NOT NULL;

-- name: panel_targets
-- The page: each relay target's backlog, dead letters, deliveries and oldest pending row.
SELECT coalesce(json_agg(t ORDER BY t.target), '[]') FROM (
    SELECT target, count(*) FILTER (WHERE status = 'pending') AS backlog,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           count(*) FILTER (WHERE status = 'delivered') AS delivered,
           min(created_at) FILTER (WHERE status = 'pending') AS oldest_pending
    FROM dataset_bridge.outbox GROUP BY target) t;

-- name: panel_dead_letters
-- The page: the last 20 dead letters.
SELECT coalesce(json_agg(d), '[]') FROM (
    SELECT target, asset_name, attempts, last_error, created_at FROM dataset_bridge.outbox
    WHERE status = 'dead' ORDER BY id DESC LIMIT 20) d;

-- name: panel_watermarks
-- The page: each status table's watermarks.
SELECT coalesce(json_agg(w ORDER BY w.status_table, w.table_name), '[]') FROM (
    SELECT status_table, table_name, last_id, updated_at FROM dataset_bridge.status_watermark) w;

-- name: panel_requeued
-- The page: the reconciler's re-queued runs, in all and in the last hour.
SELECT json_build_object('total', count(*),
                         'last_hour', count(*) FILTER (WHERE queued_at > now() - interval '1 hour'))
FROM dataset_bridge.reconciled WHERE outcome = 'requeued';
