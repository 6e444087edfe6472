"""``smart-triggerer status``: every instance, what it owns and runs, and the deduplication ratio."""

from __future__ import annotations

import datetime as dt
from typing import Any

from smart_triggerer.config import Settings


def team_of_space(space: str | None) -> str | None:
    """The team of an instance's shard space key (``<queues>@<team>``), None for no team."""
    from smart_triggerer.db.store import split_space

    return split_space(space)[1] if space else None


def in_teams(space: str | None, teams: frozenset[str] | None) -> bool:
    """Whether an instance (by its space key) is shown to someone who may see ``teams`` (None: every
    team, as without ``[core] multi_team``); an instance of no team is shown to everyone."""
    team = team_of_space(space)
    return teams is None or team is None or team in teams


def collect(settings: Settings, teams: frozenset[str] | None = None) -> dict[str, Any]:
    """What ``status`` shows; with ``teams``, only those teams' instances (and those of no team)."""
    from airflow.utils.session import create_session

    from smart_triggerer.db.store import Store

    with create_session() as session:
        store = Store(session)
        exists = store.schema_exists()
        rows = store.instances(settings.lease_seconds) if exists else []
        # the deployment's own count, pinned at its creation (this process's setting may differ)
        shards = (store.pinned_shards() if exists else None) or settings.shards
    instances = [instance(r) for r in rows if in_teams(r["queues"], teams)]
    found = totals(instances, shards)
    return {
        "instances": instances,
        "totals": found,
        "dedup_ratio": round(found["waiters"] / found["groups"], 3) if found["groups"] else None,
    }


def totals(instances: list[dict[str, Any]], shards: int) -> dict[str, Any]:
    """Shards, waiters and groups over the healthy instances; event counters over all of them. Each queue
    set (``--queues``) has a shard space of its own: ``shards`` counts every space an instance listed
    serves (an unhealthy one's too: its space's shards are then not owned), so that ``shards_owned ==
    shards`` still means every shard is owned."""
    live = [i for i in instances if i["healthy"]]
    spaces = {i.get("queues") or "" for i in instances} or {""}
    return {
        "instances": len(live),
        "shards": shards * len(spaces),
        "shards_owned": sum(i["shards_owned"] for i in live),
        "waiters": sum(i["waiters"] for i in live),
        "groups": sum(i["groups"] for i in live),
        "events_total": sum(i["events_total"] for i in instances),
        "resumed_total": sum(i["resumed_total"] for i in instances),
        "failures_total": sum(i["failures_total"] for i in instances),
        "watchers_failing": sum(i["watchers_failing"] for i in live),
        "fleet_full": any(i["fleet_full"] for i in live),
    }


def instance(row: dict[str, Any]) -> dict[str, Any]:
    """One row of the ``instances`` query, as ``status --json`` and the page show it."""
    return {
        "job_id": row["job_id"],
        "host": row["hostname"],
        "healthy": bool(row["healthy"]),
        "shards_owned": int(row["shards_owned"]),
        "waiters": int(row["waiters"]),
        "groups": int(row["groups"]),
        "capacity": int(row["capacity"]),
        "queues": row["queues"],
        "team": team_of_space(row["queues"]),
        "health_url": row["health_url"],
        "events_total": int(row["events_total"]),
        "resumed_total": int(row["resumed_total"]),
        "failures_total": int(row["failures_total"]),
        "watchers_failing": int(row["watchers_failing"]),
        "watcher_restarts_total": int(row["watcher_restarts_total"]),
        # load, as placement reads it (placement.py): the runner's event-loop lag (p99, last minute),
        # memory, and whether the instance takes new shards (shedding: why not)
        "lag_p99_ms": None if row["lag_p99_ms"] is None else float(row["lag_p99_ms"]),
        "rss_mb": row["rss_mb"],
        "accepting": bool(row["accepting"]),
        "limit_groups": row["limit_groups"],
        "shedding": row["shedding"],
        "fleet_full": bool(row["fleet_full"]),
        "heartbeat_at": _iso(row["heartbeat_at"]),
        "stopped_at": _iso(row["stopped_at"]),
    }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


def render(status: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="smart triggerer instances")
    for column in (
        "job id",
        "host",
        "healthy",
        "shards",
        "waiters",
        "groups / capacity",
        "lag p99",
        "RSS",
        "resumed",
        "failed",
    ):
        table.add_column(column)
    for i in status["instances"]:
        lag = "-" if i["lag_p99_ms"] is None else f"{i['lag_p99_ms']:.0f} ms"
        rss = "-" if i["rss_mb"] is None else f"{i['rss_mb']} MB"
        groups = f"{i['groups']} / {i['capacity']}" + ("" if i["accepting"] else " (shedding)")
        table.add_row(
            str(i["job_id"]),
            i["host"],
            "yes" if i["healthy"] else "no",
            str(i["shards_owned"]),
            str(i["waiters"]),
            groups,
            lag,
            rss,
            str(i["resumed_total"]),
            str(i["failures_total"]),
        )
    console = Console()
    console.print(table)
    totals = status["totals"]
    console.print(
        f"{totals['instances']} healthy instance(s), {totals['shards_owned']}/{totals['shards']} "
        f"shards owned, {totals['waiters']} waiters in {totals['groups']} groups, "
        f"dedup ratio {status['dedup_ratio']}"
    )
    if totals["fleet_full"]:
        console.print(
            "the fleet is full: every instance is at its capacity or limits (add an instance or "
            "raise --capacity); instances keep what they run"
        )
