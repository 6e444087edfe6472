"""The chaos run, short and seeded: every fault kind once or more, a few hundred waiters, the full checker.

The same implementation as ``bench/chaos.py`` (``tests/helpers/chaos/``); the checker itself is first
shown to catch each kind of violation on made-up audit trails, so a passing run means something.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg2
import pytest

from devkit.system import ensure_libfaketime
from tests.helpers.chaos import run_chaos
from tests.helpers.chaos.checker import (
    Observed,
    downtime,
    judge,
    judge_assets,
    judge_bridge,
    judge_consumed,
    on_host_clock,
    overlaps,
    wedges,
)
from tests.helpers.chaos.cluster import FaultRecord
from tests.helpers.chaos.constants import CONSUME, FAULT_KINDS, NUL_ASSET, ONCE, POISON, TEAM
from tests.helpers.chaos.plan import Identity, Profile, Waiter, make_plan
from tests.helpers.chaos.run import fired_by
from tests.helpers.fake_clock import ClockStep, FakeClockPostgres, continuous
from tests.helpers.tcp_proxy import Proxies
from tests.helpers.waiting import rows, wait_for

SEED = 20261123
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def entry(
    op: str,
    seconds: float,
    *,
    method: str = "execute_complete",
    kwargs: Any = None,
    due: float | None = None,
    txid: int = 1,
) -> dict[str, Any]:
    return {
        "op": op,
        "at": at(seconds),
        "new_state": "deferred" if op == "deferred" else "scheduled",
        "old_trigger_id": 7,
        "next_method": method,
        "next_kwargs": kwargs,
        "trigger_timeout": at(due) if due is not None else None,
        "txid": txid,
    }


def http_waiter(timeout_at: float | None = None) -> Waiter:
    return Waiter(0, Identity("http", "h00001"), wave=0, poll_interval=2.0, push=False, timeout_at=timeout_at)


def poison_waiter() -> Waiter:
    return Waiter(0, Identity(POISON, "p_poison"), wave=0, poll_interval=2.0, push=False)


EVENT = {"event": {"key": "h00001"}}
TIMEOUT = {"error": "Trigger timeout"}
NOT_STORED = {
    "error": "Trigger failure",
    "traceback": [
        "smart-triggerer: the trigger's event could not be stored: unsupported Unicode escape sequence\n"
    ],
}
BOOM = {"error": "Trigger failure", "traceback": ["boom"]}
BOUND = 10.0


@pytest.mark.parametrize(
    ("trail", "condition", "timeout_at", "verdict", "problem"),
    [
        ([entry("deferred", 0), entry("resolved", 12, kwargs=EVENT)], 10, None, "resumed", None),
        ([entry("deferred", 0)], 10, None, "lost", "still deferred"),
        (
            [
                entry("deferred", 0),
                entry("resolved", 12, kwargs=EVENT),
                entry("rewritten", 13, kwargs=EVENT, txid=2),
            ],
            10,
            None,
            "resumed",
            "doubled",
        ),
        (
            [entry("deferred", 0), entry("resolved", 12, kwargs={"event": {"key": "h00002"}})],
            10,
            None,
            "resumed",
            "wrong",
        ),
        ([entry("deferred", 0), entry("resolved", 9, kwargs=EVENT)], 10, None, "resumed", "premature"),
        ([entry("deferred", 0), entry("resolved", 25, kwargs=EVENT)], 10, None, "resumed", "stalled"),
        (
            [entry("deferred", 0), entry("resolved", 29, method="__fail__", kwargs=TIMEOUT, due=30)],
            60,
            30,
            "timed_out",
            "early",
        ),
        (
            [entry("deferred", 0), entry("resolved", 31, method="__fail__", kwargs=TIMEOUT, due=30)],
            60,
            30,
            "timed_out",
            None,
        ),
        (
            [entry("deferred", 0), entry("resolved", 31, method="__fail__", kwargs=TIMEOUT, due=30)],
            5,
            30,
            "timed_out",
            "wrong",
        ),
        (
            [entry("deferred", 0), entry("resolved", 12, method="__fail__", kwargs=BOOM)],
            10,
            None,
            "failed",
            "failed",
        ),
        ([entry("deferred", 0), entry("deleted", 12)], 10, None, "lost", "deleted"),
        # an event refused by the database fails its tasks with the cause: only the poison group may
        (
            [entry("deferred", 0), entry("resolved", 12, method="__fail__", kwargs=NOT_STORED)],
            10,
            None,
            "failed",
            "could not be stored",
        ),
    ],
)
def test_the_checker_catches_each_kind_of_violation(
    trail: list[dict[str, Any]], condition: float, timeout_at: float | None, verdict: str, problem: str | None
) -> None:
    due = at(timeout_at) if timeout_at is not None else None
    outcome = judge(http_waiter(timeout_at), trail, at(condition), BOUND, due)
    assert outcome.verdict == verdict
    if problem is None:
        assert outcome.problems == []
    else:
        assert any(problem in p for p in outcome.problems), outcome.problems


@pytest.mark.parametrize(
    ("trail", "verdict", "problem"),
    [
        (
            [entry("deferred", 0), entry("resolved", 12, method="__fail__", kwargs=NOT_STORED)],
            "rejected",
            None,
        ),
        (
            [
                entry("deferred", 0),
                entry("resolved", 12, method="__fail__", kwargs=NOT_STORED),
                entry("rewritten", 13, method="__fail__", kwargs=NOT_STORED, txid=2),
            ],
            "rejected",
            "doubled",
        ),
        (
            [entry("deferred", 0), entry("resolved", 12, kwargs={"event": {"key": "p_poison"}})],
            "failed",
            "wrong",
        ),
        ([entry("deferred", 0), entry("resolved", 12, method="__fail__", kwargs=BOOM)], "failed", "wrong"),
        ([entry("deferred", 0)], "lost", "still deferred"),
        (
            [entry("deferred", 0), entry("resolved", 25, method="__fail__", kwargs=NOT_STORED)],
            "rejected",
            "stalled",
        ),
        (
            [entry("deferred", 0), entry("resolved", 9, method="__fail__", kwargs=NOT_STORED)],
            "rejected",
            "premature",
        ),
    ],
)
def test_a_poison_event_must_fail_its_tasks_with_the_cause_exactly_once(
    trail: list[dict[str, Any]], verdict: str, problem: str | None
) -> None:
    outcome = judge(poison_waiter(), trail, at(10), BOUND)
    assert outcome.verdict == verdict
    if problem is None:
        assert outcome.problems == []
        assert outcome.stall == 2.0
    else:
        assert any(problem in p for p in outcome.problems), outcome.problems


@pytest.mark.parametrize(
    ("team", "ran_in", "wrong"),
    [
        ("alpha", "alpha", False),
        ("beta", "alpha", True),
        (None, "", False),
        (None, "beta", True),
        ("alpha", "", True),
    ],
)
def test_a_team_wait_must_resume_with_its_own_teams_mark(team: str | None, ran_in: str, wrong: bool) -> None:
    """Identical waits of two teams: an event made in another team's environment (or none) is wrong."""
    waiter = Waiter(0, Identity(TEAM, "h00001", team=team), wave=0, poll_interval=2.0, push=False)
    event = {"event": {"key": "h00001", "ran_in": ran_in}}
    trail = [entry("deferred", 0), entry("resolved", 12, kwargs=event)]
    outcome = judge(waiter, trail, at(10), BOUND)
    assert any("wrong" in p for p in outcome.problems) == wrong, outcome.problems


def test_a_consumed_message_must_reach_its_tasks_and_be_taken_once() -> None:
    ident = Identity(CONSUME, "q00_1")
    waiter = Waiter(0, ident, wave=0, poll_interval=1.0, push=False)
    mine = {"event": {"key": "q00_1", "message": ident.message}}

    def problems(kwargs: dict[str, Any]) -> list[str]:
        trail = [entry("deferred", 0), entry("resolved", 12, kwargs=kwargs)]
        return judge(waiter, trail, at(10), BOUND).problems

    assert problems(mine) == []
    assert problems({"event": {"key": "q00_1", "message": "message for q00_2"}})
    plan = make_plan(Profile.quick(SEED))
    keys = sorted({w.identity.name for w in plan.waiters if w.identity.kind == CONSUME})
    assert keys, "the short plan has consume-once waits"
    once = {k: [(f"message for {k}", "smart-1")] for k in keys}
    assert judge_consumed(plan, Observed({}, {}, {}, {}, [], [], T0, takes=once)) == []
    twice = {**once, keys[0]: once[keys[0]] * 2}
    never = {k: v for k, v in once.items() if k != keys[-1]}
    assert "taken 2 times" in judge_consumed(plan, Observed({}, {}, {}, {}, [], [], T0, takes=twice))[0]
    left = judge_consumed(plan, Observed({}, {}, {}, {}, [], [], T0, takes=never, queue_left=[keys[-1]]))
    assert left == [f"CONSUME {keys[-1]}: taken 0 times [], left in the queue"]


def test_stalls_are_measured_without_the_database_clock_steps() -> None:
    """A wait whose window spans a forward step of the database clock by 20 s stalled 2 s, not 22."""
    step = ClockStep(at(11), at(31))
    trail = [entry("deferred", 0), entry("resolved", 32, kwargs=EVENT)]
    stepped = Observed({"ti": trail}, {}, {}, {"h00001": at(10)}, [], [], T0, clock_steps=[step])
    assert judge(http_waiter(), trail, at(10), BOUND).problems  # measured raw: 22 s, stalled
    host = on_host_clock(stepped)
    outcome = judge(http_waiter(), host.audit["ti"], host.conditions["h00001"], BOUND)
    assert (outcome.problems, outcome.stall) == ([], 2.0)
    # a moment the step jumped over (a deadline) is the instant of the step; later steps add up
    assert continuous(at(20), [step]) == at(11)
    assert continuous(at(5), [step]) == at(5)
    assert continuous(at(50), [step, ClockStep(at(40), at(45))]) == at(25)
    # a timeout due inside the skipped stretch, written 1 s after the step: 1 s late, not early
    due = continuous(at(20), [step])
    timed_out = [entry("deferred", 0), entry("resolved", 12, method="__fail__", kwargs=TIMEOUT, due=20)]
    outcome = judge(http_waiter(timeout_at=20), timed_out, at(60), BOUND, due)
    assert (outcome.verdict, outcome.problems, outcome.stall) == ("timed_out", [], 1.0)


def test_stalls_are_measured_without_postgresqls_own_downtime() -> None:
    """A wait whose window spans 4 s of PostgreSQL down (a pg_restart) stalled 10 s, not 14: nothing can be
    stored while the database is away. Without the window it is a stall over the bound."""
    trail = [entry("deferred", 0), entry("resolved", 24, kwargs=EVENT)]
    restart = FaultRecord("pg_restart", "postgres", at(12), ended=at(16))
    other = FaultRecord("sigkill", "smart-1", at(13), ended=at(14))
    assert judge(http_waiter(), trail, at(10), 12.0).problems  # 14 s
    outcome = judge(http_waiter(), trail, at(10), 12.0, down=downtime([restart, other]))
    assert (outcome.problems, outcome.stall) == ([], 10.0)
    # the same for a timeout: due at 10 s, written at 24 s, 4 s of it with PostgreSQL down
    timed_out = [entry("deferred", 0), entry("resolved", 24, method="__fail__", kwargs=TIMEOUT, due=10)]
    assert judge(http_waiter(timeout_at=10), timed_out, None, 12.0, at(10)).problems  # 14 s
    outcome = judge(http_waiter(timeout_at=10), timed_out, None, 12.0, at(10), down=downtime([restart]))
    assert (outcome.verdict, outcome.problems, outcome.stall) == ("timed_out", [], 10.0)


def test_a_wait_across_a_wedged_runner_gets_the_stall_threshold_more() -> None:
    """A wait whose condition held while a runner was stopped alone may move only once that instance
    stepped out (``runner_stall_seconds`` after its runner last answered): the checker allows that much
    more, and only for waits whose window meets a wedge."""
    wedge = FaultRecord("wedge", "smart-1", at(10), ended=at(30))
    kill = FaultRecord("sigkill", "smart-2", at(40), ended=at(42))
    windows = wedges([wedge, kill])
    assert windows == [(at(10), at(30))]
    assert overlaps(at(5), at(12), windows) and overlaps(at(29), at(45), windows)
    assert not overlaps(at(31), at(45), windows) and not overlaps(at(1), at(9), windows)
    assert not overlaps(None, at(12), windows)


def test_the_bridge_checker_wants_the_nul_extra_dead_lettered_alone_and_the_rest_delivered() -> None:
    events: list[tuple[int, str, dict[str, Any], dt.datetime | None]] = [
        (1, "chaos://status/a0", {}, at(1)),
        (2, NUL_ASSET, {}, at(2)),
        (3, "chaos://status/a1", {}, at(3)),
    ]
    outbox = {
        1: ("delivered", None),
        2: ("dead", "not relayed: PostgreSQL cannot store its extra as jsonb"),
        3: ("delivered", None),
    }
    observed = Observed({}, {}, {}, {}, [], events, T0, outbox=outbox, delivered=Counter({1: 1, 3: 2}))
    result = judge_bridge(observed)
    assert (result.violations, result.delivered, result.redelivered) == ([], 2, 1)
    observed.outbox[2] = ("pending", None)
    observed.delivered[2] = 1
    del observed.delivered[3]
    problems = judge_bridge(observed).violations
    assert len(problems) == 3 and "event 3" in problems[-1], problems
    observed.asset_events.append((4, NUL_ASSET, {}, at(4)))
    assert any("made 2 asset events" in p for p in judge_bridge(observed).violations)


def test_the_asset_checker_wants_exactly_one_event_per_success_row_on_its_own_asset() -> None:
    def event(event_id: int, asset: str, row_id: int, table: str) -> tuple[int, str, dict[str, Any], Any]:
        payload = {"row_id": row_id, "table_name": table}
        return (event_id, f"chaos://status/{asset}", {"payload": payload}, at(3))

    rows = [
        (1, "asset.a0", "SUCCESS", at(1)),
        (2, "asset.a0", "START", at(1)),
        (3, "asset.a1", "SUCCESS", at(1)),
        (4, "asset.a1", "SUCCESS", at(1)),
        (5, "asset.a1", "SUCCESS", at(1)),
    ]
    events = [
        event(10, "a0", 1, "asset.a0"),
        event(11, "a0", 1, "asset.a0"),
        event(12, "a0", 2, "asset.a0"),
        event(13, "a0", 3, "asset.a1"),
        event(14, "a1", 5, "asset.a1"),
    ]
    observed = Observed({}, {}, {}, {}, rows, events, T0)
    result = judge_assets(observed, BOUND)
    assert (len(result.lost), len(result.doubled), len(result.wrong)) == (1, 1, 2)
    assert result.failing_rows == [1, 4]
    assert result.latencies == [2.0, 2.0, 2.0]


def test_an_event_whose_holder_was_struck_before_storing_it_gets_one_more_takeover() -> None:
    """Seed 2514: the watcher's owner was SIGKILLed before it polled; the next owner fired the event and
    was partitioned from PostgreSQL before storing it; the third stored it 12.4 s after the row. Two
    takeovers, each within the bound: allowed only with the logs' evidence of a firing by another process
    before the one that stored it (a firing after the store, as in ack mode, allows nothing)."""

    def status_event(event_id: int, row_id: int, stored: float) -> tuple[int, str, dict[str, Any], Any]:
        return (
            event_id,
            "chaos://status/a7",
            {"payload": {"row_id": row_id, "table_name": "asset.a7"}},
            at(stored),
        )

    rows = [(row_id, "asset.a7", "SUCCESS", at(0)) for row_id in (1, 2, 3)]
    events = [status_event(10, 1, 17), status_event(11, 2, 17), status_event(12, 3, 17)]
    fired = {
        1: {"smart-3.13": at(6.6), "smart-1.18": at(16.8)},
        2: {"smart-1.18": at(16.8)},
        3: {"smart-1.18": at(16.8), "smart-2.5": at(18)},
    }
    stored = {10: "smart-1.18", 11: "smart-1.18", 12: "smart-1.18"}
    observed = Observed({}, {}, {}, {}, rows, events, T0, fired_by=fired, stored_by=stored)
    result = judge_assets(observed, BOUND, retake=7.0)
    assert result.stalled == [
        f"row {n} (asset.a7): its event came 17.0s later (bound {BOUND:g}s)" for n in (2, 3)
    ]
    assert result.refired == [
        "row 1 (asset.a7): 17.0s, fired before it was stored by 1 struck instance(s) (bound 17s)"
    ]
    observed.asset_events[0] = status_event(10, 1, 20)  # past the second takeover too
    later = judge_assets(observed, BOUND, retake=7.0).stalled
    assert later[0] == "row 1 (asset.a7): its event came 20.0s later (bound 17s)"
    observed.stored_by.clear()  # who stored it unknown: no allowance
    assert len(judge_assets(observed, BOUND, retake=7.0).stalled) == 3


def test_firings_are_read_from_each_instance_process_log(tmp_path: Path) -> None:
    line = (
        "2026-11-25T15:41:30.962263Z [info     ] Trigger fired event            "
        "[airflow.jobs.triggerer_job_runner] dag_id=None loc=triggerer_job_runner.py:1046 map_index=None "
        "name='ID 6' result=\"TriggerEvent<{'row_id': 1227, 'table_name': 'asset.a7', 'status': "
        "'SUCCESS'}>\" run_id=None"
    )
    later = line.replace("15:41:30.962263", "15:41:33.000000")
    (tmp_path / "smart-3.13.log").write_text(f"{line}\n{later}\n")
    (tmp_path / "smart-1.log").write_text(line.replace("1227", "1228") + "\n")
    (tmp_path / "relay.log").write_text(line + "\n")  # not an instance
    assert fired_by(tmp_path) == {
        1227: {"smart-3.13": dt.datetime(2026, 11, 25, 15, 41, 30, 962263, tzinfo=dt.UTC)},
        1228: {"smart-1": dt.datetime(2026, 11, 25, 15, 41, 30, 962263, tzinfo=dt.UTC)},
    }


def test_the_short_plan_has_every_fault_kind_and_is_reproducible() -> None:
    plan = make_plan(Profile.quick(SEED))
    assert {f.kind for f in plan.faults} == set(FAULT_KINDS)
    kinds = Counter(f.kind for f in plan.faults)
    assert all(kinds[kind] == 1 for kind in ONCE), kinds
    poison = [w for w in plan.waiters if w.identity.kind == POISON]
    assert len(poison) >= 2 and all(w.timeout_at is None for w in poison)
    assert poison[0].identity.flip_at == next(f.at for f in plan.faults if f.kind == "poison")
    assert plan.describe() == make_plan(Profile.quick(SEED)).describe()
    assert any(w.timeout_at is not None for w in plan.waiters)
    assert len({w.identity.key for w in plan.waiters}) < len(plan.waiters)
    # identical waits across teams: the same key waited on by every team (its twins seeded before the start)
    teams = [w.identity for w in plan.waiters if w.identity.kind == TEAM]
    by_key: dict[str, set[str | None]] = {}
    for ident in teams:
        by_key.setdefault(ident.name, set()).add(ident.team)
    assert by_key and all({"alpha", "beta"} <= found for found in by_key.values()), by_key
    assert all(w.wave == 0 for w in plan.waiters if w.identity.kind in (TEAM, CONSUME))
    # a consume fault comes a lease and a loop after any fault that leaves stale coroutines behind
    stale = ("sigkill", "sigstop", "freeze", "partition", "db_error", "clock_step", "wedge", "lag")
    for consume in (f for f in plan.faults if f.kind == "consume"):
        assert consume.slot.startswith("smart-")
        before = [f for f in plan.faults if f.at < consume.at and f.kind in stale]
        assert all(
            consume.at - (f.at + (0 if f.kind == "clock_step" else f.hold)) >= plan.profile.retake
            for f in before
        ), (consume, before)


def test_a_partition_holds_what_is_sent_until_it_heals(pg_db: str) -> None:
    """The partition fault is real: a statement sent while cut never reaches the server; after the heal
    it does, on the same connection, and nothing was lost."""
    port = urlsplit(pg_db).port
    assert port is not None
    with Proxies(("127.0.0.1", port)).running() as proxies:
        proxy = proxies.get("smart-1")
        conn = psycopg2.connect(pg_db.replace(f":{port}/", f":{proxy.port}/"), application_name="cut-off")
        conn.autocommit = True
        try:
            cur = conn.cursor()
            cur.execute("SELECT 1")
            proxies.partition("smart-1")
            answered: list[Any] = []

            def send() -> None:
                cur.execute("SELECT 2")
                answered.append(cur.fetchone())

            sender = threading.Thread(target=send)
            sender.start()
            # the session stays idle on its previous statement for as long as the cut lasts
            sender.join(1.5)
            assert sender.is_alive() and not answered
            session = "SELECT state, query FROM pg_stat_activity WHERE application_name = 'cut-off'"
            assert rows(pg_db, session) == [("idle", "SELECT 1")]
            proxies.heal("smart-1")
            sender.join(10)
            assert answered == [(2,)]
        finally:
            conn.close()


def test_the_database_clock_steps_forward_while_the_server_runs(tmp_path: Path) -> None:
    """The clock-step fault is real: the server's clock jumps for every session, the host's does not."""
    server = FakeClockPostgres(tmp_path / "pgdata", library=ensure_libfaketime())
    server.start()
    try:

        def offset() -> float:
            found = rows(server.dsn, "SELECT clock_timestamp()")[0][0]
            return float((found - dt.datetime.now(dt.UTC)).total_seconds())

        assert abs(offset()) < 1
        step = server.step(30.0)
        assert (step.after - step.before).total_seconds() == 30.0
        wait_for(offset, lambda o: abs(o - 30) < 1, 5, "the server's clock 30 s ahead")
        now = rows(server.dsn, "SELECT clock_timestamp()")[0][0]
        assert abs((continuous(now, [step]) - dt.datetime.now(dt.UTC)).total_seconds()) < 1
    finally:
        server.stop()


@pytest.mark.e2e
@pytest.mark.alone
@pytest.mark.timeout(600)
def test_short_chaos_run_loses_doubles_and_stalls_nothing(tmp_path: Path) -> None:
    logs = tmp_path / "instance-logs"  # kept by pytest with the test's tmp_path, for a failure's analysis
    report = run_chaos(Profile.quick(SEED), log=print, keep_logs=logs)
    print(report.text())
    assert report.ok, f"{report.text()}\ninstance logs: {logs}"
