"""Membership notices (smart_triggerer/db/notices.py): a join, a graceful stop and a handover are acted on by
the peers at once, not at their next loop.

The instances here load, and so renew their leases, every 20 s (a 60 s lease): without the
notices a newcomer would get its share, and a stopped instance's shards a new owner, up to 20 s later.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from datetime import datetime
from pathlib import Path

import psutil
import psycopg2.extensions

from devkit.devstack import AirflowConfig, AirflowStack, Component
from tests.helpers.descriptors import descriptors
from tests.helpers.waiting import lease_owners, rows, wait_for
from tests.integration.test_smart_triggerer import _job_of, health_url, start

SLOW = {"LOOP_SECONDS": "20", "LEASE_SECONDS": "60"}
NOTICE_BOUND = 6.0  # well under the 20 s between renewals, well over a renewal on a busy host
NOTICED = "a peer joined, stopped or handed shards over"


def notices_since(component: Component, since: float) -> int:
    """How many notices the component logged from ``since`` (a wall-clock time) on."""
    count = 0
    for line in component.log_tail(1_000_000).splitlines():
        if NOTICED not in line:
            continue
        try:  # the tail may begin within a line
            logged = datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        count += logged >= since
    return count


def test_joins_and_graceful_stops_are_acted_on_at_once(airflow_stack: AirflowStack) -> None:
    dsn = airflow_stack.config.database_dsn
    first = start(airflow_stack, "smart-first", **SLOW)
    first_job = _job_of(health_url(first))
    wait_for(
        lambda: lease_owners(dsn),
        lambda o: set(o.values()) == {first_job},
        60,
        "the first instance to own every shard",
    )

    second = start(airflow_stack, "smart-second", **SLOW)
    second_job = _job_of(health_url(second))  # registered: its join's notice is out
    joined = time.monotonic()
    wait_for(
        lambda: lease_owners(dsn),
        lambda o: set(o.values()) == {first_job, second_job},
        40,
        "the newcomer to get its share",
        interval=0.1,
    )
    split = time.monotonic() - joined
    # the join's notice made the first hand shards over at once, the handover's notice the newcomer
    # claim them at once: without either, up to a loop (20 s)
    assert split <= NOTICE_BOUND, f"the newcomer got its share {split:.1f}s after it joined"
    first.wait_for_log(f"peers=['{second_job}']", timeout=5)
    # The first's handover notice may reach the newcomer, or not: when the first handed over before the
    # newcomer's first load, that load finds the shards free and takes them (its listener may not be up
    # yet). The newcomer hearing its peer is checked on the stop below.

    stopped_at = time.time()
    stopped = time.monotonic()
    first.signal(signal.SIGTERM)
    wait_for(
        lambda: lease_owners(dsn),
        lambda o: set(o.values()) == {second_job},
        40,
        "the survivor to own every shard",
        interval=0.05,
    )
    taken = time.monotonic() - stopped
    print(
        f"\nshare of a newcomer after {split:.2f}s; shards of a stopped instance taken after {taken:.2f}s; "
        "renewals every 20 s"
    )
    wait_for(
        lambda: notices_since(second, stopped_at), lambda n: n > 0, 5, "the survivor to log the stop's notice"
    )
    assert taken <= NOTICE_BOUND, f"the stopped instance's shards were taken after {taken:.1f}s"
    assert first.process is not None and first.process.wait(15) == 0


def test_a_listener_hears_peers_not_itself_and_listens_again_after_its_connection_broke(
    airflow_config: AirflowConfig,
) -> None:
    from smart_triggerer.db import notices as module
    from tests.helpers.airflow_orm import use_airflow_db

    use_airflow_db(airflow_config.database_dsn)
    dsn = airflow_config.database_dsn
    heard: list[int] = []
    listener = module.MembershipNotices(7, None, lambda: heard.append(listener.received))
    selector = selectors.DefaultSelector()

    def notify(job_id: int, queues: str | None = None) -> None:
        rows(dsn, "SELECT pg_notify(%s, %s)", module.CHANNEL, module.notice_payload(job_id, queues))

    def serve(timeout: float = 5.0) -> None:
        """One select, as the supervisor's loop does: the handler runs, the connection closes on False."""
        for key, _ in selector.select(timeout):
            handler, on_close = key.data
            if not handler(key.fileobj):
                on_close(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]  # the connection the listener registered

    try:
        listener.attach(selector)
        assert listener.conn is not None
        notify(7)  # its own notice: read, not acted on
        notify(6, "gpu")  # an instance of another queue set (its own shards): ignored too
        notify(8)
        wait_for(lambda: (serve(0.5), heard)[1], lambda h: h != [], 10, "the peer's notice")  # type: ignore[func-returns-value]
        assert listener.received == 1

        backend = listener.conn.info.backend_pid
        rows(dsn, "SELECT pg_terminate_backend(%s)", backend)
        wait_for(lambda: (serve(0.5), listener.conn)[1], lambda c: c is None, 10, "the broken connection")  # type: ignore[func-returns-value]
        listener.attach(selector)  # within RETRY_SECONDS of the last try: not yet
        assert listener.conn is None
        listener.tried_at -= module.RETRY_SECONDS
        listener.attach(selector)
        assert listener.conn is not None and listener.conn.info.backend_pid != backend
        notify(9)
        wait_for(lambda: (serve(0.5), heard)[1], lambda h: len(h) == 2, 10, "a notice after listening again")
    finally:
        listener.close()
        selector.close()


def listening_backend(dsn: str) -> int | None:
    """The server process of the database's LISTEN session, None while nobody listens."""
    from smart_triggerer.db.notices import CHANNEL

    found = rows(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query = %s",
        f"LISTEN {CHANNEL}",
    )
    return int(found[0][0]) if found else None


def stale_registrations(pid: int) -> list[str]:
    """What the process's epoll sets watch that is no longer the descriptor of that number: a socket
    closed under its registration (another process holds it, so epoll kept it, readable for ever)."""
    stale = []
    for fd, target_of in descriptors(pid).items():
        if "eventpoll" not in target_of:
            continue
        try:
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except FileNotFoundError:  # closed since it was listed
            continue
        for line in info.splitlines():
            if not line.startswith("tfd:"):
                continue
            fields = line.split()
            target, inode = fields[1], int(fields[fields.index("pos:0") + 1].removeprefix("ino:"), 16)
            try:
                current = os.stat(f"/proc/{pid}/fd/{target}").st_ino
            except FileNotFoundError:
                current = None
            if current != inode:
                stale.append(line)
    return stale


def database_sockets(pid: int, dsn: str) -> list[int]:
    """Inodes of the process's TCP connections to the database server's port."""
    port = int(psycopg2.extensions.parse_dsn(dsn).get("port", 5432))
    mine = {int(t[len("socket:[") : -1]) for t in descriptors(pid).values() if t.startswith("socket:[")}
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            remote_port, inode = int(fields[2].rsplit(":", 1)[1], 16), int(fields[9])
            if remote_port == port and inode in mine:
                found.append(inode)
    return found


def test_a_broken_listening_connection_leaves_the_loop_waiting_and_the_runner_holds_no_session(
    airflow_stack: AirflowStack,
) -> None:
    """The server ends the listening session: the instance listens again on a new one, and its loop goes
    on waiting for work (it spun at a whole core, for ever, on the dead socket's registration); the trigger
    runner, forked from the supervisor, holds none of its database connections."""
    dsn = airflow_stack.config.database_dsn
    instance = start(airflow_stack, "smart-listening")
    _job_of(health_url(instance))
    first = wait_for(lambda: listening_backend(dsn), lambda p: p is not None, 30, "the instance listening")
    supervisor = psutil.Process(instance.pid)
    (runner,) = supervisor.children()
    assert database_sockets(supervisor.pid, dsn), "the supervisor's own sessions (the check can see them)"
    assert database_sockets(runner.pid, dsn) == [], "the runner holds database connections"

    rows(dsn, "SELECT pg_terminate_backend(%s)", first)
    wait_for(lambda: listening_backend(dsn), lambda p: p not in (None, first), 40, "listening again")
    wait_for(lambda: stale_registrations(supervisor.pid), lambda s: s == [], 10, "no stale registration")
    before = supervisor.cpu_times()
    time.sleep(4)  # a measuring window, not a wait for something to happen
    after = supervisor.cpu_times()
    busy = (after.user - before.user) + (after.system - before.system)
    assert busy < 1.0, f"the idle supervisor used {busy:.1f} s of CPU in 4 s: its loop spins"
    assert database_sockets(runner.pid, dsn) == []
