"""``[smart_triggerer]`` settings (env ``AIRFLOW__SMART_TRIGGERER__<KEY>``), validated once at start."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from smart_triggerer.errors import UserError

T = TypeVar("T")
_CLASSPATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
EVENT_LOOPS = ("uvloop", "asyncio")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConfigError(UserError, ValueError):
    """A ``[smart_triggerer]`` setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class Settings:
    shards: int = 64
    lease_seconds: float = 8.0
    dedup: bool = True
    dedup_classpaths: tuple[str, ...] = ()
    health_port: int | None = None
    # 127.0.0.1 keeps /health private; 0.0.0.0 or a pod IP lets Kubernetes probes and Prometheus in
    health_host: str = "127.0.0.1"
    # required when health_host is not a loopback address: the endpoint then answers only to this bearer
    health_token: str = field(default="", repr=False)
    # Airflow 3.3.2 fails a task resumed before the scheduler has handled its deferring worker's exit
    # (apache/airflow#71580 family): the worker's supervisor notices the exit up to a worker heartbeat
    # (5 s) after the deferral, the scheduler reads it a loop or more later. An event for a member that
    # deferred more recently than this is held back until it is old enough. (6 s was too short on a busy
    # host: the report came 6.4 s after a deferral and failed the task.)
    resume_hold_seconds: float = 10.0
    loop_seconds: float = 1.0
    # coroutines started (and rows hashed, times 4) per batch; batches go on while a loop's time budget
    # lasts, and between loads while groups wait for a coroutine (a takeover, a cold start)
    max_new_per_loop: int = 250
    # task instances resumed in one transaction (bounds lock time and the cost of one refused batch)
    max_resumes_per_transaction: int = 2000
    # the runner subprocess's asyncio event loop: uvloop (libuv) or Python's own
    event_loop: str = "uvloop"
    # placement (placement.py): no instance holds more than (1 + epsilon) times its capacity-weighted
    # share of the groups while another has room
    placement_epsilon: float = 0.25
    # an instance whose runner's event loop lags more than this (p99 over the last 10 s) takes no new
    # shards and hands shards over until it is back under half of it (0: off). A second: polls that late
    # are a runner that cannot keep up (a takeover's start is not counted), not a busy moment
    max_loop_lag_ms: float = 1000.0
    # the same for the instance's memory (supervisor and runner, RSS; 0: off)
    max_rss_mb: int = 0
    # how often Airflow's clean_unused and the check for members nothing waits on read every trigger and
    # waiting task row: the safety net for departures neither the resume nor the partial index sees
    sweep_seconds: float = 600.0
    # a runner that has not answered its supervisor for this long (a trigger blocked the event loop with a
    # sync call) gets its instance out of the fleet: every shard handed over at once, /health 503, until
    # the runner answers again (0: off). Unset: three leases (24 s at the default lease), past the longest
    # start of a big takeover and below Airflow's own runner_health_check_threshold plus its heartbeat limit
    runner_stall_seconds: float | None = None

    @property
    def stall_seconds(self) -> float:
        return 3 * self.lease_seconds if self.runner_stall_seconds is None else self.runner_stall_seconds

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ConfigError(f"[smart_triggerer] shards must be >= 1, got {self.shards}")
        if self.lease_seconds < 3 * self.loop_seconds:
            raise ConfigError(
                f"[smart_triggerer] lease_seconds must be at least 3 loops ({3 * self.loop_seconds}s), "
                f"got {self.lease_seconds}"
            )
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ConfigError(f"[smart_triggerer] health_port must be 0-65535, got {self.health_port}")
        if self.health_port is not None and not is_loopback(self.health_host) and not self.health_token:
            raise ConfigError(
                f"[smart_triggerer] health_host is {self.health_host}, reachable from the network: set "
                "[smart_triggerer] health_token (AIRFLOW__SMART_TRIGGERER__HEALTH_TOKEN) so that /health "
                "and /metrics answer only requests with 'Authorization: Bearer <token>'"
            )
        if self.resume_hold_seconds < 0:
            raise ConfigError("[smart_triggerer] resume_hold_seconds must be >= 0")
        if self.sweep_seconds < 10:
            raise ConfigError(f"[smart_triggerer] sweep_seconds must be >= 10, got {self.sweep_seconds}")
        if self.runner_stall_seconds is not None and self.runner_stall_seconds < 0:
            raise ConfigError(
                f"[smart_triggerer] runner_stall_seconds must be >= 0 (0: off), "
                f"got {self.runner_stall_seconds}"
            )
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(
                f"[smart_triggerer] event_loop must be one of {', '.join(EVENT_LOOPS)}, "
                f"got {self.event_loop!r}"
            )
        self._check_placement()
        self._check_classpaths()

    def _check_classpaths(self) -> None:
        for classpath in self.dedup_classpaths:
            if not _CLASSPATH.fullmatch(classpath):
                raise ConfigError(
                    f"[smart_triggerer] dedup_classpaths: {classpath!r} is not a trigger's "
                    "dotted classpath (module.Class, comma separated)"
                )

    def _check_placement(self) -> None:
        if not 0 < self.placement_epsilon <= 10:
            raise ConfigError(
                f"[smart_triggerer] placement_epsilon must be > 0 and <= 10, got {self.placement_epsilon}"
            )
        if self.max_loop_lag_ms < 0:
            raise ConfigError(
                f"[smart_triggerer] max_loop_lag_ms must be >= 0 (0: off), got {self.max_loop_lag_ms}"
            )
        if self.max_rss_mb < 0:
            raise ConfigError(f"[smart_triggerer] max_rss_mb must be >= 0 (0: off), got {self.max_rss_mb}")

    @classmethod
    def from_airflow(cls) -> Settings:
        port = _option("health_port", str, "")
        return cls(
            shards=_option("shards", int, cls.shards),
            lease_seconds=_option("lease_seconds", float, cls.lease_seconds),
            dedup=_option("dedup", _boolean, cls.dedup),
            dedup_classpaths=_split(_option("dedup_classpaths", str, "")),
            health_port=_number("health_port", port, int) if port.strip() else None,
            health_host=_option("health_host", str, cls.health_host).strip() or cls.health_host,
            health_token=_option("health_token", str, "").strip(),
            resume_hold_seconds=_option("resume_hold_seconds", float, cls.resume_hold_seconds),
            loop_seconds=_option("loop_seconds", float, cls.loop_seconds),
            event_loop=_option("event_loop", str, cls.event_loop).strip().lower(),
            placement_epsilon=_option("placement_epsilon", float, cls.placement_epsilon),
            max_loop_lag_ms=_option("max_loop_lag_ms", float, cls.max_loop_lag_ms),
            max_rss_mb=_option("max_rss_mb", int, cls.max_rss_mb),
            sweep_seconds=_option("sweep_seconds", float, cls.sweep_seconds),
            runner_stall_seconds=_option("runner_stall_seconds", float, None),
        )


SECTION = "smart_triggerer"


def _option(key: str, kind: Callable[[str], T], default: T) -> T:
    from airflow.configuration import conf

    raw = conf.get(SECTION, key, fallback=None)
    if raw is None or str(raw).strip() == "":
        return default
    return _number(key, str(raw), kind)


def _number(key: str, raw: str, kind: Callable[[str], T]) -> T:
    try:
        return kind(raw.strip())
    except ValueError:
        wanted = {int: "an integer", float: "a number", _boolean: "true or false"}.get(kind, "a value")
        raise ConfigError(
            f"[{SECTION}] {key} must be {wanted}, got {raw!r} "
            f"(set in airflow.cfg or AIRFLOW__{SECTION.upper()}__{key.upper()})"
        ) from None


def _boolean(raw: str) -> bool:
    value = raw.lower()
    if value in ("true", "t", "1", "yes", "on"):
        return True
    if value in ("false", "f", "0", "no", "off"):
        return False
    raise ValueError(raw)


def _split(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())
