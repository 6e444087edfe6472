"""The checker: a pure function of what was planned and what the databases say."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.chaos.cluster import FaultRecord
from tests.helpers.chaos.constants import (
    CONSUME,
    FAULT_KINDS,
    FLAG,
    NUL_ASSET,
    POISON,
    REJECTED_MARK,
    TABLE,
    TEAM,
)
from tests.helpers.chaos.plan import Identity, Plan, Waiter
from tests.helpers.fake_clock import ClockStep, continuous


@dataclass
class Observed:
    """Everything the checker needs, read from the databases after the run."""

    audit: dict[str, list[dict[str, Any]]]
    final: dict[str, tuple[str | None, int | None]]  # ti id -> (state, trigger id)
    stuck: dict[str, str]  # ti id -> where its trigger stands (shard, owner), for lost waiters
    conditions: dict[str, dt.datetime]
    asset_rows: list[tuple[int, str, str, dt.datetime]]
    asset_events: list[tuple[int, str, dict[str, Any], dt.datetime | None]]
    t0: dt.datetime
    diagnostics: list[str] = field(default_factory=list)  # state to explain a failure with
    watchers: dict[str, int] = field(default_factory=dict)  # asset uri -> its watcher's trigger id
    clock_steps: list[ClockStep] = field(default_factory=list)  # the database clock's forward steps
    outbox: dict[int, tuple[str, str | None]] = field(default_factory=dict)  # event id -> status, error
    delivered: Counter[int] = field(default_factory=Counter)  # event id -> deliveries to the inbox stub
    # status row id -> instance process (its log's name: smart-3.13 is slot smart-3's 13th start) -> when
    # its watcher first fired the row's event (host clock, its log's "Trigger fired event" line)
    fired_by: dict[int, dict[str, dt.datetime]] = field(default_factory=dict)
    stored_by: dict[int, str] = field(default_factory=dict)  # asset event id -> the process that stored it
    # (team, shard) -> (when, instance process) of every "took shards" line naming it (host clock, its logs)
    took: dict[tuple[str | None, int], list[tuple[dt.datetime, str]]] = field(default_factory=dict)
    # the consume-once source: each key's takes (message, taker process), the keys never taken
    takes: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    queue_left: list[str] = field(default_factory=list)


def as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


@dataclass
class Report:
    """Figures (label, value) for the table, every violation in words, and whether all checks passed."""

    figures: list[tuple[str, str]]
    violations: list[str]
    notes: list[str]
    trigger_ids: set[int] = field(default_factory=set)
    row_ids: set[int] = field(default_factory=set)
    evidence: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self, limit: int = 60) -> str:
        lines = [f"{label}: {value}" for label, value in self.figures]
        if self.violations:
            lines.append(f"{len(self.violations)} violations:")
            lines += [f"  {v}" for v in self.violations[:limit]]
            if len(self.violations) > limit:
                lines.append(f"  ... and {len(self.violations) - limit} more")
        lines += [f"note: {n}" for n in self.notes]
        if self.evidence:
            lines.append("log evidence:")
            lines += [f"  {e}" for e in self.evidence[:limit]]
        return "\n".join(lines)


@dataclass
class Outcome:
    """What happened to one waiter."""

    verdict: str  # resumed, timed_out, rejected (failed: its event could not be stored), failed, lost
    problems: list[str] = field(default_factory=list)  # doubled, wrong, premature, early, stalled
    stall: float | None = None
    window: tuple[dt.datetime, dt.datetime] | None = None
    struck: int = 0  # other instances that took its shard while it waited (other_shard_holders)


def payload_matches(ident: Identity, payload: Any) -> bool:
    """Each waiter's event must be about its own condition."""
    if not isinstance(payload, dict):
        return False
    if ident.kind == TABLE:
        loaded = sorted(payload.get("loaded") or [])
        return payload.get("status") == "success" and loaded == list(ident.tables)
    if ident.kind == FLAG:
        return payload.get("status") == "success"
    if ident.kind == TEAM:  # run in its own team's environment, never another team's (or none)
        return payload == {"key": ident.name, "ran_in": ident.team or ""}
    if ident.kind == CONSUME:
        return payload == {"key": ident.name, "message": ident.message}
    return payload == {"key": ident.name}


def condition_time(ident: Identity, conditions: dict[str, dt.datetime]) -> dt.datetime | None:
    names = ident.tables if ident.kind == TABLE else (ident.name,)
    times = [conditions.get(n) for n in names]
    return None if any(t is None for t in times) else max(t for t in times if t is not None)


Windows = Sequence[tuple[dt.datetime, dt.datetime]]


def wedges(faults: Sequence[FaultRecord]) -> list[tuple[dt.datetime, dt.datetime]]:
    """When an instance's runner was stopped alone (the wedge fault): its waits move only once the
    instance has stepped out, ``runner_stall_seconds`` after its runner last answered (the documented
    bound is that threshold plus a lease)."""
    return [(f.started, f.ended or f.started) for f in faults if f.kind == "wedge"]


def overlaps(start: dt.datetime | None, end: dt.datetime | None, windows: Windows) -> bool:
    return start is not None and end is not None and any(start < b and end > a for a, b in windows)


def downtime(faults: Sequence[FaultRecord]) -> list[tuple[dt.datetime, dt.datetime]]:
    """When PostgreSQL itself was down (pg_restart): nothing can be stored then, by anyone, so a stall is
    measured less the downtime inside it, as it is less the database clock's steps."""
    return [(f.started, f.ended) for f in faults if f.kind == "pg_restart" and f.ended is not None]


def _down_within(start: dt.datetime, end: dt.datetime, windows: Windows) -> float:
    """Seconds of ``windows`` between ``start`` and ``end``."""
    return sum(max(0.0, (min(end, b) - max(start, a)).total_seconds()) for a, b in windows)


def _seconds_up(start: dt.datetime, end: dt.datetime, down: Windows) -> float:
    """Seconds from ``start`` to ``end`` less PostgreSQL's downtime inside: how every stall is measured."""
    return (end - start).total_seconds() - _down_within(start, end, down)


def judge(
    waiter: Waiter,
    entries: list[dict[str, Any]],
    condition: dt.datetime | None,
    bound: float,
    due: dt.datetime | None = None,
    *,
    down: Windows = (),
) -> Outcome:
    """One waiter's audit trail against its condition and its deadline (``due``, as the harness set it)."""
    deferred = [e["at"] for e in entries if e["op"] == "deferred"]
    writes = [e for e in entries if e["op"] in ("resolved", "rewritten", "deleted")]
    if not writes:
        return Outcome("lost", ["still deferred"])
    first = writes[0]
    outcome = _classify(first)
    if len(writes) > 1 or len(deferred) > 1:
        outcome.problems.append(
            f"doubled: {len(writes)} writes in transactions "
            f"{[w['txid'] for w in writes]} at {[w['at'].isoformat() for w in writes]}"
        )
    start = max([t for t in (condition, *deferred[:1]) if t is not None], default=None)
    if waiter.identity.kind == POISON:
        _judge_poison(outcome, first, condition=condition, start=start, bound=bound, down=down)
        return outcome
    if outcome.verdict == "rejected":  # only the poison group's event may be refused
        outcome.verdict = "failed"
    if outcome.verdict in ("lost", "failed"):
        return outcome
    expected = _expected(condition, due, bound)
    if outcome.verdict == "timed_out":
        _judge_timeout(outcome, first, due, expected, bound, down=down)
    else:
        _judge_event(
            outcome,
            waiter,
            first,
            condition=condition,
            start=start,
            expected=expected,
            bound=bound,
            down=down,
        )
    return outcome


def _classify(entry: dict[str, Any]) -> Outcome:
    kwargs = as_dict(entry["next_kwargs"])
    if entry["op"] == "deleted":
        return Outcome("lost", ["task instance deleted while deferred (trigger row deleted?)"])
    if entry["new_state"] != "scheduled":
        return Outcome("failed", [f"left deferred for state {entry['new_state']!r}"])
    if entry["next_method"] == "__fail__":
        if kwargs.get("error") == "Trigger timeout":
            return Outcome("timed_out")
        cause = "".join(kwargs.get("traceback") or [])
        verdict = "rejected" if REJECTED_MARK in cause else "failed"
        return Outcome(verdict, [f"failed: {kwargs.get('error')!r} {cause[-300:]!r}"])
    return Outcome("resumed")


def _judge_poison(
    outcome: Outcome,
    entry: dict[str, Any],
    *,
    condition: dt.datetime | None,
    start: dt.datetime | None,
    bound: float,
    down: Windows = (),
) -> None:
    """The poison group's tasks must fail with the cause ("could not be stored"), once, in time."""
    if outcome.verdict != "rejected":
        outcome.problems.append(
            f"wrong: a poison event must fail its task with {REJECTED_MARK!r}; it was {outcome.verdict}"
        )
        if outcome.verdict != "lost":
            outcome.verdict = "failed"
        return
    # the cause is what was expected: not a problem (doubled writes were noted before)
    outcome.problems = [p for p in outcome.problems if not p.startswith("failed:")]
    if condition is None or entry["at"] < condition:
        outcome.problems.append(f"premature: failed at {entry['at'].isoformat()} before its event existed")
        return
    assert start is not None
    stall = _seconds_up(start, entry["at"], down)
    outcome.stall, outcome.window = stall, (start, entry["at"])
    if stall > bound:
        outcome.problems.append(f"stalled: failed {stall:.1f}s after its event came (bound {bound:.0f}s)")


def _expected(condition: dt.datetime | None, due: dt.datetime | None, bound: float) -> str:
    """'event', 'timeout' or 'either' (condition and deadline too close for any triggerer to call)."""
    if due is None:
        return "event"
    if condition is None:
        return "timeout"
    gap = (condition - due).total_seconds()
    if abs(gap) <= bound:
        return "either"
    return "timeout" if gap > 0 else "event"


def _judge_timeout(
    outcome: Outcome,
    entry: dict[str, Any],
    due: dt.datetime | None,
    expected: str,
    bound: float,
    *,
    down: Windows = (),
) -> None:
    if due is None:
        outcome.problems.append("wrong: timed out without a trigger_timeout")
        return
    late = (entry["at"] - due).total_seconds()
    if late < 0:
        outcome.problems.append(f"early: timed out {-late:.2f}s before its deadline")
    if expected == "event":
        outcome.problems.append("wrong: timed out although its condition held well before the deadline")
    # as for an event: PostgreSQL's own downtime inside the wait is nobody's delay (nothing can be written)
    stall = max(_seconds_up(due, entry["at"], down), 0.0)
    outcome.stall, outcome.window = stall, (due, entry["at"])
    if stall > bound:
        outcome.problems.append(
            f"stalled: timed out {stall:.1f}s after due, less PostgreSQL's downtime (bound {bound:.0f}s)"
        )


def _judge_event(
    outcome: Outcome,
    waiter: Waiter,
    entry: dict[str, Any],
    *,
    condition: dt.datetime | None,
    start: dt.datetime | None,
    expected: str,
    bound: float,
    down: Windows = (),
) -> None:
    payload = as_dict(entry["next_kwargs"]).get("event")
    if not payload_matches(waiter.identity, payload):
        outcome.problems.append(f"wrong: event {payload!r} is not about {waiter.identity.key}")
    if condition is None or entry["at"] < condition:
        outcome.problems.append(
            f"premature: resumed at {entry['at'].isoformat()} before its condition "
            f"held ({condition.isoformat() if condition else 'never'})"
        )
        return
    if expected == "timeout":
        outcome.problems.append("wrong: resumed although its deadline passed well before its condition")
    assert start is not None
    stall = _seconds_up(start, entry["at"], down)
    outcome.stall, outcome.window = stall, (start, entry["at"])
    if stall > bound:
        outcome.problems.append(
            f"stalled: resumed {stall:.1f}s after its condition held (bound {bound:.0f}s)"
        )


@dataclass
class AssetOutcome:
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    failing_rows: list[int] = field(default_factory=list)
    failing_assets: set[str] = field(default_factory=set)
    events: int = 0
    success_rows: int = 0
    refired: list[str] = field(default_factory=list)  # events whose first holders were struck: how late


def judge_assets(
    observed: Observed,
    bound: float,
    down: Windows = (),
    retake: float = 0.0,
    *,
    wedged: Windows = (),
    stall: float = 0.0,
) -> AssetOutcome:
    """Every SUCCESS row of a watched table -> exactly one event on that table's asset, and nothing else.

    An event fired by an instance that a fault struck before it stored it (its log says it fired, before
    the one event was stored by another instance) must wait for the next owner's takeover: ``retake``
    seconds (a lease and a loop) are allowed for each such instance, beyond ``bound``. Who stored it is
    the session's application name, which the harness sets to the instance process's name."""
    status_events = [e for e in observed.asset_events if e[1].startswith("chaos://status/")]
    result = AssetOutcome(events=len(status_events))
    by_row: dict[int, list[tuple[int, str, dict[str, Any], dt.datetime | None]]] = {}
    for event in status_events:
        row_id = (event[2].get("payload") or {}).get("row_id")
        by_row.setdefault(row_id if isinstance(row_id, int) else -1, []).append(event)
    rows = {r[0]: r for r in observed.asset_rows}
    for row_id, table, status, at in observed.asset_rows:
        events = by_row.get(row_id, [])
        uri = "chaos://status/" + table.split(".", 1)[1]
        if status != "SUCCESS":
            if events:
                result.wrong.append(f"row {row_id} ({table} {status}) made events {[e[0] for e in events]}")
            continue
        result.success_rows += 1
        struck = _struck_holders(observed, row_id, events)
        # a row whose watcher's runner may have been the stopped one (the wedge fault): + the threshold
        allowed = bound + (stall if overlaps(at, events[0][3] if events else None, wedged) else 0.0)
        _judge_row(result, (row_id, table, at), uri, events, allowed, down=down, struck=struck, retake=retake)
    for row_id, events in by_row.items():
        if row_id not in rows:
            result.wrong.append(f"events {[e[0] for e in events]} name no status row ({row_id})")
    return result


def other_shard_holders(
    entries: list[dict[str, Any]],
    condition: dt.datetime | None,
    took: dict[tuple[str | None, int], list[tuple[dt.datetime, str]]],
    team: str | None = None,
) -> int:
    """Instance processes other than the one that resumed a wait which took the wait's shard while it
    waited (after its condition held and it deferred, before the resume): each was struck before it
    stored the event (killed, frozen, cut off, stopped), or handed the shard on, and the next owner had to
    take the shard again. Faults stack (a PostgreSQL restart, then the instance that took the shard back
    killed a second later): the bound is for one holder struck, and as for asset events, a lease and a
    loop are allowed for each other one."""
    writes = [e for e in entries if e["op"] in ("resolved", "rewritten", "deleted")]
    deferred = [e["at"] for e in entries if e["op"] == "deferred"]
    if not writes or condition is None or writes[0].get("shard") is None or not writes[0].get("writer"):
        return 0
    first = writes[0]
    start = max([condition, *deferred[:1]])
    takers = {
        process
        for at, process in took.get((team, int(first["shard"])), [])
        if start < at < first["at"] and process != first["writer"]
    }
    return len(takers)


def _struck_holders(
    observed: Observed, row_id: int, events: list[tuple[int, str, dict[str, Any], dt.datetime | None]]
) -> int:
    """Instance processes that fired the row's event before another one stored it (none known: 0)."""
    if len(events) != 1 or events[0][3] is None:
        return 0
    stored_by, stored_at = observed.stored_by.get(events[0][0]), events[0][3]
    firings = observed.fired_by.get(row_id, {})
    if stored_by not in firings:
        return 0
    return sum(1 for process, at in firings.items() if process != stored_by and at < stored_at)


def _judge_row(
    result: AssetOutcome,
    row: tuple[int, str, dt.datetime],
    uri: str,
    events: list[tuple[int, str, dict[str, Any], dt.datetime | None]],
    bound: float,
    *,
    down: Windows = (),
    struck: int = 0,
    retake: float = 0.0,
) -> None:
    row_id, table, at = row
    if not events or len(events) > 1:
        result.failing_rows.append(row_id)
        result.failing_assets.add(uri)
    if not events:
        result.lost.append(f"row {row_id} ({table} SUCCESS at {at.isoformat()}) has no asset event")
        return
    if len(events) > 1:
        result.doubled.append(
            f"row {row_id} ({table}) has {len(events)} asset events {[e[0] for e in events]}"
        )
    for event_id, event_uri, extra, _at in events:
        payload = extra.get("payload") or {}
        if event_uri != uri or payload.get("table_name") != table:
            result.wrong.append(
                f"event {event_id} for row {row_id} ({table}) is on {event_uri} with "
                f"table_name {payload.get('table_name')!r}"
            )
    created = events[0][3]
    if created is not None:
        latency = _seconds_up(at, created, down)
        result.latencies.append(latency)
        allowed = bound + struck * retake
        if struck and latency > bound:
            result.refired.append(
                f"row {row_id} ({table}): {latency:.1f}s, fired before it was stored by "
                f"{struck} struck instance(s) (bound {allowed:g}s)"
            )
        if latency > allowed:
            result.stalled.append(
                f"row {row_id} ({table}): its event came {latency:.1f}s later (bound {allowed:g}s)"
            )


@dataclass
class BridgeOutcome:
    """The dataset bridge's side: the NUL extra's event dead-lettered alone, every other one delivered."""

    violations: list[str] = field(default_factory=list)
    nul_events: int = 0
    nul_row: str = "none"
    delivered: int = 0
    expected: int = 0
    redelivered: int = 0


def judge_bridge(observed: Observed) -> BridgeOutcome:
    """The NUL extra made exactly one asset event, whose outbox row is dead with jsonb's reason and which
    never reached the inbox; every status-row event's row is delivered and reached it."""
    result = BridgeOutcome()
    nul = [e for e in observed.asset_events if e[1] == NUL_ASSET]
    result.nul_events = len(nul)
    if len(nul) != 1:
        kind = "lost" if not nul else "doubled"
        result.violations.append(
            f"ASSET {kind}: the NUL extra's watcher made {len(nul)} asset events "
            f"{[e[0] for e in nul]} (want exactly one)"
        )
    for event_id, *_rest in nul:
        status, error = observed.outbox.get(event_id, ("no outbox row", None))
        result.nul_row = f"{status} ({error})" if error else status
        if status != "dead" or "jsonb" not in (error or ""):
            result.violations.append(
                f"BRIDGE wrong: the NUL extra's event {event_id} has outbox row "
                f"{result.nul_row!r}, want dead-lettered with jsonb's reason"
            )
        if observed.delivered[event_id]:
            result.violations.append(f"BRIDGE wrong: the NUL extra's event {event_id} reached the inbox")
    for event_id, uri, _extra, _at in observed.asset_events:
        if not uri.startswith("chaos://status/"):
            continue
        result.expected += 1
        status, error = observed.outbox.get(event_id, ("no outbox row", None))
        if status == "delivered" and observed.delivered[event_id]:
            result.delivered += 1
            result.redelivered += observed.delivered[event_id] - 1
        else:
            result.violations.append(
                f"BRIDGE lost: event {event_id} ({uri}) outbox row {status!r} "
                f"({error}), delivered {observed.delivered[event_id]} times"
            )
    return result


def on_host_clock(observed: Observed) -> Observed:
    """The observations with the database clock's steps taken out (``fake_clock.continuous``): every
    duration between two of them is then real time."""
    steps = observed.clock_steps
    if not steps:
        return observed

    def host(moment: dt.datetime) -> dt.datetime:
        return continuous(moment, steps)

    audit = {ti: [{**e, "at": host(e["at"])} for e in entries] for ti, entries in observed.audit.items()}
    return dataclasses.replace(
        observed,
        audit=audit,
        conditions={k: host(v) for k, v in observed.conditions.items()},
        asset_rows=[(i, t, status, host(at)) for i, t, status, at in observed.asset_rows],
        asset_events=[
            (i, uri, extra, None if at is None else host(at)) for i, uri, extra, at in observed.asset_events
        ],
    )


def check(plan: Plan, raw: Observed, faults: Sequence[FaultRecord], run: dict[str, Any]) -> Report:
    profile = plan.profile
    outcomes: dict[int, Outcome] = {}
    violations: list[str] = []
    trigger_ids: set[int] = set()
    observed = on_host_clock(raw)
    down = downtime(faults)
    wedged = wedges(faults)
    for waiter in plan.waiters:
        entries = observed.audit.get(waiter.ti_id, [])
        cond = condition_time(waiter.identity, observed.conditions)
        due = (
            None
            if waiter.timeout_at is None
            else continuous(raw.t0 + dt.timedelta(seconds=waiter.timeout_at), raw.clock_steps)
        )
        struck = other_shard_holders(entries, cond, observed.took, waiter.identity.team)
        bound = profile.bound(waiter.poll_interval) + struck * profile.retake
        written = next((e["at"] for e in entries if e["op"] in ("resolved", "rewritten", "deleted")), None)
        if overlaps(cond, written, wedged):  # its instance's runner may have been the stopped one
            bound += profile.runner_stall_seconds
        outcome = judge(waiter, entries, cond, bound, due, down=down)
        outcome.struck = struck
        outcomes[waiter.index] = outcome
        if outcome.verdict in ("lost", "failed") or outcome.problems:
            trigger_ids.update(_trigger_ids(entries, observed.final.get(waiter.ti_id)))
            violations.append(_describe(waiter, outcome, cond, observed))
    assets = judge_assets(
        observed,
        profile.bound(profile.asset_poll),
        down,
        retake=profile.retake,
        wedged=wedged,
        stall=profile.runner_stall_seconds,
    )
    for uri in assets.failing_assets:
        trigger_ids.add(observed.watchers.get(uri, -1))
    violations += [
        f"ASSET {kind}: {text}"
        for kind, texts in (
            ("lost", assets.lost),
            ("doubled", assets.doubled),
            ("wrong", assets.wrong),
            ("stalled", assets.stalled),
        )
        for text in texts
    ]
    bridge = judge_bridge(observed)
    violations += bridge.violations
    violations += [f"INSTANCE exited on its own: {text}" for text in run["unexpected_exits"]]
    violations += [f"INSTANCE leases lapsed: {text}" for text in run.get("lapses", [])]
    violations += judge_consumed(plan, observed)
    figures = _figures(plan, outcomes, assets, faults, run) + _bridge_figures(bridge, run, raw.clock_steps)
    notes_faults = [f"{f.kind} {f.slot} not made as planned: {f.note}" for f in faults if not f.effective]
    notes = list(run["notes"]) + [f"unclean stop: {u}" for u in run["unclean_stops"]]
    if violations:
        notes += observed.diagnostics
    notes += [f"exited during start-up (database unreachable), restarted: {u}" for u in run["startup_exits"]]
    notes += notes_faults
    return Report(figures, violations, notes, trigger_ids, set(assets.failing_rows))


def judge_consumed(plan: Plan, observed: Observed) -> list[str]:
    """Each consume-once message queued was taken once. That is the source's promise (a DELETE), checked
    here so that the harness's own source is known to hold it; the product's part is judged with every
    waiter's: each task resumed once with its own message (a message taken and dropped leaves its task
    deferred: lost)."""
    problems = []
    queued = sorted({w.identity.name for w in plan.waiters if w.identity.kind == CONSUME})
    for key in queued:
        takes = observed.takes.get(key, [])
        if len(takes) != 1:
            where = "left in the queue" if key in observed.queue_left else "never queued"
            problems.append(
                f"CONSUME {key}: taken {len(takes)} times {takes}" + ("" if takes else f", {where}")
            )
    return problems


def _bridge_figures(
    bridge: BridgeOutcome, run: dict[str, Any], steps: Sequence[ClockStep]
) -> list[tuple[str, str]]:
    return [
        ("NUL extra: asset events / its outbox row", f"{bridge.nul_events} / {bridge.nul_row[:120]}"),
        (
            "bridge: status events delivered to the inbox / expected (redeliveries)",
            f"{bridge.delivered} / {bridge.expected} ({bridge.redelivered})",
        ),
        ("inbox refusals (bad signature)", str(run.get("inbox_refusals", 0))),
        (
            "database clock steps (s)",
            ", ".join(f"+{(s.after - s.before).total_seconds():.1f}" for s in steps) or "none",
        ),
    ]


def _trigger_ids(entries: list[dict[str, Any]], final: tuple[str | None, int | None] | None) -> set[int]:
    found = {e["old_trigger_id"] for e in entries if e.get("old_trigger_id") is not None}
    if final and final[1] is not None:
        found.add(final[1])
    return {int(t) for t in found}


def _describe(waiter: Waiter, outcome: Outcome, cond: dt.datetime | None, observed: Observed) -> str:
    problems = "; ".join(outcome.problems)
    where = observed.stuck.get(waiter.ti_id, "")
    timeout = f" timeout_at=t0+{waiter.timeout_at:.1f}s" if waiter.timeout_at is not None else ""
    written = next((e for e in observed.audit.get(waiter.ti_id, []) if e["op"] != "deferred"), None)
    by = (
        f" written at {written['at'].isoformat()} by {written.get('writer') or '?'} (trigger "
        f"{written['old_trigger_id']}, shard {written.get('shard')})"
        if written
        else ""
    )
    return (
        f"{outcome.verdict.upper()} {waiter.dag_id}[{waiter.map_index}] ti={waiter.ti_id} "
        f"identity={waiter.identity.key} poll={waiter.poll_interval:g}s push={waiter.push}{timeout} "
        f"condition={cond.isoformat() if cond else None}: {problems}{by} {where}".rstrip()
    )


def _stall_by_fault(
    outcomes: dict[int, Outcome], faults: Sequence[FaultRecord], lease: float
) -> dict[str, float]:
    """The longest stall among waits that overlapped each kind of fault ('none': no fault nearby)."""
    worst: dict[str, float] = {}
    for outcome in outcomes.values():
        if outcome.stall is None or outcome.window is None:
            continue
        start, end = outcome.window
        kinds = {
            f.kind
            for f in faults
            if f.started <= end and (f.ended or end) + dt.timedelta(seconds=lease) >= start
        }
        for kind in kinds or {"none"}:
            worst[kind] = max(worst.get(kind, 0.0), outcome.stall)
    return worst


def _figures(
    plan: Plan,
    outcomes: dict[int, Outcome],
    assets: AssetOutcome,
    faults: Sequence[FaultRecord],
    run: dict[str, Any],
) -> list[tuple[str, str]]:
    p = plan.profile
    verdicts = Counter(o.verdict for o in outcomes.values())
    problems = Counter(text.split(":")[0] for o in outcomes.values() for text in o.problems)
    stalls = sorted(o.stall for o in outcomes.values() if o.stall is not None)
    kinds = Counter(f.kind for f in faults)
    bounds = sorted({p.bound(w.poll_interval) for w in plan.waiters})
    by_fault = _stall_by_fault(outcomes, faults, p.lease_seconds)
    timed = [w for w in plan.waiters if w.timeout_at is not None]
    figures = [
        ("seed", str(p.seed)),
        (
            "instances",
            f"{p.instances} of no team (+1 joining), {p.team_instances} of each team "
            f"({', '.join(p.teams) or 'none'}); {p.shards} shards per team space, "
            f"lease {p.lease_seconds:g}s",
        ),
        ("chaos phase / total wall time (s)", f"{run['chaos_seconds']:.0f} / {run['wall_seconds']:.0f}"),
        ("faults", f"{len(faults)}: " + ", ".join(f"{k} {kinds[k]}" for k in FAULT_KINDS)),
        ("faults made as planned", _as_planned(faults)),
        (
            "waiters / identities",
            f"{len(plan.waiters)} / {len(plan.identities)} "
            f"({1 - len(plan.identities) / len(plan.waiters):.0%} duplicates)",
        ),
        (
            "waiters by trigger",
            ", ".join(f"{k} {n}" for k, n in sorted(Counter(w.identity.kind for w in plan.waiters).items()))
            + f"; push {sum(w.push for w in plan.waiters)}; second wave {sum(w.wave for w in plan.waiters)}",
        ),
        ("waiters with a timeout", str(len(timed))),
        (
            "team waits resumed with their own team's mark / team waits (teams)",
            f"{_own(plan, outcomes, TEAM)} / {sum(1 for w in plan.waiters if w.identity.kind == TEAM)} "
            f"({', '.join(p.teams) or 'none'}, {p.team_instances} instances each)",
        ),
        (
            "consume-once waits resumed with their message / waits (messages, each taken once)",
            f"{_own(plan, outcomes, CONSUME)} / {sum(1 for w in plan.waiters if w.identity.kind == CONSUME)} "
            f"({len({w.identity.name for w in plan.waiters if w.identity.kind == CONSUME})})",
        ),
        ("resumed", str(verdicts["resumed"])),
        ("timed out", str(verdicts["timed_out"])),
        (
            "poison waiters failed with the cause (expected) / poison waiters",
            f"{verdicts['rejected']} / {sum(1 for w in plan.waiters if w.identity.kind == POISON)}",
        ),
        ("failed", str(verdicts["failed"])),
        ("lost", str(verdicts["lost"])),
        ("doubled", str(problems["doubled"])),
        (
            "wrong (wrong event/outcome, premature, early timeout)",
            str(problems["wrong"] + problems["premature"] + problems["early"]),
        ),
        ("stalled over bound", str(problems["stalled"])),
        (
            "max stall / bound (s)",
            f"{stalls[-1] if stalls else 0:.2f} / "
            f"{bounds[0]:g}-{bounds[-1]:g} (lease + poll interval + 3, plus "
            f"{p.retake:g} per other instance that took its shard meanwhile, "
            f"{p.runner_stall_seconds:g} during a wedged runner)",
        ),
        (
            "waits whose shard another instance took while they waited",
            str(sum(1 for o in outcomes.values() if o.struck)),
        ),
        ("stall p50 / p99 (s)", f"{_pct(stalls, 0.5):.2f} / {_pct(stalls, 0.99):.2f}"),
        ("max stall by fault kind (s)", ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_fault.items()))),
        ("status rows SUCCESS / asset events", f"{assets.success_rows} / {assets.events}"),
        (
            "asset events lost / doubled / wrong / stalled",
            f"{len(assets.lost)} / {len(assets.doubled)} / {len(assets.wrong)} / {len(assets.stalled)}",
        ),
        (
            "asset event latency max (s)",
            f"{max(assets.latencies, default=0):.2f} "
            f"(bound {p.bound(p.asset_poll):g}, plus "
            f"{p.retake:g} per holder struck before "
            "storing it)",
        ),
        (
            "asset events over the bound whose holder was struck before storing",
            "; ".join(assets.refired) if assets.refired else "0",
        ),
        (
            "instances that exited on their own (while up / during start-up)",
            f"{len(run['unexpected_exits'])} / {len(run['startup_exits'])}",
        ),
        ("unclean stops (SIGTERM exit != 0)", str(len(run["unclean_stops"]))),
        ("exit after SIGTERM max (s)", f"{max(run['term_exit_seconds'], default=0):.1f}"),
        ("HTTP polls", str(run["polls"])),
    ]
    return figures


def _own(plan: Plan, outcomes: dict[int, Outcome], kind: str) -> int:
    """Waiters of ``kind`` resumed once with their own event (no problem at all)."""
    return sum(
        1
        for w in plan.waiters
        if w.identity.kind == kind
        and outcomes[w.index].verdict == "resumed"
        and not outcomes[w.index].problems
    )


def _as_planned(faults: Sequence[FaultRecord]) -> str:
    """Faults whose effect is confirmed, of those that need it: a freeze caught inside a transaction, a
    DB error that reached the loop right after a renewal."""
    parts = []
    for kind, what in (
        ("freeze", "frozen inside a transaction"),
        ("db_error", "error reached the loop"),
        ("lag", "shed shards while lagging"),
        ("wedge", "handed every shard over"),
        ("log_hang", "uploads hung"),
        ("consume", "the stopped instance had taken messages"),
    ):
        made = [f for f in faults if f.kind == kind]
        parts.append(f"{kind}: {sum(f.effective for f in made)}/{len(made)} {what}")
    return ", ".join(parts)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]
