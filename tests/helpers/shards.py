"""Keys whose trigger identities fall on chosen shards: a test that needs waits on every shard (or equal
shards) finds them by trying k0, k1, ... rather than hoping random keys spread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triggers.identity import IdentityPolicy, shard_of


def keys_per_shard(trigger_for: Callable[[str], Any], shards: int, per_shard: int = 1) -> list[str]:
    """``per_shard`` keys on each of ``shards`` shards, in shard order, for the trigger ``trigger_for(key)``
    builds, its identity computed as the triggerer computes it from the serialized kwargs."""
    policy = IdentityPolicy.with_extra(())
    found: dict[int, list[str]] = {shard: [] for shard in range(shards)}
    for n in range(max(10_000, 100 * per_shard * shards)):
        classpath, kwargs = trigger_for(f"k{n}").serialize()
        keys = found[shard_of(policy.identity(classpath, kwargs, 0).hash, shards)]
        if len(keys) < per_shard:
            keys.append(f"k{n}")
        if sum(len(k) for k in found.values()) == per_shard * shards:
            return [key for shard in range(shards) for key in found[shard]]
    raise AssertionError(f"no {per_shard} keys found for some shard")
