"""Every wait of ours on the metadata database ends well within a lease.

A host can stop in the middle of a transaction and never come back (SIGSTOP, a paused VM, a network
partition). Its locks would then stay until PostgreSQL notices the dead client, about two hours with
default keepalives, and every other instance's takeover (and then its own renewal) would queue behind
them. So the triggerer's connections carry, from the moment they open:

- ``idle_in_transaction_session_timeout`` (half a lease): the server ends a session that sits inside a
  transaction without sending anything, and with it that session's locks, before its leases expire;
- ``lock_timeout`` (a quarter of a lease): no statement of ours queues behind a lock for longer; the loop
  retries it next time (shard claims and the lease fence skip locked rows altogether);
- TCP keepalives and ``tcp_user_timeout`` on both ends: a peer that stopped answering is noticed within
  about half a lease, on the server's side and on ours.

They carry ``jit = off`` too. Our statements are short indexed reads and writes, which compiling never
speeds up; but PostgreSQL decides to compile by the planner's estimated cost, and while the statistics lag
a burst of deferrals (or autovacuum is off) a batch read of 250 rows can be estimated above
``jit_above_cost``, and compiling then costs far more than the read itself, once per batch of a takeover
(docs/design.md, Measurements behind the code).

They are set as startup parameters of each connection, so they win over the database's and the role's
defaults. PgBouncer refuses unknown startup parameters (``options`` before 1.20; since then ``-c`` settings
it does not track): connect the triggerers to PostgreSQL directly (a few connections each), or list these
settings in PgBouncer's ``track_extra_parameters`` (1.26 and later; earlier versions track only settings
PostgreSQL reports to its clients); ``ignore_startup_parameters`` would drop them silently.
Building workloads reads rows, then deserializes DAGs between two statements (a big DAG may take longer
than the idle limit): those sessions run with each statement its own transaction (``each_statement_commits``),
so that they are never idle inside one and hold no lock on ``trigger`` or ``task_instance`` (not even the
share lock that a migration's ``ALTER TABLE`` queues behind) past the statement that took it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# server settings (GUCs) per connection; values in ms or s as PostgreSQL takes them
KEEPALIVE_INTERVAL_SECONDS = 1
KEEPALIVE_COUNT = 2
LIBPQ_DRIVERS = ("psycopg2", "psycopg")  # both take libpq's connection keywords
PLANNER = {"jit": "off"}  # not a wait's limit: what our statements need of the planner (see above)


def idle_limit_seconds(lease_seconds: float) -> float:
    """How long the server lets a session of ours sit idle inside its transaction before ending it."""
    return lease_seconds / 2


def limits(lease_seconds: float) -> dict[str, int]:
    """The server settings each of our connections starts with, for this lease."""
    keepalive_idle = max(1, math.floor(lease_seconds / 4))
    return {
        "lock_timeout": _ms(lease_seconds / 4),
        "idle_in_transaction_session_timeout": _ms(idle_limit_seconds(lease_seconds)),
        "tcp_user_timeout": _ms(lease_seconds / 2),
        "tcp_keepalives_idle": keepalive_idle,
        "tcp_keepalives_interval": KEEPALIVE_INTERVAL_SECONDS,
        "tcp_keepalives_count": KEEPALIVE_COUNT,
    }


def connect_params(lease_seconds: float, options: str | None = None) -> dict[str, Any]:
    """libpq parameters: the server settings (added to ``options`` already given) and our own side's
    keepalives and user timeout."""
    server = limits(lease_seconds)
    ours = " ".join(f"-c {name}={value}" for name, value in {**server, **PLANNER}.items())
    return {
        "options": f"{options} {ours}" if options else ours,
        "keepalives": 1,
        "keepalives_idle": server["tcp_keepalives_idle"],
        "keepalives_interval": KEEPALIVE_INTERVAL_SECONDS,
        "keepalives_count": KEEPALIVE_COUNT,
        "tcp_user_timeout": server["tcp_user_timeout"],
    }


def bound_waits(lease_seconds: float) -> Callable[..., None] | None:
    """From now on, every connection of Airflow's metadata engine in this process carries the limits (and
    no other engine: a hook's connections are the user's); open ones are replaced (the pool is emptied)."""
    from airflow import settings
    from sqlalchemy import event

    def with_limits(dialect: Any, _record: Any, _args: Any, params: dict[str, Any]) -> None:
        if dialect.driver in LIBPQ_DRIVERS:
            params.update(connect_params(lease_seconds, params.get("options")))

    engine = settings.engine
    if engine is None:
        return None
    event.listen(engine, "do_connect", with_limits)
    engine.dispose()
    return with_limits  # for event.remove


def each_statement_commits(session: Any) -> None:
    """From now on, each statement of this read-only session commits on its own (no transaction spans the
    thinking between two statements); a session that ran a statement already keeps its transaction (and
    the connection's limits)."""
    if not session.in_transaction():
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def close_pooled_connections() -> None:
    """Close every connection in Airflow's pool (opened again as needed). Called just before the trigger
    runner is forked: a child holds a copy of every socket its parent had open, and a database
    connection's session then ends only when both processes have closed it. The runner never uses one;
    holding them, a runner left behind by a killed supervisor kept that supervisor's sessions alive."""
    from airflow import settings

    if settings.engine is not None:
        settings.engine.dispose()
