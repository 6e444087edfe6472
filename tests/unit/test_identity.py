from __future__ import annotations

import datetime as dt
import subprocess
import sys
from typing import Any

import pendulum
import pytest

from triggers.identity import (
    BUILTIN_DEDUP_CLASSPATHS,
    DedupableTrigger,
    IdentityError,
    IdentityPolicy,
    canonical_json,
    identity_hash,
    merge_most_demanding,
    shard_of,
)

CP = "triggers.example.Trigger"


def serde_roundtrip(value: Any) -> Any:
    """What the triggerer sees: kwargs serialised by the worker, deserialised by Airflow's serde."""
    from airflow.sdk.serde import deserialize, serialize

    return deserialize(serialize(value))


def test_key_order_does_not_matter() -> None:
    a = {"table": "dds.h_user", "nested": {"x": 1, "y": [1, 2]}}
    b = {"nested": {"y": [1, 2], "x": 1}, "table": "dds.h_user"}
    assert identity_hash(CP, a) == identity_hash(CP, b)


def test_canonical_encoding_is_compact_sorted_json() -> None:
    assert canonical_json({"b": 1, "a": [True, None]}) == '{"a":[true,null],"b":1}'


def test_nested_values_differ() -> None:
    assert identity_hash(CP, {"n": {"x": [1, 2]}}) != identity_hash(CP, {"n": {"x": [2, 1]}})


def test_unicode_is_encoded_stably() -> None:
    assert identity_hash(CP, {"t": "zürich_ü"}) == identity_hash(CP, {"t": "zürich_ü"})
    assert identity_hash(CP, {"t": "zürich_ü"}) != identity_hash(CP, {"t": "zurich_u"})


def test_ints_and_floats_differ() -> None:
    assert identity_hash(CP, {"v": 1}) != identity_hash(CP, {"v": 1.0})
    assert identity_hash(CP, {"v": True}) != identity_hash(CP, {"v": 1})


def test_classpath_is_part_of_identity() -> None:
    assert identity_hash(CP, {"v": 1}) != identity_hash(CP + "2", {"v": 1})


def test_datetimes_through_airflow_serde() -> None:
    moment = dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)
    same_instant = pendulum.datetime(2026, 11, 22, 12, 0, tz="Europe/Berlin")  # UTC+1 in November
    assert same_instant == dt.datetime(2026, 11, 22, 11, 0, tzinfo=dt.UTC)
    a = serde_roundtrip({"moment": moment + dt.timedelta(hours=1)})
    b = serde_roundtrip({"moment": same_instant})
    assert identity_hash(CP, a) == identity_hash(CP, b)
    c = serde_roundtrip({"moment": moment})
    assert identity_hash(CP, a) != identity_hash(CP, c)


def test_timedeltas_and_sets() -> None:
    minute = identity_hash(CP, {"d": dt.timedelta(minutes=1)})
    assert identity_hash(CP, {"d": dt.timedelta(seconds=60)}) == minute
    assert identity_hash(CP, {"s": {"b", "a"}}) == identity_hash(CP, {"s": {"a", "b"}})
    assert identity_hash(CP, {"s": {"a"}}) != identity_hash(CP, {"s": ["a"]})


def test_unencodable_values_are_refused() -> None:
    with pytest.raises(IdentityError, match="object"):
        identity_hash(CP, {"x": object()})


def test_hash_is_stable_across_processes_and_releases() -> None:
    code = "from triggers.identity import identity_hash; print(identity_hash('a.B', {'t': 'x', 'n': 1}))"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    # A fixed value: changing the encoding would split every running group on upgrade.
    assert outputs == {str(identity_hash("a.B", {"t": "x", "n": 1}))}
    # = int.from_bytes(sha256(b'["a.B",{"n":1,"t":"x"}]').digest()[:8], "big", signed=True)
    assert identity_hash("a.B", {"t": "x", "n": 1}) == 2606899180392140371


def test_hash_is_signed_64_bit_and_shards_are_non_negative() -> None:
    hashes = [identity_hash(CP, {"i": i}) for i in range(2000)]
    assert all(-(2**63) <= h < 2**63 for h in hashes)
    assert any(h < 0 for h in hashes)
    assert {shard_of(h, 16) for h in hashes} == set(range(16))


class Declared(DedupableTrigger):
    identity_kwargs = ("table",)


def test_policy_uses_declared_identity_only() -> None:
    policy = IdentityPolicy.with_extra([], resolve_class=lambda cp: Declared)
    a = policy.identity("x.Declared", {"table": "t1", "poll_interval": 5}, trigger_id=1)
    b = policy.identity("x.Declared", {"table": "t1", "poll_interval": 60}, trigger_id=2)
    c = policy.identity("x.Declared", {"table": "t2", "poll_interval": 5}, trigger_id=3)
    assert a == b and a.dedupable
    assert a != c


def test_policy_allow_list_makes_all_kwargs_identity() -> None:
    policy = IdentityPolicy.with_extra(["my.State"], resolve_class=lambda cp: object)
    assert policy.identity("my.State", {"a": 1}, 1) == policy.identity("my.State", {"a": 1}, 2)
    assert policy.identity("my.State", {"a": 1}, 1) != policy.identity("my.State", {"a": 2}, 2)
    assert "airflow.providers.standard.triggers.temporal.DateTimeTrigger" in BUILTIN_DEDUP_CLASSPATHS


def test_undeclared_or_unimportable_triggers_run_alone() -> None:
    def fail(cp: str) -> type:
        raise ImportError(cp)

    policy = IdentityPolicy.with_extra([], resolve_class=fail)
    a = policy.identity("gone.Trigger", {"a": 1}, 1)
    b = policy.identity("gone.Trigger", {"a": 1}, 2)
    assert not a.dedupable and a != b
    undeclared = IdentityPolicy.with_extra([], resolve_class=lambda cp: object)
    assert not undeclared.identity("x.Queue", {"a": 1}, 1).dedupable


def test_declared_kwarg_missing_from_serialize_is_an_error() -> None:
    policy = IdentityPolicy.with_extra([], resolve_class=lambda cp: Declared)
    with pytest.raises(IdentityError, match="table"):
        policy.identity("x.Declared", {"poll_interval": 5}, 1)


def test_merge_picks_most_demanding_settings() -> None:
    merged = merge_most_demanding([{"poll_interval": 30, "mode": "a"}, {"poll_interval": 5.0, "mode": "b"}])
    assert merged == {"poll_interval": 5.0, "mode": "a"}


def test_unrendered_templates_are_never_deduplicated() -> None:
    policy = IdentityPolicy.with_extra(["my.State"], resolve_class=lambda cp: object)
    kwargs = {"target_time": "{{ data_interval_end }}", "end_from_trigger": False}
    a, b = policy.identity("my.State", kwargs, 1), policy.identity("my.State", kwargs, 2)
    assert not a.dedupable and a != b
    assert policy.identity("my.State", {"nested": ["{% if x %}"]}, 3).dedupable is False


def test_allow_listed_constructor_variants_share_one_identity() -> None:
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger
    from airflow.sdk import timezone

    classpath = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
    policy = IdentityPolicy.with_extra([], resolve_class=lambda cp: DateTimeTrigger)
    moment = timezone.parse("2026-11-22T10:00:00+00:00")
    by_moment = policy.identity(classpath, {"moment": moment, "end_from_trigger": False}, 1)
    by_string = policy.identity(classpath, {"target_time": "2026-11-22T10:00:00+00:00",
                                            "end_from_trigger": False}, 2)
    assert by_moment == by_string and by_moment.dedupable


def test_shared_stream_triggers_are_placed_together_but_not_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    from collections.abc import AsyncIterator, Hashable

    from airflow.triggers.base import BaseEventTrigger, TriggerEvent

    from triggerer.config import Settings
    from triggerer.identities import _shared_stream_identity

    class Watcher(BaseEventTrigger):
        def __init__(self, table: str, asset: str) -> None:
            super().__init__()
            self.table, self.asset = table, asset

        def serialize(self) -> tuple[str, dict[str, Any]]:
            return ("x.Watcher", {"table": self.table, "asset": self.asset})

        def shared_stream_key(self) -> Hashable:
            return ("status-table", self.table)

        async def run(self) -> AsyncIterator[TriggerEvent]:
            yield TriggerEvent({})

    from triggerer import identities

    monkeypatch.setattr(identities, "_resolve_class", lambda cp: Watcher)
    a = _shared_stream_identity("x.Watcher", {"table": "meta.status", "asset": "a"}, 1)
    b = _shared_stream_identity("x.Watcher", {"table": "meta.status", "asset": "b"}, 2)
    c = _shared_stream_identity("x.Watcher", {"table": "meta.other", "asset": "a"}, 3)
    assert a is not None and b is not None and c is not None
    assert a == b and not a.dedupable  # same shard, separate coroutines sharing one stream
    assert a.shard(Settings().shards) == b.shard(Settings().shards)
    assert a != c
