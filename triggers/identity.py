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

import dataclasses
import datetime as dt
import decimal
import functools
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from triggers.describe import (
    BUILTIN_DESCRIPTIONS,
    REPLACED_TEMPLATES,
    DescriptionError,
    describe,
    template_names,
)

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
# execution kwargs that say how often a trigger polls (a group polls at the shortest of its members')
INTERVAL_KWARGS = ("poll_interval", "poke_interval")


_TIME_TYPES = (dt.datetime, dt.date, dt.time)


class IdentityError(ValueError):
    """A trigger's identity cannot be computed (undeclared kwargs, unencodable values)."""


@dataclass(frozen=True)
class Identity:
    """What one trigger row waits on, as the triggerer stores it.

    ``execution``: the kwargs a group merges, each as ``(rule, value)`` (see :data:`MERGE_RULES`).
    """

    hash: int
    dedupable: bool
    execution: Mapping[str, tuple[str, Any]] = field(default_factory=dict, compare=False)
    description: str | None = field(default=None, compare=False)  # plain words, for people (describe.py)

    def shard(self, shards: int) -> int:
        return shard_of(self.hash, shards)


# The reserved kwarg our triggers add to what they serialize: which kwargs are identity and how each
# execution kwarg merges. The triggerer reads it as data, so it never imports trigger code (DAG authors'
# code) in the process that holds the metadata database.
IDENTITY_KWARG = "__smart_identity__"
IDENTITY_VERSION = 1
# how a group combines one execution kwarg of its members
MERGE_RULES = ("min", "max", "union", "any")


class DeclaresIdentity:
    """Base of the identity mixins: adds :data:`IDENTITY_KWARG` to ``serialize()`` and drops it in
    ``__init__``. Subclasses set ``identity_kwargs`` (see :class:`DedupableTrigger`) or
    ``shared_stream_kwargs`` (asset watchers that share one poll loop: the kwargs that make up their
    ``shared_stream_key``, so the triggerer places them on one shard without importing them)."""

    identity_kwargs: ClassVar[tuple[str, ...]] = ()
    execution_merge: ClassVar[Mapping[str, str]] = {}
    shared_stream_kwargs: ClassVar[tuple[str, ...]] = ()
    # what is waited on, in plain words for the Smart Triggerer page: a format string over identity kwargs
    # (e.g. "{required_tables} loaded[ since {since}]"; see triggers/describe.py)
    wait_description: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.wait_description:
            try:
                shown = template_names(cls.wait_description)
            except DescriptionError as err:
                raise TypeError(f"{cls.__name__}.wait_description: {err}") from err
            allowed = set(cls.identity_kwargs) | set(cls.shared_stream_kwargs)
            if shown - allowed:
                raise TypeError(
                    f"{cls.__name__}.wait_description shows {sorted(shown - allowed)}: only "
                    "identity kwargs may be shown (others may hold secrets)"
                )
        for rule in cls.execution_merge.values():
            if rule not in MERGE_RULES:
                raise TypeError(f"{cls.__name__}.execution_merge: unknown rule {rule!r} ({MERGE_RULES})")
        if "__init__" in cls.__dict__:
            cls.__init__ = _dropping_marker(cls.__dict__["__init__"])  # type: ignore[method-assign]
        if "serialize" in cls.__dict__:
            cls.serialize = _adding_marker(cls.__dict__["serialize"])  # type: ignore[attr-defined]


class DedupableTrigger(DeclaresIdentity):
    """Mixin for our triggers: name the kwargs that say what is waited on.

    ``identity_kwargs`` must be a subset of the kwargs ``serialize()`` returns; all other kwargs are
    execution settings. A group of identical waits runs with its members' most demanding settings:
    ``execution_merge`` names how each execution kwarg merges (``min``: the smallest number, e.g. a poll
    interval; ``max``; ``union``: every distinct value, e.g. the NOTIFY channels to listen on, so a value
    may become a list; ``any``: a boolean that is true when any member's is). An undeclared numeric kwarg
    merges by ``min``; any other undeclared kwarg splits the group (members must agree on it).

    Subclasses write ``__init__`` and ``serialize`` as usual: the mixin adds :data:`IDENTITY_KWARG` to the
    serialized kwargs and drops it again when Airflow rebuilds the trigger from them. Values of merged
    kwargs are stored in plain text by the triggerer: never declare a merge for a kwarg that may hold a
    secret.

    Deduplication makes one poll per *distinct* wait. A trigger whose check reads rows by key (a status
    row per table) can also share one query with the other distinct waits on the same source: its
    ``run`` joins a :class:`triggers.coalesce.KeyedBatch` (``shared_batch``) instead of polling alone, and
    judges the rows of its own keys itself. The contract is in ``triggers/coalesce.py``;
    docs/guides/deduplicable-triggers.md has an example.
    """


def identity_marker(trigger_class: type, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """What :data:`IDENTITY_KWARG` holds for these serialized kwargs (None: not deduplicated)."""
    keys = tuple(getattr(trigger_class, "identity_kwargs", ()) or ())
    stream = tuple(getattr(trigger_class, "shared_stream_kwargs", ()) or ())
    described = getattr(trigger_class, "wait_description", None)
    extra = {"describe": described} if described else {}
    if stream:
        return {"v": IDENTITY_VERSION, "shared_stream": sorted(stream), **extra}
    if not keys:
        return None
    merge = dict(getattr(trigger_class, "execution_merge", {}) or {})
    return {
        "v": IDENTITY_VERSION,
        "identity": sorted(keys),
        "merge": {k: merge[k] for k in sorted(merge) if k in kwargs and k not in keys},
        **extra,
    }


def _dropping_marker(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop(IDENTITY_KWARG, None)
        init(self, *args, **kwargs)

    return __init__


def _adding_marker(serialize: Callable[[Any], tuple[str, dict[str, Any]]]) -> Callable[[Any], Any]:
    @functools.wraps(serialize)
    def wrapped(self: Any) -> tuple[str, dict[str, Any]]:
        classpath, kwargs = serialize(self)
        kwargs = {k: v for k, v in kwargs.items() if k != IDENTITY_KWARG}
        marker = identity_marker(type(self), kwargs)
        if marker is not None:
            kwargs[IDENTITY_KWARG] = marker
        return classpath, kwargs

    return wrapped


def merge_values(rule: str, values: Sequence[Any]) -> Any:
    """One execution kwarg of a group, from its members' values, by ``rule`` (see MERGE_RULES)."""
    if len(values) == 1 and rule in ("min", "max"):
        return values[0]  # what the rules below give for one value (None included), without their work
    present = [v for v in values if v is not None]
    if rule == "union":
        items: set[str] = set()
        for value in present:
            items.update([value] if isinstance(value, str) else list(value))
        return sorted(items) or None
    if not present:
        return None
    if rule == "any":
        return any(bool(v) for v in present)
    numbers = [v for v in present if _is_number(v)]
    if len(numbers) != len(present):
        return present[0]
    return min(numbers) if rule == "min" else max(numbers)


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
    return json.dumps(
        canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


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


def _datetime_trigger(kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """DateTimeTrigger started from the triggerer keeps its (rendered) ``target_time`` string; deferred
    from a worker it carries ``moment``. Both wait for the same instant."""
    target = kwargs.get("target_time")
    if kwargs.get("moment") is not None or target is None:
        return kwargs
    moment = target if isinstance(target, dt.datetime) else dt.datetime.fromisoformat(str(target))
    rest = {k: v for k, v in kwargs.items() if k != "target_time"}
    return {**rest, "moment": moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)}


_NORMALIZERS: dict[str, Callable[[Mapping[str, Any]], Mapping[str, Any]]] = {
    _DATETIME_TRIGGER: _datetime_trigger,
}


def _mergeable(value: Any) -> bool:
    """Values a group may merge and the triggerer may store: plain numbers, strings, lists of strings."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)


@dataclass(frozen=True)
class IdentityPolicy:
    """Decides from a trigger's kwargs alone (never importing its class) what it waits on.

    Allow-listed classpaths hash all their kwargs. Any other trigger is deduplicated only when its kwargs
    carry :data:`IDENTITY_KWARG` (our :class:`DedupableTrigger` adds it); everything else runs alone.
    """

    allowed_classpaths: frozenset[str]

    @classmethod
    def with_extra(cls, extra: Iterable[str]) -> IdentityPolicy:
        allowed = BUILTIN_DEDUP_CLASSPATHS | {c.strip() for c in extra if c.strip()}
        return cls(frozenset(allowed))

    def identity(self, classpath: str, kwargs: Mapping[str, Any], trigger_id: int) -> Identity:
        kwargs = dict(kwargs)
        marker = kwargs.pop(IDENTITY_KWARG, None)
        templated = has_template(kwargs)
        found = self._identity(classpath, kwargs, marker, trigger_id, templated)
        template = BUILTIN_DESCRIPTIONS.get(classpath)
        if isinstance(marker, Mapping) and isinstance(marker.get("describe"), str):
            template = REPLACED_TEMPLATES.get(marker["describe"], marker["describe"])
            # the kwargs are data from the database: shown are only those the marker says are identity,
            # whatever the template (checked at class creation too) names
            allowed = {*(marker.get("identity") or ()), *(marker.get("shared_stream") or ())}
            kwargs = {k: v for k, v in kwargs.items() if k in allowed}
        # a subset of unrendered kwargs may be rendered; a subset of rendered ones is
        if template is None or (templated and has_template(kwargs)):
            return found
        return dataclasses.replace(found, description=describe(template, kwargs))

    def _identity(
        self, classpath: str, kwargs: dict[str, Any], marker: Any, trigger_id: int, templated: bool
    ) -> Identity:
        if templated:
            # start_from_trigger tasks are rendered in the runner: "{{ data_interval_end }}" is the same
            # text for runs that wait for different times, so unrendered kwargs say nothing of the wait.
            return _alone(classpath, trigger_id)
        if classpath in self.allowed_classpaths:
            normalized = _NORMALIZERS.get(classpath, lambda k: k)(kwargs)
            return Identity(
                identity_hash(classpath, normalized), dedupable=True, execution=_intervals(kwargs)
            )
        if not isinstance(marker, Mapping):
            return _alone(classpath, trigger_id)
        if marker.get("shared_stream"):
            stream = _names(marker["shared_stream"], classpath)
            key = [classpath, {k: kwargs.get(k) for k in stream}]
            return Identity(identity_hash("$shared_stream", {"key": key}), dedupable=False)
        return self._declared(classpath, kwargs, marker)

    def _declared(self, classpath: str, kwargs: dict[str, Any], marker: Mapping[str, Any]) -> Identity:
        keys = _names(marker.get("identity"), classpath)
        missing = [k for k in keys if k not in kwargs]
        if missing:
            raise IdentityError(f"{classpath} declares identity kwargs {missing} that it did not serialize")
        rules = marker.get("merge") or {}
        what = {k: kwargs[k] for k in keys}
        execution: dict[str, tuple[str, Any]] = {}
        split: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in what:
                continue
            rule = rules.get(key) if isinstance(rules, Mapping) else None
            if rule is None and _is_number(value):
                rule = "min"
            if rule in MERGE_RULES and _mergeable(value):
                execution[key] = (rule, list(value) if isinstance(value, tuple) else value)
            else:
                split[key] = value  # members must agree on it: part of the group's identity
        if split:
            what["$split"] = split
        return Identity(identity_hash(classpath, what), dedupable=True, execution=execution)


def _alone(classpath: str, trigger_id: int) -> Identity:
    return Identity(singleton_hash(classpath, trigger_id), dedupable=False)


def _intervals(kwargs: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """An allow-listed trigger's poll interval, also as an execution setting: it is identity like all its
    kwargs (members agree on it), and the group's polls saved are counted from its settings."""
    return {k: ("min", kwargs[k]) for k in INTERVAL_KWARGS if _is_number(kwargs.get(k))}


def _names(value: Any, classpath: str) -> list[str]:
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) for v in value):
        raise IdentityError(f"{classpath} has a malformed {IDENTITY_KWARG}")
    return list(value)
