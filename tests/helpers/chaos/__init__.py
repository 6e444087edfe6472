"""A Jepsen-style chaos run of the smart triggerer: the workload (plan.py), the faults
(cluster.py) and the checker (checker.py).

``bench/chaos.py`` (20 minutes, thousands of waiters) and ``tests/e2e/test_chaos.py`` (a short seeded run)
share this package, so the suite exercises the very checker the long run relies on.

What runs: a private PostgreSQL whose clock can be stepped (libfaketime; it must also be restarted, so never
the one ``SMART_TRIGGERER_DSN`` names), an Airflow metadata database with an audit trigger of ours on
``task_instance`` and ``asset_event``, a "warehouse" database (an ETL status table, a flags table), an HTTP
condition source, a two-team fleet (``[core] multi_team``): N ``smart-triggerer run`` instances of no
team (``smart-N``) and two per team (``alpha-N``, ``beta-N``, ``--team-name``, ``TEAM_MARK`` in their
environment), each reaching the metadata database through a TCP
proxy of its own (``tcp_proxy.py``) and naming its sessions (``PGAPPNAME`` = the instance's name), and the
dataset bridge's outbox (the instances' asset manager) with a relay to an inbox stub. Seeded deferred waiters
(``TableLoadTrigger`` push and pull, ``SqlConditionTrigger``, ``PollTrigger``; ``TeamSourcePollTrigger``:
identical waits of both teams and of no team, whose event carries the ``TEAM_MARK`` of the environment
that ran it; ``QueueTakeTrigger``: consume-once waits; 40% duplicates; some with a ``trigger_timeout`` due
during the run) and status-table asset watchers wait while conditions flip, new status rows arrive and a
seeded schedule of faults runs:

- ``sigkill``, ``sigstop`` (past the lease, then SIGCONT), ``sigterm`` (and a restart), ``join`` and
  ``leave`` (a fourth instance), ``pg_restart`` (PostgreSQL down for a while);
- ``freeze``: an instance SIGSTOPped while one of its sessions is inside a transaction (seen in
  pg_stat_activity, confirmed 'idle in transaction' after the stop) and never woken: SIGKILLed after the
  hold and replaced, as an orchestrator would;
- ``partition``: the instance's proxy stops forwarding both ways for the hold, then heals;
- ``lag``: the instance's trigger runner is starved (stopped 1.2 s of every 1.5 s) for the hold: its event
  loop lags over the run's ``max_loop_lag_ms`` (800) and placement hands its shards over while it runs
  on, then takes them back once it is calm (moves by load, while the next faults run);
- ``db_error``: right after the instance renewed its leases (its lease rows' expiry moved), its sessions
  are terminated again and again for about a second, until its log says "database unavailable";
- ``clock_step``: the database's clock jumps forward (forward only; see ``fake_clock.py``);
- ``wedge``: the instance's trigger runner alone SIGSTOPped past ``runner_stall_seconds`` (a wedged event
  loop): its log must show it handed every shard over; it rejoins once the runner answers again;
- ``log_hang``: the instance's remote log store (``tests/helpers/remote_logs.py``, one per instance
  process) stops answering for 1.5-2.5 leases: uploads block, and the instance's log must not say its
  leases could not be renewed or lapsed;
- ``consume``: messages queued for ten consume-once waits (``QueueTakeTrigger``, one message each,
  handed out once), then one instance of no team SIGTERMed 0.7 s later, as they are taken: each message
  must reach its own task (its fault comes a lease and a loop after any fault that leaves stale
  coroutines behind: what those take is lost by nature, see docs/guides/deduplicable-triggers.md);
- ``poison``: the source hands one group of waiters an event with a ``\u0000`` (jsonb refuses it): their
  tasks must fail with the cause ("could not be stored"), exactly once;
- ``nul_extra``: an asset watcher's event whose extra holds a ``\u0000``: one asset event in Airflow, no
  outbox row in the producer's transaction, dead-lettered alone by the relay's sweep, all other events
  delivered.

What is checked, from the databases alone: every waiter left DEFERRED exactly once (the audit trigger logs
every transition with ``clock_timestamp()``), with its own event (a team's wait: its own team's mark; a
consume-once wait: its own message, taken exactly once), or timed out no earlier than due, or (the
poison group) failed with the cause; nothing else failed; every SUCCESS status row made exactly one asset
event, delivered by the relay; no instance's leases lapsed while its log store hung; and no wait stalled
longer than ``lease + poll interval + 3 s`` after its condition held (``runner_stall_seconds`` more across
a wedge; condition times are written by the same PostgreSQL server, so one clock measures both ends; the
clock's steps are taken out of every duration, ``fake_clock.continuous``).
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.chaos.checker import Report
from tests.helpers.chaos.constants import Log
from tests.helpers.chaos.plan import Profile
from tests.helpers.chaos.run import ChaosRun


def run_chaos(profile: Profile, log: Log = print, keep_logs: Path | None = None) -> Report:
    """Run one chaos experiment end to end; every process and temp dir is gone when it returns."""
    return ChaosRun(profile, log, keep_logs).run()
