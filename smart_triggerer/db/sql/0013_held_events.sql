-- Events held back for members that deferred too recently (resume_hold_seconds): stored in the event's
-- own fenced transaction, before the runner is told it was stored, so that a handover, a graceful stop or
-- a crash during the hold loses nothing. Whoever owns the member's shard resumes it from here once
-- release_at has passed (database clock) and starts no coroutine for it: the trigger does not fire again.
-- event: the event as the runner sent it (pydantic JSON of Airflow's DiscrimatedTriggerEvent).
-- release_at is never later than a second before the task's trigger_timeout: an event that came in time
-- is not failed as a timeout while held.
CREATE TABLE smart_triggerer.held_event (
    trigger_id integer PRIMARY KEY REFERENCES trigger(id) ON DELETE CASCADE,
    event text NOT NULL,
    release_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
