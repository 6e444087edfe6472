"""The Smart Triggerer page in Airflow's UI: what everybody waits on, and who serves it.

An Airflow plugin (entry point ``airflow.plugins``) with two parts:

- a FastAPI app mounted in the api-server under ``/smart-triggerer``: the JSON API (``api/overview``,
  ``api/groups``) and the page itself (``ui/``), every route behind Airflow's own authentication (a JWT as
  ``Authorization: Bearer``, or the UI's session cookie) and authorization (groups list only the tasks of
  DAGs the user may read; the bridge panel needs asset read access);
- an ``external_views`` entry that puts "Smart Triggerer" in Airflow's navigation and shows the page inside
  the UI. An external view needs no JavaScript build step and no bundle to keep in step with Airflow's
  React version (a ``react_apps`` entry would); the page is one HTML file that reads the JSON API
  with the user's own session, the same origin as the UI.

Each panel is aggregated in PostgreSQL (``sql/queries.sql``: ``instances``, ``page_chart``, the bridge's
below, and for the groups ``page_group_order``, counts only, and ``page_groups``, the page's own groups). The
groups' order is kept a few seconds per set of readable DAGs (:class:`GroupOrders`): a page then costs only
its own groups, whatever the number of waiters.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated, Any

import structlog
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from dataset_bridge import store as bridge_store
from smart_triggerer.config import Settings
from smart_triggerer.db import status

log = structlog.get_logger(logger_name=__name__)

# stopped instances stay on the page this long (a crash or a scale-down is worth seeing for a while)
KEEP_STOPPED_SECONDS = 3600.0
MEMBERS_SHOWN = 20
# a group's tasks shown are found among its first this many members (the order they deferred): a big group
# whose first members are in DAGs the user may not read is not read whole to find readable ones
MEMBERS_SCANNED = 200
DEFAULT_PAGE = 50
MAX_PAGE = 200
MAX_OFFSET = 1_000_000
PAGE_SCHEMA = 9  # the migration that added what the page reads (sql/0009_page_groups.sql)
# the groups' order of a set of readable DAGs is read again once it is this old (the page refreshes every
# 10 s), and dropped when no request read it for ORDER_KEEP_SECONDS; at most ORDERS_KEPT sets are kept
ORDER_FRESH_SECONDS = 10.0
ORDER_KEEP_SECONDS = 300.0
ORDERS_KEPT = 16
# a sample is an instance's latest for this long (a minute apart, with room for a slow loop)
SAMPLE_FRESH_SECONDS = 150


async def _user(request: Request) -> Any:
    """Airflow's own authentication, as its ``get_user``: an explicit bearer token, else the user its JWT
    refresh middleware vouched for, else the UI's session cookie; none is 401, a bad one 401/403.
    (Imported when called: Airflow's security module takes a second to import, and every Airflow process
    loads this plugin, not only the api-server.)"""
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
    from airflow.api_fastapi.core_api.security import (
        USER_INJECTED_BY_TRUSTED_MIDDLEWARE,
        resolve_user_from_token,
    )

    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return await resolve_user_from_token(token.strip())
    user = getattr(request.state, "user", None)
    if user and getattr(request.state, "user_authenticated_via", None) is USER_INJECTED_BY_TRUSTED_MIDDLEWARE:
        return user
    return await resolve_user_from_token(request.cookies.get(COOKIE_NAME_JWT_TOKEN))


User = Annotated[Any, Depends(_user)]
# no /docs, /redoc or /openapi.json: every route here needs a signed-in user
app = FastAPI(title="Smart Triggerer", docs_url=None, redoc_url=None, openapi_url=None)


class PageUnavailable(Exception):
    """The page cannot answer yet (an old schema); the message says what to do."""


@app.exception_handler(PageUnavailable)
async def _unavailable(_request: Request, err: PageUnavailable) -> JSONResponse:
    return JSONResponse({"detail": str(err)}, status_code=503)


@app.exception_handler(OperationalError)
@app.exception_handler(InterfaceError)
@app.exception_handler(PoolTimeout)
async def _database_down(_request: Request, err: Exception) -> JSONResponse:
    log.warning("smart triggerer page: metadata database unreachable", error=type(err).__name__)
    return JSONResponse(
        {"detail": "the metadata database is unreachable; try again shortly"}, status_code=503
    )


def _readable_dag_ids(user: Any) -> set[str]:
    from airflow.api_fastapi.app import get_auth_manager

    return set(get_auth_manager().get_authorized_dag_ids(user=user, method="GET"))


def _may_view_triggers(user: Any) -> bool:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView

    return bool(get_auth_manager().is_authorized_view(access_view=AccessView.TRIGGERS, user=user))


def _task_instance_dag_ids(user: Any, dag_ids: frozenset[str]) -> frozenset[str]:
    """Of these DAGs, those whose task instances the user may read."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    manager = get_auth_manager()
    return frozenset(
        d
        for d in dag_ids
        if manager.is_authorized_dag(
            method="GET", access_entity=DagAccessEntity.TASK_INSTANCE, details=DagDetails(id=d), user=user
        )
    )


def _may_read_assets(user: Any) -> bool:
    from airflow.api_fastapi.app import get_auth_manager

    return bool(get_auth_manager().is_authorized_asset(method="GET", user=user))


def _iso(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, dt.datetime) else None


def _session() -> Any:
    from airflow.utils.session import create_session

    return create_session()


def _visible_teams(user: Any) -> frozenset[str] | None:
    """With ``[core] multi_team``: the teams whose instances this user may see (the auth manager's
    ``is_authorized_team``, as Airflow asks whether a user belongs to a team); None without teams."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import TeamDetails
    from airflow.models.team import Team

    from smart_triggerer.db.store import multi_team_enabled

    if not multi_team_enabled():
        return None
    manager = get_auth_manager()
    try:
        return frozenset(
            team
            for team in Team.get_all_team_names()
            if manager.is_authorized_team(method="GET", user=user, details=TeamDetails(name=team))
        )
    except NotImplementedError:  # Airflow refuses to run multi-team with such a manager: say so, no 500
        raise HTTPException(
            status_code=403,
            detail="[core] multi_team is on, but the auth manager does not "
            "support teams (is_authorized_team)",
        ) from None


def overview(may_read_assets: bool, teams: frozenset[str] | None = None) -> dict[str, Any]:
    """Instances, totals, the dedup ratio, the last hour's chart, and the bridge (when allowed). With
    ``teams`` (multi-team), only the instances of those teams and of no team, in the list, the totals
    and the chart."""
    from smart_triggerer.db.store import Store

    settings = Settings.from_airflow()
    with _session() as session:
        store = Store(session)
        if not _installed(store):
            return {"installed": False, "instances": [], "totals": {}, "chart": [], "bridge": None}
        instances = [
            _instance(r)
            for r in store.instances(settings.lease_seconds, KEEP_STOPPED_SECONDS)
            if status.in_teams(r["queues"], teams)
        ]
        shards = store.pinned_shards() or settings.shards  # the instances' count, not this process's
        # with teams, a sample whose instance row is gone (its team unknown) is not shown
        samples = [
            s
            for s in store.page_chart()
            if teams is None or (s["known"] and status.in_teams(s["space"], teams))
        ]
        chart, polls_saved = _chart(samples)
        bridge = bridge_store.panel(session) if may_read_assets else None
    found = status.totals(instances, shards)
    waiters, groups = found["waiters"], found["groups"]
    return {
        "installed": True,
        "instances": instances,
        "totals": {**found, "coroutines_saved": waiters - groups, "polls_saved_per_minute": polls_saved},
        "dedup_ratio": round(waiters / groups, 2) if groups else None,
        "chart": chart,
        "bridge": bridge,
    }


def _installed(store: Any) -> bool:
    """False before any instance created the schema; an error when it is older than the page."""
    if not store.schema_exists():
        return False
    version = store.schema_version()
    if version < PAGE_SCHEMA:
        raise PageUnavailable(
            f"the smart_triggerer schema is at version {version} and this page needs "
            f"{PAGE_SCHEMA}: start an upgraded smart-triggerer, which migrates it"
        )
    return True


def _chart(samples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float | None]:
    """A point a minute over the last hour, each instance counted with its latest sample (carried forward
    while fresh, never past its instance's stop), and the polls saved now (None without a fresh sample)."""
    latest: dict[int, dict[str, Any]] = {}
    points = []
    for minute in sorted({r["minute"] for r in samples}):
        latest.update({r["job_id"]: r for r in samples if r["minute"] == minute})
        fresh = [r for r in latest.values() if _counts_at(r, minute)]
        if (samples[0]["read_at"] - minute).total_seconds() >= 3600:
            continue  # read only to carry into the hour's first minute
        points.append(
            {
                "minute": _iso(minute),
                "waiters": sum(int(r["waiters"]) for r in fresh),
                "groups": sum(int(r["groups"]) for r in fresh),
                "polls_saved_per_minute": round(sum(float(r["polls_saved"]) for r in fresh), 1),
            }
        )
    now = [
        r
        for r in latest.values()
        if float(r["age_seconds"]) <= SAMPLE_FRESH_SECONDS and r["stopped_at"] is None
    ]
    return points, (round(sum(float(r["polls_saved"]) for r in now), 1) if now else None)


def _counts_at(sample: dict[str, Any], minute: dt.datetime) -> bool:
    if (minute - sample["minute"]).total_seconds() > SAMPLE_FRESH_SECONDS:
        return False
    stopped = sample["stopped_at"]
    return sample["minute"] == minute or stopped is None or stopped >= minute + dt.timedelta(minutes=1)


def _instance(row: dict[str, Any]) -> dict[str, Any]:
    """As ``status --json`` shows it, with what the page adds."""
    return {
        **status.instance(row),
        "stopped": row["stopped_at"] is not None,
        "lease_expires_at": _iso(row["lease_expires_at"]),
        "started_at": _iso(row["started_at"]),
    }


@dataclass(frozen=True)
class Viewer:
    """What one user may see of the groups."""

    dag_ids: frozenset[str]  # the DAGs they may read: groups are counted over their deferred tasks
    views_triggers: bool  # Airflow's Triggers view: serving hosts, and the tasks of every DAG above
    task_dag_ids: frozenset[str] = frozenset()  # DAGs whose task instances they may read: those tasks listed

    def listed_dag_ids(self) -> frozenset[str]:
        """The DAGs whose tasks are listed by id (the others are only counted)."""
        return self.dag_ids if self.views_triggers else self.dag_ids & self.task_dag_ids


def _viewer(user: Any) -> Viewer:
    dag_ids = frozenset(_readable_dag_ids(user))
    if not dag_ids:
        return Viewer(dag_ids, views_triggers=False)
    if _may_view_triggers(user):
        return Viewer(dag_ids, views_triggers=True)
    readable_tasks = frozenset(_task_instance_dag_ids(user, dag_ids))
    return Viewer(dag_ids, views_triggers=False, task_dag_ids=readable_tasks)


# identity hash, the trigger id of a waiter that runs alone (else None), queue set ('' for none)
GroupKey = tuple[int, int | None, str]


@dataclass(frozen=True, slots=True)
class GroupCount:
    """One group of a :class:`GroupOrders` order: its key and what it counts over the readable DAGs."""

    key: GroupKey
    members: int
    dags: int
    waiting_since: dt.datetime | None


@dataclass
class _Order:
    groups: list[GroupCount]
    read_at: float
    used_at: float
    refreshing: bool = False


def _in_thread(work: Callable[[], None]) -> None:
    threading.Thread(target=work, name="smart-triggerer page: groups order", daemon=True).start()


@dataclass
class GroupOrders:
    """The groups of each set of readable DAGs, biggest first, read at most every ``fresh_seconds``.

    Ordering groups by size takes a count over every waiter of the readable DAGs (a tenth of a second at
    50,000); every page is cut from the kept order instead, so a request reads only its own groups. An order
    gone stale is still served while one thread reads it again (the page refreshes every 10 s: what it shows
    is at most a refresh older than the database); the first request for a set of DAGs reads it itself.
    """

    read: Callable[[frozenset[str]], list[GroupCount]]
    clock: Callable[[], float] = time.monotonic
    spawn: Callable[[Callable[[], None]], None] = _in_thread
    fresh_seconds: float = ORDER_FRESH_SECONDS
    keep_seconds: float = ORDER_KEEP_SECONDS
    kept: int = ORDERS_KEPT
    _orders: dict[frozenset[str], _Order] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def get(self, dag_ids: frozenset[str]) -> list[GroupCount]:
        now = self.clock()
        with self._lock:
            order = self._orders.get(dag_ids)
            if order is not None:
                order.used_at = now
                if now - order.read_at >= self.fresh_seconds and not order.refreshing:
                    order.refreshing = True
                    self.spawn(lambda: self._refresh(dag_ids, order))
                return order.groups
        groups = self.read(dag_ids)
        self._keep(dag_ids, groups, now)
        return groups

    def clear(self) -> None:
        with self._lock:
            self._orders.clear()

    def _refresh(self, dag_ids: frozenset[str], order: _Order) -> None:
        started = self.clock()
        try:
            groups = self.read(dag_ids)
        except Exception as err:  # the next request tries again; the database being down shows there
            log.warning("smart triggerer page: could not read the groups again", error=type(err).__name__)
            order.refreshing = False
            return
        self._keep(dag_ids, groups, started)

    def _keep(self, dag_ids: frozenset[str], groups: list[GroupCount], read_at: float) -> None:
        with self._lock:
            self._orders[dag_ids] = _Order(groups, read_at, used_at=self.clock())
            unused = [k for k, o in self._orders.items() if self.clock() - o.used_at > self.keep_seconds]
            for key in unused:
                del self._orders[key]
            while len(self._orders) > self.kept:
                del self._orders[min(self._orders, key=lambda k: self._orders[k].used_at)]


def _read_order(dag_ids: frozenset[str]) -> list[GroupCount]:
    from smart_triggerer.db.store import Store

    with _session() as session:
        found = Store(session).page_group_order(sorted(dag_ids))
    return [
        GroupCount((identity_hash, alone, queue), members, dags, since)
        for identity_hash, alone, queue, members, dags, since in found
    ]


GROUP_ORDERS = GroupOrders(_read_order)


def groups_page(viewer: Viewer, limit: int, offset: int) -> dict[str, Any]:
    """One page of the groups the viewer may see, cut from the kept order; ``total``: over all pages."""
    order = _group_order(viewer.dag_ids)
    shown = order[offset : offset + limit]
    details = _details(shown, viewer) if shown else []
    return {
        "total": len(order),
        "limit": limit,
        "offset": offset,
        # a group whose members all left since the order was read has no first member: left out
        "groups": [
            _group(count, row, viewer)
            for count, row in zip(shown, details, strict=True)
            if row["classpath"] is not None
        ],
    }


def _group_order(dag_ids: frozenset[str]) -> list[GroupCount]:
    from smart_triggerer.db.store import Store

    with _session() as session:
        installed = _installed(Store(session))
    return GROUP_ORDERS.get(dag_ids) if installed and dag_ids else []


def _details(shown: list[GroupCount], viewer: Viewer) -> list[dict[str, Any]]:
    from smart_triggerer.db.store import Store

    with _session() as session:
        return Store(session).page_groups(
            [c.key for c in shown], sorted(viewer.listed_dag_ids()), MEMBERS_SHOWN, MEMBERS_SCANNED
        )


def _group(count: GroupCount, row: dict[str, Any], viewer: Viewer) -> dict[str, Any]:
    identity_hash, alone, queue = count.key
    classpath = row["classpath"]
    members = [_member(m) for m in row["first_members"] or []]
    return {
        "key": f"i{identity_hash}:{queue}" if alone is None else f"t{alone}",
        "waits_on": row["description"] or classpath.rsplit(".", 1)[-1],
        "trigger_class": classpath,
        "members": count.members,
        "dags": count.dags,
        "waiting_since": _iso(count.waiting_since),
        # the instance: with the Triggers view, or beside tasks whose task instances (which name it) they read
        "serving_instance": _serving(row, visible=viewer.views_triggers or bool(members)),
        "first_members": members,
    }


def _serving(row: dict[str, Any], *, visible: bool) -> dict[str, Any] | None:
    """The instance holding the group's shard (None: no owner now); which one, only to a user who may know."""
    if row["owner_job_id"] is None:
        return None
    if not visible:
        return {"job_id": None, "host": None}
    return {"job_id": row["owner_job_id"], "host": row["hostname"]}


def _member(member: dict[str, Any]) -> dict[str, Any]:
    from urllib.parse import quote

    path = "/".join(quote(str(member[k]), safe="") for k in ("dag_id", "run_id", "task_id"))
    dag, run, task = path.split("/")
    url = f"dags/{dag}/runs/{run}/tasks/{task}"
    if member["map_index"] is not None and member["map_index"] >= 0:
        url += f"/mapped/{member['map_index']}"
    return {**member, "url": url}


@app.get("/api/overview")
async def api_overview(user: User) -> dict[str, Any]:
    # deployment-wide counts (instances, waiters of every DAG): for users who may view triggers
    if not await run_in_threadpool(_may_view_triggers, user):
        raise HTTPException(status_code=403, detail="the overview needs access to the triggers view")
    may_read_assets = await run_in_threadpool(_may_read_assets, user)
    teams = await run_in_threadpool(_visible_teams, user)
    return await run_in_threadpool(overview, may_read_assets, teams)


@app.get("/api/groups")
async def api_groups(
    user: User,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> dict[str, Any]:
    viewer = await run_in_threadpool(_viewer, user)
    return await run_in_threadpool(groups_page, viewer, limit, offset)


@app.get("/ui/", response_class=HTMLResponse)
async def page(user: User) -> HTMLResponse:
    del user  # the page holds no data; it is still only served to signed-in users
    html = resources.files("smart_triggerer.web").joinpath("static/page.html").read_text()
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


class SmartTriggererPagePlugin(AirflowPlugin):
    """Registered through the ``airflow.plugins`` entry point of this package."""

    name = "smart_triggerer_page"
    fastapi_apps = [{"app": app, "url_prefix": "/smart-triggerer", "name": "smart triggerer page"}]
    external_views = [
        {
            "name": "Smart Triggerer",
            "href": "smart-triggerer/ui/",
            "url_route": "smart-triggerer",
            "destination": "nav",
            "category": "browse",
        }
    ]
