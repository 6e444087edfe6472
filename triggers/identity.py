"""The identity contract: which kwargs say *what* a trigger waits on, and a stable hash of them.

Two deferred tasks wait for the same thing when their triggers have the same classpath and the same
identity kwargs (Smart Sensor's "poke context"). Kwargs that say *how* to wait (poll interval, backoff,
timeouts) are execution settings and never split a group.

- Our triggers declare their identity kwargs with the class attribute ``identity_kwargs`` (see
  :class:`DedupableTrigger`).
- Triggers we do not own are deduplicated only when their classpath is allow-listed
  (:data:`BUILTIN_DEDUP_CLASSPATHS` plus ``[smart_triggerer] dedup_classpaths``); then every kwarg is
  identity. A trigger whose event is consumed (a queue message) rather than observed (a state) must never
  be allow-listed: two tasks would share one message.

The hash is SHA-256 over a canonical JSON encoding of ``[classpath, identity_kwargs]`` (sorted keys, no
whitespace), first 8 bytes as a signed 64-bit integer: the same on every process, host and release.
Python's ``hash()`` is salted per process and must never be used for this.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

# Airflow's own state-based triggers: each observes a state (a time, a file, a DAG run's state) that every
# waiter sees alike, and firing consumes nothing, so one poll serves every waiter.
BUILTIN_DEDUP_CLASSPATHS: frozenset[str] = frozenset(
    {
        # fires when a wall-clock moment has passed
        "airflow.providers.standard.triggers.temporal.DateTimeTrigger",
        # fires when a path (glob) exists; reading the file system consumes nothing
        "airflow.providers.standard.triggers.file.FileTrigger",
        # fires when other DAG runs / tasks reach given states (ExternalTaskSensor, deferrable)
        "airflow.providers.standard.triggers.external_task.WorkflowTrigger",
        # fires when DAG runs reach given states (TriggerDagRunOperator wait_for_completion)
        "airflow.providers.standard.triggers.external_task.DagStateTrigger",
    }
)

_DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


def _serialized(trigger: Any) -> Mapping[str, Any]:
    kwargs: Mapping[str, Any] = trigger.serialize()[1]
    return kwargs


# A DateTimeTrigger started from the triggerer keeps its (rendered) ``target_time`` string; one deferred
# from a worker carries ``moment``. Both wait for the same instant.
_NORMALIZERS: dict[str, Callable[[Any], Mapping[str, Any]]] = {
    _DATETIME_TRIGGER: lambda t: {"moment": t.moment, "end_from_trigger": t.end_from_trigger},
}

_TIME_TYPES = (dt.datetime, dt.date, dt.time)


class IdentityError(ValueError):
    """A trigger's identity cannot be computed (undeclared kwargs, unencodable values)."""


@dataclass(frozen=True)
class Identity:
    """What one trigger row waits on, as the triggerer stores it."""

    hash: int
    dedupable: bool

    def shard(self, shards: int) -> int:
        return shard_of(self.hash, shards)


class DedupableTrigger:
    """Mixin for our triggers: name the kwargs that say what is waited on.

    ``identity_kwargs`` must be a subset of the kwargs ``serialize()`` returns; all other kwargs are
    execution settings. ``merge_execution_kwargs`` picks the settings a group runs with: by default the
    smallest value of each numeric setting (the shortest poll interval is the most demanding) and the
    first member's value otherwise. Override it when "most demanding" means something else.
    """

    identity_kwargs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def merge_execution_kwargs(cls, members: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return merge_most_demanding(members)


def merge_most_demanding(members: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per key: the minimum of numeric values (bools excepted), else the first member's value."""
    merged: dict[str, Any] = {}
    for member in members:
        for key, value in member.items():
            if key not in merged:
                merged[key] = value
            elif _is_number(value) and _is_number(merged[key]):
                merged[key] = min(merged[key], value)
    return merged


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_TEMPLATE_MARKERS = ("{{", "{%", "{#")


def has_template(value: Any) -> bool:
    """Whether a (nested) value still holds unrendered Jinja."""
    if isinstance(value, str):
        return any(marker in value for marker in _TEMPLATE_MARKERS)
    if isinstance(value, Mapping):
        return any(has_template(v) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(has_template(v) for v in value)
    return False


def canonical(value: Any) -> Any:
    """A JSON-ready form in which equal waits are equal and different waits differ.

    Datetimes become UTC instants (a pendulum and a stdlib datetime for the same instant are equal);
    ints and floats stay distinct (``1`` vs ``1.0``); tuples and lists are the same sequence; sets are
    sorted; mappings are encoded with sorted string keys by :func:`canonical_json`.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return {"$set": sorted((canonical(v) for v in value), key=canonical_json)}
    return _canonical_scalar(value)


def _datetime(value: dt.datetime) -> Any:
    if value.tzinfo is None:
        return {"$naive_datetime": value.isoformat()}
    instant = value.astimezone(dt.UTC)
    return {"$datetime": dt.datetime(*instant.timetuple()[:6], instant.microsecond).isoformat()}


# Order matters: datetime is a date subclass.
_SCALARS: tuple[tuple[type | tuple[type, ...], Callable[[Any], Any]], ...] = (
    (float, lambda v: v if math.isfinite(v) else {"$float": repr(v)}),
    (dt.datetime, _datetime),
    (_TIME_TYPES, lambda v: {f"${type(v).__name__}": v.isoformat()}),
    (dt.timedelta, lambda v: {"$timedelta": [v.days, v.seconds, v.microseconds]}),
    (decimal.Decimal, lambda v: {"$decimal": str(v.normalize())}),
    (bytes, lambda v: {"$bytes": v.hex()}),
)


def _canonical_scalar(value: Any) -> Any:
    for types, encode in _SCALARS:
        if isinstance(value, types):
            return encode(value)
    raise IdentityError(f"cannot encode a {type(value).__name__} into a trigger identity")


def canonical_json(value: Any) -> str:
    return json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def identity_hash(classpath: str, identity_kwargs: Mapping[str, Any]) -> int:
    """SHA-256 of ``[classpath, identity_kwargs]`` in canonical JSON, first 8 bytes, signed big-endian."""
    digest = hashlib.sha256(canonical_json([classpath, dict(identity_kwargs)]).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def shard_of(hash_value: int, shards: int) -> int:
    if shards <= 0:
        raise ValueError(f"shards must be positive, got {shards}")
    return hash_value % shards


def singleton_hash(classpath: str, trigger_id: int) -> int:
    """The identity of a trigger that is never deduplicated: its own row."""
    return identity_hash(classpath, {"$trigger_id": trigger_id})


@dataclass(frozen=True)
class IdentityPolicy:
    """Decides which kwargs of a classpath are identity; ``None`` means "never deduplicate"."""

    allowed_classpaths: frozenset[str]
    resolve_class: Callable[[str], type]

    @classmethod
    def with_extra(cls, extra: Iterable[str], resolve_class: Callable[[str], type]) -> IdentityPolicy:
        allowed = BUILTIN_DEDUP_CLASSPATHS | {c.strip() for c in extra if c.strip()}
        return cls(frozenset(allowed), resolve_class)

    def identity_keys(self, classpath: str, kwargs: Mapping[str, Any]) -> tuple[str, ...] | None:
        if classpath in self.allowed_classpaths:
            return tuple(sorted(kwargs))
        try:
            trigger_class = self.resolve_class(classpath)
        except Exception:  # an unimportable class runs alone; the runner fails it with the cause
            return None
        declared = getattr(trigger_class, "identity_kwargs", None)
        if not declared:
            return None
        return tuple(declared)

    def _normalized(self, classpath: str, kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
        """What the trigger itself makes of its kwargs: constructor variants of one wait (e.g.
        DateTimeTrigger's ``target_time`` string and ``moment`` datetime) become one identity."""
        try:
            trigger = self.resolve_class(classpath)(**kwargs)
            return _NORMALIZERS.get(classpath, _serialized)(trigger)
        except Exception:
            return kwargs

    def identity(self, classpath: str, kwargs: Mapping[str, Any], trigger_id: int) -> Identity:
        keys = self.identity_keys(classpath, kwargs)
        if keys is not None and has_template(kwargs):
            # start_from_trigger tasks are rendered in the runner: "{{ data_interval_end }}" is the same
            # text for runs that wait for different times, so unrendered kwargs say nothing of the wait.
            keys = None
        if keys is None:
            return Identity(singleton_hash(classpath, trigger_id), dedupable=False)
        if keys is not None:
            kwargs = self._normalized(classpath, kwargs)
        if classpath in self.allowed_classpaths:
            keys = tuple(sorted(kwargs))
        missing = [k for k in keys if k not in kwargs]
        if missing:
            raise IdentityError(f"{classpath} declares identity kwargs {missing} that it did not serialize")
        return Identity(identity_hash(classpath, {k: kwargs[k] for k in keys}), dedupable=True)
