"""Turning new trigger rows into stored identities: decrypt once, hash, place on a shard.

A row whose kwargs cannot be read gets an identity with an error (never the kwargs themselves in it: they
may hold secrets); the supervisor then fails that row's tasks alone with the cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from triggerer.config import Settings
from triggerer.store import NewIdentity
from triggers.identity import Identity, IdentityPolicy, canonical, identity_hash, shard_of

log = structlog.get_logger(logger_name=__name__)


def group_key(trigger_id: int, identity: int, dedupable: bool) -> int:
    """Dedupable rows group by identity; any other row is a group of its own."""
    return identity if dedupable else identity_hash("$trigger", {"id": trigger_id})


def _resolve_class(classpath: str) -> type:
    from airflow._shared.module_loading import import_string

    cls: type = import_string(classpath)
    return cls


def _decrypt(raw: str) -> dict[str, Any]:
    from airflow.models.trigger import Trigger
    from airflow.serialization.decoders import smart_decode_trigger_kwargs

    kwargs = Trigger._decrypt_kwargs(raw)
    return {k: smart_decode_trigger_kwargs(v) for k, v in kwargs.items()}


def _numeric_execution(kwargs: Mapping[str, Any], identity_keys: Iterable[str]) -> dict[str, float]:
    keys = set(identity_keys)
    return {
        k: v for k, v in kwargs.items()
        if k not in keys and isinstance(v, int | float) and not isinstance(v, bool)
    }


def _shared_stream_identity(classpath: str, kwargs: dict[str, Any], trigger_id: int) -> Identity | None:
    """Asset-watcher triggers that share a poll loop (``shared_stream_key``) are placed together."""
    from airflow.triggers.base import BaseEventTrigger

    try:
        cls = _resolve_class(classpath)
        if not (isinstance(cls, type) and issubclass(cls, BaseEventTrigger)):
            return None
        key = cls(**kwargs).shared_stream_key()
    except Exception:
        return None
    if key is None:
        return None
    return Identity(identity_hash("$shared_stream", {"key": canonical(key)}), dedupable=False)


def identity_of(trigger_id: int, classpath: str, raw: str, settings: Settings,
                policy: IdentityPolicy) -> NewIdentity:
    kwargs = _decrypt(raw)
    identity = _shared_stream_identity(classpath, kwargs, trigger_id)
    execution: dict[str, float] = {}
    if identity is None:
        identity = policy.identity(classpath, kwargs, trigger_id)
        keys = policy.identity_keys(classpath, kwargs) or ()
        if identity.dedupable:
            execution = _numeric_execution(kwargs, keys)
    return NewIdentity(trigger_id, identity.hash, shard_of(identity.hash, settings.shards),
                       identity.dedupable, execution)


def compute_identities(rows: Iterable[tuple[int, str, str]], settings: Settings) -> list[NewIdentity]:
    policy = IdentityPolicy.with_extra(settings.dedup_classpaths, _resolve_class)
    result = []
    for trigger_id, classpath, raw in rows:
        try:
            result.append(identity_of(trigger_id, classpath, raw, settings, policy))
        except Exception as err:
            # The message names the failure, never the kwargs (they may hold secrets).
            error = f"could not read the kwargs of trigger {trigger_id} ({classpath}): {type(err).__name__}"
            log.error("trigger kwargs unreadable", trigger_id=trigger_id, classpath=classpath,
                      error=type(err).__name__)
            fallback = identity_hash("$trigger", {"id": trigger_id})
            result.append(NewIdentity(trigger_id, fallback, shard_of(fallback, settings.shards), False, {},
                                      error=error))
    return result


