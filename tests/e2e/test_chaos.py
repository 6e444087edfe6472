"""The chaos run, short and seeded: every fault kind once or more, a few hundred waiters, the full checker.

The same implementation as ``bench/chaos.py`` (``tests/helpers/chaos.py``); the checker itself is first
shown to catch each kind of violation on made-up audit trails, so a passing run means something.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.chaos import (
    FAULT_KINDS,
    Identity,
    Observed,
    Profile,
    Waiter,
    judge,
    judge_assets,
    make_plan,
    run_chaos,
)

SEED = 20261123
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def entry(op: str, seconds: float, *, method: str = "execute_complete", kwargs: Any = None,
          due: float | None = None, txid: int = 1) -> dict[str, Any]:
    return {"op": op, "at": at(seconds), "new_state": "deferred" if op == "deferred" else "scheduled",
            "old_trigger_id": 7, "next_method": method, "next_kwargs": kwargs,
            "trigger_timeout": at(due) if due is not None else None, "txid": txid}


def http_waiter(timeout_at: float | None = None) -> Waiter:
    return Waiter(0, Identity("http", "h00001"), wave=0, poll_interval=2.0, push=False, timeout_at=timeout_at)


EVENT = {"event": {"key": "h00001"}}
TIMEOUT = {"error": "Trigger timeout"}
BOUND = 10.0


@pytest.mark.parametrize(("trail", "condition", "timeout_at", "verdict", "problem"), [
    ([entry("deferred", 0), entry("resolved", 12, kwargs=EVENT)], 10, None, "resumed", None),
    ([entry("deferred", 0)], 10, None, "lost", "still deferred"),
    ([entry("deferred", 0), entry("resolved", 12, kwargs=EVENT),
      entry("rewritten", 13, kwargs=EVENT, txid=2)], 10, None, "resumed", "doubled"),
    ([entry("deferred", 0), entry("resolved", 12, kwargs={"event": {"key": "h00002"}})], 10, None,
     "resumed", "wrong"),
    ([entry("deferred", 0), entry("resolved", 9, kwargs=EVENT)], 10, None, "resumed", "premature"),
    ([entry("deferred", 0), entry("resolved", 25, kwargs=EVENT)], 10, None, "resumed", "stalled"),
    ([entry("deferred", 0), entry("resolved", 29, method="__fail__", kwargs=TIMEOUT, due=30)], 60, 30,
     "timed_out", "early"),
    ([entry("deferred", 0), entry("resolved", 31, method="__fail__", kwargs=TIMEOUT, due=30)], 60, 30,
     "timed_out", None),
    ([entry("deferred", 0), entry("resolved", 31, method="__fail__", kwargs=TIMEOUT, due=30)], 5, 30,
     "timed_out", "wrong"),
    ([entry("deferred", 0), entry("resolved", 12, method="__fail__",
                                  kwargs={"error": "Trigger failure", "traceback": ["boom"]})], 10, None,
     "failed", "failed"),
    ([entry("deferred", 0), entry("deleted", 12)], 10, None, "lost", "deleted"),
])
def test_the_checker_catches_each_kind_of_violation(trail: list[dict[str, Any]], condition: float,
                                                     timeout_at: float | None, verdict: str,
                                                     problem: str | None) -> None:
    due = at(timeout_at) if timeout_at is not None else None
    outcome = judge(http_waiter(timeout_at), trail, at(condition), BOUND, due)
    assert outcome.verdict == verdict
    if problem is None:
        assert outcome.problems == []
    else:
        assert any(problem in p for p in outcome.problems), outcome.problems


def test_the_asset_checker_wants_exactly_one_event_per_success_row_on_its_own_asset() -> None:
    def event(event_id: int, asset: str, row_id: int, table: str) -> tuple[int, str, dict[str, Any], Any]:
        payload = {"row_id": row_id, "table_name": table}
        return (event_id, f"chaos://status/{asset}", {"payload": payload}, at(3))

    rows = [(1, "asset.a0", "SUCCESS", at(1)), (2, "asset.a0", "START", at(1)),
            (3, "asset.a1", "SUCCESS", at(1)), (4, "asset.a1", "SUCCESS", at(1)),
            (5, "asset.a1", "SUCCESS", at(1))]
    events = [event(10, "a0", 1, "asset.a0"), event(11, "a0", 1, "asset.a0"), event(12, "a0", 2, "asset.a0"),
              event(13, "a0", 3, "asset.a1"), event(14, "a1", 5, "asset.a1")]
    observed = Observed({}, {}, {}, {}, rows, events, T0)
    result = judge_assets(observed, BOUND)
    assert (len(result.lost), len(result.doubled), len(result.wrong)) == (1, 1, 2)
    assert result.failing_rows == [1, 4]
    assert result.latencies == [2.0, 2.0, 2.0]


def test_the_short_plan_has_every_fault_kind_and_is_reproducible() -> None:
    plan = make_plan(Profile.quick(SEED))
    assert {f.kind for f in plan.faults} == set(FAULT_KINDS)
    assert plan.describe() == make_plan(Profile.quick(SEED)).describe()
    assert any(w.timeout_at is not None for w in plan.waiters)
    assert len({w.identity.key for w in plan.waiters}) < len(plan.waiters)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_short_chaos_run_loses_doubles_and_stalls_nothing(tmp_path: Path) -> None:
    logs = tmp_path / "instance-logs"  # kept by pytest with the test's tmp_path, for a failure's analysis
    report = run_chaos(Profile.quick(SEED), log=print, keep_logs=logs)
    print(report.text())
    assert report.ok, f"{report.text()}\ninstance logs: {logs}"
