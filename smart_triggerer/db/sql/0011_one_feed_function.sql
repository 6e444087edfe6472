-- smart_triggerer schema, version 11: the change feed's three trigger functions of version 5 (one per
-- statement kind, otherwise alike) become one. Store.ensure_feed (every start) installs the feed triggers
-- with it, re-installing those an earlier version installed with the old functions. The three old functions
-- stay: during a rolling upgrade an instance of the previous version may (re-)install triggers with them at
-- its start, and both write the same rows. (A later migration that drops them must re-point such triggers
-- first.)
-- What a statement changed is in its transition table changed_rows:
--   INSERT on trigger: created (read these rows);  DELETE on trigger: deleted (their waiters left);
--   INSERT on asset_watcher: the trigger row it refers to is read again (it may be waited on only from now).
-- PL/pgSQL plans a statement when it first runs, so each branch is planned only for the table it reads.
CREATE OR REPLACE FUNCTION smart_triggerer.feed_change() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_TABLE_NAME = 'asset_watcher' THEN
        INSERT INTO smart_triggerer.trigger_change (trigger_id, created)
        SELECT trigger_id, true FROM changed_rows WHERE trigger_id IS NOT NULL;
    ELSE
        INSERT INTO smart_triggerer.trigger_change (trigger_id, created)
        SELECT id, TG_OP = 'INSERT' FROM changed_rows;
    END IF;
    RETURN NULL;
END
$$;
