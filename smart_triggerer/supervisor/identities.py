"""Turning new trigger rows into stored identities: decrypt once, hash, place on a shard.

Identities are computed from the kwargs as data (see ``triggers.identity.IdentityPolicy``): this process
holds the metadata database and never imports trigger classes, which may be DAG authors' code. Stock
Airflow, too, runs trigger code only in the runner subprocess.

A row whose kwargs cannot be read gets an identity with an error (never the kwargs themselves in it: they
may hold secrets); the supervisor then fails that row's tasks alone with the cause.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import structlog

from smart_triggerer.config import Settings
from smart_triggerer.db.store import NewIdentity
from smart_triggerer.runner.kwargs import decode_kwargs, decrypt_kwargs
from triggers.identity import IDENTITY_KWARG, IdentityPolicy, identity_hash, shard_of

log = structlog.get_logger(logger_name=__name__)


def group_key(trigger_id: int, identity: int, dedupable: bool) -> int:
    """Dedupable rows group by identity; any other row is a group of its own."""
    return identity if dedupable else identity_hash("$trigger", {"id": trigger_id})


def _decrypt(raw: str) -> dict[str, Any]:
    # the identity marker is plain JSON our own serialize() wrote: nothing in it to decode
    return decode_kwargs(decrypt_kwargs(raw), as_is=IDENTITY_KWARG)


def identity_of(
    trigger_id: int,
    classpath: str,
    raw: str,
    settings: Settings,
    policy: IdentityPolicy,
    *,
    team: str | None = None,
) -> NewIdentity:
    identity = policy.identity(classpath, _decrypt(raw), trigger_id)
    execution = {k: [rule, value] for k, (rule, value) in identity.execution.items()}
    hashed = team_identity(identity.hash, team)
    return NewIdentity(
        trigger_id,
        hashed,
        shard_of(hashed, settings.shards),
        identity.dedupable,
        execution if identity.dedupable else {},
        description=identity.description,
    )


def team_identity(identity: int, team: str | None) -> int:
    """A team's wait is its own (Airflow 3.3 multi-team): identical waits of two teams never share a
    coroutine, a poll or a workload. Rows of no team keep the identity they always had."""
    return identity if team is None else identity_hash("$team", {"team": team, "identity": identity})


def compute_identities(rows: Iterable[tuple[Any, ...]], settings: Settings) -> list[NewIdentity]:
    """Rows of (trigger id, classpath, encrypted kwargs[, team name])."""
    policy = IdentityPolicy.with_extra(settings.dedup_classpaths)
    result = []
    for trigger_id, classpath, raw, *team in rows:
        try:
            team_name = team[0] if team else None
            result.append(identity_of(trigger_id, classpath, raw, settings, policy, team=team_name))
        except Exception as err:
            # The message names the failure, never the kwargs (they may hold secrets).
            error = f"could not read the kwargs of trigger {trigger_id} ({classpath}): {type(err).__name__}"
            log.error(
                "trigger kwargs unreadable",
                trigger_id=trigger_id,
                classpath=classpath,
                error=type(err).__name__,
            )
            fallback = identity_hash("$trigger", {"id": trigger_id})
            result.append(
                NewIdentity(trigger_id, fallback, shard_of(fallback, settings.shards), False, {}, error=error)
            )
    return result
