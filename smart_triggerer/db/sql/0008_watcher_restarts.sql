-- smart_triggerer schema, version 8: failed asset watchers start again with backoff, and say so.
-- watchers_failing: groups with asset watchers whose coroutine failed and that stored no event since;
-- watcher_restarts_total: such coroutines started again (status --json, /metrics and the page show both).
ALTER TABLE smart_triggerer.instance
    ADD COLUMN watchers_failing integer NOT NULL DEFAULT 0,
    ADD COLUMN watcher_restarts_total bigint NOT NULL DEFAULT 0;
