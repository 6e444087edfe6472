-- smart_triggerer schema, version 5: a feed of what changed among trigger rows, so each loop reads the
-- changes instead of every waiter. Rows are written by statement-level triggers in the same transaction as
-- the change (its xid, read against the previous read's snapshot xmin: a late commit is never skipped).
-- created: a trigger row was inserted, or an asset watcher now refers to it (read it again);
-- otherwise the trigger row was deleted (Airflow's clean_unused: its waiters left).
CREATE TABLE smart_triggerer.trigger_change (
    trigger_id integer NOT NULL,
    created    boolean NOT NULL,
    xid        xid8 NOT NULL DEFAULT pg_current_xact_id()
);
CREATE INDEX trigger_change_xid ON smart_triggerer.trigger_change (xid);

-- SECURITY DEFINER: Airflow's components write trigger rows with whatever role they use; the feed is ours.
CREATE FUNCTION smart_triggerer.feed_created() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO smart_triggerer.trigger_change (trigger_id, created) SELECT id, true FROM changed_rows;
    RETURN NULL;
END
$$;

CREATE FUNCTION smart_triggerer.feed_deleted() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO smart_triggerer.trigger_change (trigger_id, created) SELECT id, false FROM changed_rows;
    RETURN NULL;
END
$$;

CREATE FUNCTION smart_triggerer.feed_watched() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO smart_triggerer.trigger_change (trigger_id, created)
    SELECT trigger_id, true FROM changed_rows WHERE trigger_id IS NOT NULL;
    RETURN NULL;
END
$$;

-- The triggers themselves are (re-)installed by Store.ensure_feed at every start (queries.sql).

-- Each instance publishes how far it has read the feed; rows every live instance has read are pruned.
ALTER TABLE smart_triggerer.instance ADD COLUMN feed_xmin xid8;
