"""HttpConditionSensor: wait for an HTTP endpoint's status code and, optionally, a JSON value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from deferrables.base import CheckThenDeferSensor
from triggers.http import HttpCondition, HttpConditionTrigger, http_target
from triggers.pg import SourceError


class HttpConditionSensor(CheckThenDeferSensor):
    """Wait until ``endpoint`` on the Airflow HTTP connection answers one of ``expected_statuses`` and,
    with ``json_path`` (dotted keys, e.g. ``"data.state"``), until that value equals ``expected_value``.

    Host, scheme, port, login/password (basic auth) and headers (the connection's extra) come from the
    connection. TLS certificates are verified unless ``verify_ssl=False``. 5xx/408/429 keep waiting; any
    other unexpected status or an invalid URL fails the task with the cause.
    """

    template_fields: Sequence[str] = ("endpoint", "data", "headers", "expected_value")

    def __init__(
        self,
        *,
        endpoint: str,
        http_conn_id: str = "http_default",
        method: str = "GET",
        data: Any = None,
        headers: dict[str, str] | None = None,
        expected_statuses: Sequence[int] = (200,),
        json_path: str | None = None,
        expected_value: Any = None,
        verify_ssl: bool = True,
        start_from_trigger: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(endpoint, str):
            raise ValueError(f"endpoint must be a string path, got {type(endpoint).__name__}")
        if not isinstance(http_conn_id, str) or not http_conn_id:
            raise ValueError(f"http_conn_id must be a non-empty connection id, got {http_conn_id!r}")
        if isinstance(expected_statuses, int):
            expected_statuses = (expected_statuses,)
        HttpCondition(
            endpoint,
            method,
            data,
            dict(headers or {}),
            tuple(expected_statuses),
            json_path,
            expected_value,
            verify_ssl,
        )  # validates, naming the argument
        self.endpoint, self.http_conn_id, self.method = endpoint, http_conn_id, method.upper()
        self.data, self.headers = data, dict(headers or {})
        self.expected_statuses = tuple(expected_statuses)
        self.json_path, self.expected_value, self.verify_ssl = json_path, expected_value, verify_ssl
        if start_from_trigger:
            self._start_in_triggerer(self.trigger())

    def _condition(self) -> HttpCondition:
        return HttpCondition(
            self.endpoint,
            self.method,
            self.data,
            self.headers,
            self.expected_statuses,
            self.json_path,
            self.expected_value,
            self.verify_ssl,
        )

    async def check(self) -> dict[str, Any] | None:
        target = await http_target(self.http_conn_id)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                return await self._condition().check(target, session)
        except SourceError as err:
            return {"status": "error", "message": str(err)}
        except aiohttp.ClientError as err:
            self.log.warning("endpoint unreachable; the trigger will keep trying: %s", type(err).__name__)
            return None

    def trigger(self) -> HttpConditionTrigger:
        return HttpConditionTrigger(
            self.http_conn_id,
            self.endpoint,
            method=self.method,
            data=self.data,
            headers=self.headers,
            expected_statuses=self.expected_statuses,
            json_path=self.json_path,
            expected_value=self.expected_value,
            verify_ssl=self.verify_ssl,
            poll_interval=self.poke_interval,
        )
