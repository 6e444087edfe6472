"""Weighted rendezvous (highest random weight) hashing of virtual shards onto live instances.

Each instance scores every shard with ``-weight / ln(u)``, ``u`` a stable uniform draw from
SHA-256(shard, instance); the highest score owns the shard. Adding or removing an instance moves only the
shards it wins or held (~1/N of them), and every instance computes the same map from the same member list,
so identical waits (one identity hash, one shard) always meet in one instance.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """A live instance: its Airflow job id and declared capacity (the weight)."""

    job_id: int
    capacity: int


def _uniform(shard: int, job_id: int) -> float:
    digest = hashlib.sha256(f"{shard}:{job_id}".encode()).digest()
    # 53 bits -> a float strictly inside (0, 1)
    return (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53) + 1e-18


def score(shard: int, member: Member) -> float:
    return -max(member.capacity, 1) / math.log(_uniform(shard, member.job_id))


def owner(shard: int, members: Iterable[Member]) -> int | None:
    best: tuple[float, int] | None = None
    for member in members:
        candidate = (score(shard, member), -member.job_id)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else -best[1]


def assign(shards: int, members: Iterable[Member]) -> dict[int, int]:
    """shard -> owning job id, for every shard (empty when there is no live member)."""
    live = list(members)
    if not live:
        return {}
    result: dict[int, int] = {}
    for shard in range(shards):
        job_id = owner(shard, live)
        assert job_id is not None
        result[shard] = job_id
    return result


def shards_of(job_id: int, assignment: Mapping[int, int]) -> set[int]:
    return {shard for shard, owner_id in assignment.items() if owner_id == job_id}
