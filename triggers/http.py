"""Waiting for an HTTP endpoint: expected status codes, optionally a JSON value at a dotted path.

One aiohttp session per event loop serves every HTTP trigger of the process, and ``shared_request`` lets
at most as many requests in as the session has connections: a takeover or a start of thousands makes
thousands of first polls at once, and requests queued inside aiohttp's connector cost it more CPU than
those that wait outside (docs/design.md, Measurements behind the code). TLS certificates are verified
unless the sensor says otherwise. 5xx, 408 and 429 mean "not yet" (the service is busy or down); any other
unexpected status, and an invalid URL, end the wait with the cause.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from airflow.triggers.base import BaseTrigger, TriggerEvent
from yarl import URL

from triggers.connections import CONNECTION_PATIENCE, aextra_dejson, aget_connection
from triggers.identity import DedupableTrigger
from triggers.pg import SourceError
from triggers.polling import poll_until

RETRYABLE = {408, 429}
METHODS = {"GET", "POST", "HEAD", "PUT", "PATCH"}
_JSON_PATH = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
CONNECTIONS = 50  # per event loop, for every host together (aiohttp's own default is 100)
_sessions: dict[int, aiohttp.ClientSession] = {}
_slots: dict[int, asyncio.Semaphore] = {}


def shared_session() -> aiohttp.ClientSession:
    key = id(asyncio.get_running_loop())
    session = _sessions.get(key)
    if session is None or session.closed:
        # no cookie jar: the session is every trigger's, and a cookie one DAG's credentials earned must
        # never ride along with another DAG's request to the same host (Airflow's hook, too, keeps no
        # cookie from one poll to the next: a session per call)
        session = _sessions[key] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONNECTIONS),
            timeout=aiohttp.ClientTimeout(total=60),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        _slots[key] = asyncio.Semaphore(CONNECTIONS)
    return session


@asynccontextmanager
async def shared_request(method: str, url: str, **kwargs: Any) -> AsyncIterator[aiohttp.ClientResponse]:
    """``shared_session().request(...)``, entered once a connection is free: the request is made (its
    objects, its timeout) only then, and its wait is an ordinary semaphore's. The timeout counts from
    there, as it does for a request that finds a free connection at once."""
    session = shared_session()
    async with _slots[id(asyncio.get_running_loop())], session.request(method, url, **kwargs) as response:
        yield response


@dataclass(frozen=True)
class HttpTarget:
    base_url: str
    auth: aiohttp.BasicAuth | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # credentials stay out of logs
        return f"HttpTarget(base_url={self.base_url!r})"


async def http_target(conn_id: str, *, patience: float = 0.0) -> HttpTarget:
    """The connection's base URL, auth and headers; a trigger passes ``patience`` (triggers/connections.py:
    a failed lookup looks like a missing one)."""
    conn = await aget_connection(conn_id, patience=patience)
    host = conn.host or ""
    if "://" not in host:
        host = f"{conn.schema or 'http'}://{host}"
    if conn.port:
        host = f"{host}:{conn.port}"
    extra = await aextra_dejson(conn)
    headers = extra.get("headers", {k: v for k, v in extra.items() if isinstance(v, str)})
    auth = aiohttp.BasicAuth(conn.login, conn.password or "") if conn.login else None
    return HttpTarget(base_url=host.rstrip("/"), auth=auth, headers=dict(headers))


# what a host name may hold once IDNA-encoded (an IPv6 literal's colons and a zone's % included)
_HOST = re.compile(r"[A-Za-z0-9.\-_:%]+")


def refuse_unresolvable(url: str) -> None:
    """A host no resolver can ever answer for (spaces, no host at all) fails the wait at once with the
    cause, not as a DNS error retried until the task's timeout."""
    try:
        raw_host = URL(url).raw_host
    except ValueError as err:
        raise SourceError(f"invalid URL {url!r}: {err}") from err
    if not raw_host or not _HOST.fullmatch(raw_host):
        raise SourceError(
            f"invalid URL {url!r}: its host {raw_host or ''!r} can never resolve (fix the connection's host)"
        )


def json_value(document: Any, path: str) -> Any:
    """``a.b.0.c`` into nested objects and lists; a missing step gives None."""
    for step in path.split("."):
        if isinstance(document, dict):
            document = document.get(step)
        elif isinstance(document, list) and step.isdigit() and int(step) < len(document):
            document = document[int(step)]
        else:
            return None
    return document


@dataclass(frozen=True)
class HttpCondition:
    endpoint: str
    method: str = "GET"
    data: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    expected_statuses: tuple[int, ...] = (200,)
    json_path: str | None = None
    expected_value: Any = None
    verify_ssl: bool = True

    def __post_init__(self) -> None:
        if self.method.upper() not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {sorted(METHODS)}")
        if not self.expected_statuses or not all(
            isinstance(s, int) and 100 <= s <= 599 for s in self.expected_statuses
        ):
            raise ValueError(f"expected_statuses={self.expected_statuses!r} must be HTTP status codes")
        if self.json_path is not None and not _JSON_PATH.match(self.json_path):
            raise ValueError(f"json_path={self.json_path!r} must be dotted keys like 'data.state'")

    async def check(
        self, target: HttpTarget, session: aiohttp.ClientSession | None = None
    ) -> dict[str, Any] | None:
        """Through the triggerer's shared session, or through ``session`` (a worker's poke, on a loop of
        its own)."""
        url = f"{target.base_url}/{self.endpoint.lstrip('/')}"
        refuse_unresolvable(url)
        request = session.request if session is not None else shared_request
        try:
            # aiohttp builds the request lazily: an invalid URL is raised entering the block, not above
            async with request(
                self.method.upper(),
                url,
                auth=target.auth,
                headers={**target.headers, **self.headers},
                json=self.data if self.data is not None else None,
                ssl=self.verify_ssl,
            ) as response:
                return await self._judge(response, url)
        except aiohttp.InvalidURL as err:
            raise SourceError(f"invalid URL {url!r}: {err}") from err

    async def _judge(self, response: aiohttp.ClientResponse, url: str) -> dict[str, Any] | None:
        status = response.status
        if status not in self.expected_statuses:
            if status >= 500 or status in RETRYABLE:
                return None
            raise SourceError(f"HTTP {status} from {url} (expected {list(self.expected_statuses)})")
        if self.json_path is None:
            return {"status": "success", "message": f"HTTP {status} from {url}"}
        try:
            document = await response.json(content_type=None)
        except ValueError:
            return None  # not JSON (yet): keep waiting
        value = json_value(document, self.json_path)
        if value == self.expected_value:
            return {"status": "success", "message": f"{self.json_path} is {value!r}", "value": value}
        return None


class HttpConditionTrigger(DedupableTrigger, BaseTrigger):
    calls_sync_sdk = False  # connections and comms are asked with await: no greenback portal needed
    identity_kwargs = (
        "http_conn_id",
        "endpoint",
        "method",
        "data",
        "headers",
        "expected_statuses",
        "json_path",
        "expected_value",
        "verify_ssl",
    )
    wait_description = "HTTP {method} {endpoint!p} on {http_conn_id} answering {expected_statuses}"
    # rendered in the triggerer when the task starts there (start_from_trigger)
    template_fields = ("endpoint", "data", "headers", "expected_value")

    def __init__(
        self,
        http_conn_id: str,
        endpoint: str,
        *,
        method: str = "GET",
        data: Any = None,
        headers: dict[str, str] | None = None,
        expected_statuses: Sequence[int] = (200,),
        json_path: str | None = None,
        expected_value: Any = None,
        verify_ssl: bool = True,
        poll_interval: float = 60.0,
    ) -> None:
        super().__init__()
        self.http_conn_id, self.endpoint, self.method = http_conn_id, endpoint, method.upper()
        self.data, self.headers = data, dict(headers or {})
        self.expected_statuses = [int(s) for s in expected_statuses]
        self.json_path, self.expected_value, self.verify_ssl = json_path, expected_value, verify_ssl
        self.poll_interval = float(poll_interval)
        self.validate()

    def validate(self) -> HttpCondition:
        """The condition from the current fields (rendered first when the task starts in the triggerer)."""
        return HttpCondition(
            self.endpoint,
            self.method,
            self.data,
            dict(self.headers),
            tuple(self.expected_statuses),
            self.json_path,
            self.expected_value,
            self.verify_ssl,
        )

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.http.HttpConditionTrigger",
            {
                "http_conn_id": self.http_conn_id,
                "endpoint": self.endpoint,
                "method": self.method,
                "data": self.data,
                "headers": self.headers,
                "expected_statuses": self.expected_statuses,
                "json_path": self.json_path,
                "expected_value": self.expected_value,
                "verify_ssl": self.verify_ssl,
                "poll_interval": self.poll_interval,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        target = await http_target(self.http_conn_id, patience=CONNECTION_PATIENCE)
        condition = self.validate()

        async def check() -> dict[str, Any] | None:
            return await condition.check(target)

        yield TriggerEvent(await poll_until(check, poll_interval=self.poll_interval, log=self.log))
