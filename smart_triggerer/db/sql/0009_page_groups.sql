-- smart_triggerer schema, version 9: what the Smart Triggerer page reads, and what it must not show.
-- A group's members in the order they deferred (trigger id), from the first: the page lists a group's
-- first members without reading the rest of a big group. It also serves every lookup by identity_hash.
CREATE INDEX IF NOT EXISTS trigger_identity_hash_member
    ON smart_triggerer.trigger_identity (identity_hash, trigger_id);
DROP INDEX IF EXISTS smart_triggerer.trigger_identity_hash;

-- SqlConditionTrigger described its wait with its SQL, which may hold a rendered secret: descriptions the
-- release before stored so are dropped (the page shows the class name for them; this release describes the
-- wait by its connection and a fingerprint of the statement, never its text).
UPDATE smart_triggerer.trigger_identity i SET description = NULL
FROM trigger t
WHERE t.id = i.trigger_id AND t.classpath = 'triggers.sql_condition.SqlConditionTrigger'
  AND i.description !~ '^a true answer from [^ ]+ to query #[0-9a-f]{8}$';

-- (No percent sign in a migration: the driver would read it as a parameter.)
-- A wait without `since` read "loaded since -", one without a run id "run -": the dash goes.
UPDATE smart_triggerer.trigger_identity i
SET description = replace(i.description, ' loaded since - (', ' loaded (')
FROM trigger t
WHERE t.id = i.trigger_id AND t.classpath = 'triggers.table_load.TableLoadTrigger'
  AND strpos(i.description, ' loaded since - (') > 0;
UPDATE smart_triggerer.trigger_identity i
SET description = replace(i.description, ' run -, tasks ', ', tasks ')
FROM trigger t
WHERE t.id = i.trigger_id AND t.classpath = 'triggers.external_dag.ExternalDagTrigger'
  AND strpos(i.description, ' run -, tasks ') > 0;
