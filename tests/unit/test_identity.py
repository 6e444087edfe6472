from __future__ import annotations

import datetime as dt
import subprocess
import sys
from typing import Any

import pendulum
import pytest

from triggers.identity import (
    BUILTIN_DEDUP_CLASSPATHS,
    IDENTITY_KWARG,
    DedupableTrigger,
    IdentityError,
    IdentityPolicy,
    canonical_json,
    identity_hash,
    merge_values,
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
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout.strip()
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
    execution_merge = {"channel": "union"}

    def __init__(
        self, table: str, poll_interval: float = 5, channel: str | list[str] | None = None, mode: str = "a"
    ) -> None:
        self.table, self.poll_interval, self.channel, self.mode = table, poll_interval, channel, mode

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "x.Declared", {
            "table": self.table,
            "poll_interval": self.poll_interval,
            "channel": self.channel,
            "mode": self.mode,
        }


POLICY = IdentityPolicy.with_extra([])


def declared(**kwargs: Any) -> dict[str, Any]:
    return Declared(**kwargs).serialize()[1]


def test_serialized_kwargs_carry_the_identity_and_the_class_drops_it_again() -> None:
    kwargs = declared(table="t1", channel="loads")
    assert kwargs[IDENTITY_KWARG] == {"v": 1, "identity": ["table"], "merge": {"channel": "union"}}
    rebuilt = Declared(**kwargs)  # as Airflow's runner does: cls(**kwargs)
    assert rebuilt.table == "t1" and rebuilt.serialize()[1] == kwargs


def test_policy_uses_declared_identity_only() -> None:
    a = POLICY.identity("x.Declared", declared(table="t1", poll_interval=5), trigger_id=1)
    b = POLICY.identity("x.Declared", declared(table="t1", poll_interval=60, channel="c"), trigger_id=2)
    c = POLICY.identity("x.Declared", declared(table="t2", poll_interval=5), trigger_id=3)
    assert a == b and a.dedupable
    assert a != c
    assert dict(b.execution) == {"poll_interval": ("min", 60), "channel": ("union", "c")}


def test_undeclared_non_numeric_execution_kwargs_split_the_group() -> None:
    a = POLICY.identity("x.Declared", declared(table="t1", mode="a"), 1)
    b = POLICY.identity("x.Declared", declared(table="t1", mode="b"), 2)
    assert a.dedupable and b.dedupable and a != b


def test_identity_is_computed_without_importing_the_trigger_class() -> None:
    """The supervisor holds the metadata DB: it must never import DAG authors' trigger code."""
    kwargs = {"table": "t", "poll_interval": 3, IDENTITY_KWARG: {"v": 1, "identity": ["table"], "merge": {}}}
    identity = POLICY.identity("no_such_module.NeverImported", kwargs, 1)
    assert identity.dedupable
    assert "no_such_module" not in sys.modules


def test_policy_allow_list_makes_all_kwargs_identity() -> None:
    policy = IdentityPolicy.with_extra(["my.State"])
    assert policy.identity("my.State", {"a": 1}, 1) == policy.identity("my.State", {"a": 1}, 2)
    assert policy.identity("my.State", {"a": 1}, 1) != policy.identity("my.State", {"a": 2}, 2)
    assert "airflow.providers.standard.triggers.temporal.DateTimeTrigger" in BUILTIN_DEDUP_CLASSPATHS


def test_triggers_without_a_marker_run_alone() -> None:
    a = POLICY.identity("gone.Trigger", {"a": 1}, 1)
    b = POLICY.identity("gone.Trigger", {"a": 1}, 2)
    assert not a.dedupable and a != b


def test_declared_kwarg_missing_from_serialize_is_an_error() -> None:
    kwargs = {"poll_interval": 5, IDENTITY_KWARG: {"v": 1, "identity": ["table"], "merge": {}}}
    with pytest.raises(IdentityError, match="table"):
        POLICY.identity("x.Declared", kwargs, 1)
    with pytest.raises(IdentityError, match="malformed"):
        POLICY.identity("x.Declared", {IDENTITY_KWARG: {"identity": "table"}}, 1)


def test_merge_rules() -> None:
    assert merge_values("min", [30, 5.0, None]) == 5.0
    assert merge_values("max", [30, 5.0]) == 30
    assert merge_values("union", [None, "b", ["a", "b"]]) == ["a", "b"]
    assert merge_values("union", [None, None]) is None
    assert merge_values("any", [False, True]) is True
    # one member's value: what the general path gives for it (the one-value shortcut changes nothing)
    for value in (None, 0, 7, 2.5, "text", True, ["a"]):
        assert merge_values("min", [value]) == merge_values("min", [value, None]) == value
        assert merge_values("max", [value]) == merge_values("max", [None, value]) == value
    with pytest.raises(TypeError, match="unknown rule"):
        type("Bad", (DedupableTrigger,), {"identity_kwargs": ("a",), "execution_merge": {"b": "first"}})


def test_unrendered_templates_are_never_deduplicated() -> None:
    policy = IdentityPolicy.with_extra(["my.State"])
    kwargs = {"target_time": "{{ data_interval_end }}", "end_from_trigger": False}
    a, b = policy.identity("my.State", kwargs, 1), policy.identity("my.State", kwargs, 2)
    assert not a.dedupable and a != b
    assert policy.identity("my.State", {"nested": ["{% if x %}"]}, 3).dedupable is False


def test_allow_listed_constructor_variants_share_one_identity() -> None:
    from airflow.sdk import timezone

    classpath = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"
    moment = timezone.parse("2026-11-22T10:00:00+00:00")
    by_moment = POLICY.identity(classpath, {"moment": moment, "end_from_trigger": False}, 1)
    by_string = POLICY.identity(
        classpath, {"target_time": "2026-11-22T10:00:00+00:00", "end_from_trigger": False}, 2
    )
    assert by_moment == by_string and by_moment.dedupable


def test_shared_stream_triggers_are_placed_together_but_not_grouped() -> None:
    from dataset_bridge.status_table import TableStatusTrigger
    from smart_triggerer.config import Settings

    def watcher(table_name: str, status_table: str = "meta.status") -> dict[str, Any]:
        return TableStatusTrigger("wh", table_name, status_table=status_table).serialize()[1]

    classpath = "dataset_bridge.status_table.TableStatusTrigger"
    a = POLICY.identity(classpath, watcher("dds.a"), 1)
    b = POLICY.identity(classpath, watcher("dds.b"), 2)
    c = POLICY.identity(classpath, watcher("dds.a", "meta.other"), 3)
    assert a == b and not a.dedupable  # same shard, separate coroutines sharing one stream
    assert a.shard(Settings().shards) == b.shard(Settings().shards)
    assert a != c


def test_a_wait_is_described_in_plain_words_without_importing_its_class() -> None:
    from triggers.table_load import TableLoadTrigger

    trigger = TableLoadTrigger(
        conn_id="dwh",
        required_tables=["dds.h_user", "dds.s_user"],
        since="2026-11-23T00:00:00+00:00",
        poll_interval=30,
    )
    classpath, kwargs = trigger.serialize()
    found = POLICY.identity(classpath, serde_roundtrip(kwargs), trigger_id=1)
    assert found.description is not None
    assert found.description.startswith("dds.h_user + dds.s_user loaded since 2026-11-23")
    plain = POLICY.identity(
        classpath,
        {k: v for k, v in serde_roundtrip(kwargs).items() if k != IDENTITY_KWARG}
        | {IDENTITY_KWARG: {**kwargs[IDENTITY_KWARG], "describe": None}},
        trigger_id=1,
    )
    assert plain.hash == found.hash and plain.description is None  # words never change a group


def test_airflows_own_triggers_are_described_too() -> None:
    found = POLICY.identity(
        "airflow.providers.standard.triggers.temporal.DateTimeTrigger",
        {"moment": dt.datetime(2030, 1, 1, tzinfo=dt.UTC), "end_from_trigger": False},
        1,
    )
    assert found.description == "the time 2030-01-01T00:00:00+00:00"


def test_descriptions_show_identity_kwargs_only_and_urls_without_their_query() -> None:
    with pytest.raises(TypeError, match=r"shows \['password'\]: only identity kwargs"):
        type(
            "Leaky",
            (DedupableTrigger,),
            {"identity_kwargs": ("host",), "wait_description": "{host} as {password}"},
        )
    with pytest.raises(TypeError, match="only plain kwarg names"):
        type("Dotted", (DedupableTrigger,), {"identity_kwargs": ("host",), "wait_description": "{host.x}"})
    from triggers.describe import describe

    assert describe("GET {url!p}", {"url": "https://h/a/b?token=s3cret#x"}) == "GET https://h/a/b"
    assert len(describe("{t}", {"t": "x" * 1000}) or "") == 300


def test_a_stored_template_shows_only_what_its_marker_calls_identity() -> None:
    """The marker is data from the database: a template naming a non-identity kwarg shows nothing of it."""
    kwargs = {
        "host": "db1",
        "password": "s3cret",
        IDENTITY_KWARG: {"v": 1, "identity": ["host"], "merge": {}, "describe": "{host} as {password}"},
    }
    found = POLICY.identity("x.Forged", kwargs, trigger_id=1)
    assert found.description == "db1 as -"
    from triggers.describe import describe

    assert describe("{u!p}", {"u": "https://user:tok@h.example/a?k=v"}) == "https://h.example/a"
    assert describe("{u!p}", {"u": "https://user:p/ss@h.example/a"}) == "https://h.example/a"  # unescaped /
    assert (
        describe("{u!p}", {"u": ["https://a:b@h1/x?t=1", "https://h2/y#f"]}) == "https://h1/x + https://h2/y"
    )


SECRET_SQL = "SELECT count(*) > 0 FROM loads WHERE api_key = 'sk-live-0123456789'"


def test_a_sql_condition_is_described_by_its_connection_and_a_fingerprint_never_its_sql() -> None:
    """The SQL may hold a rendered secret: the description (stored, and served by the page) never shows it."""
    from triggers.sql_condition import SqlConditionTrigger

    trigger = SqlConditionTrigger("dwh", SECRET_SQL, failure_sql="SELECT 'sk-live-9876543210' IS NULL")
    found = POLICY.identity(*trigger.serialize(), trigger_id=1)
    assert found.description is not None
    assert "dwh" in found.description and "sk-live" not in found.description
    assert "SELECT" not in found.description
    other = SqlConditionTrigger("dwh", SECRET_SQL.replace("0123", "4567")).serialize()
    assert POLICY.identity(*other, trigger_id=2).description != found.description  # told apart


def test_markers_written_by_an_earlier_release_are_described_as_this_one_describes() -> None:
    """Tasks deferred before an upgrade carry the template of their release in their marker: one showed the
    SQL, one a dangling "since -"; both are read as this release's template."""
    from triggers.sql_condition import SqlConditionTrigger
    from triggers.table_load import TableLoadTrigger

    classpath, kwargs = SqlConditionTrigger("dwh", SECRET_SQL).serialize()
    kwargs[IDENTITY_KWARG] = {**kwargs[IDENTITY_KWARG], "describe": "a true answer from {conn_id}: {sql}"}
    described = POLICY.identity(classpath, kwargs, trigger_id=1).description
    assert described is not None and "sk-live" not in described
    assert described.startswith("a true answer from dwh")

    classpath, kwargs = TableLoadTrigger("dwh", ["dds.h_user"], status_table="meta.status").serialize()
    before = "{required_tables} loaded since {since} ({status_table} on {conn_id})"
    kwargs[IDENTITY_KWARG] = {**kwargs[IDENTITY_KWARG], "describe": before}
    described = POLICY.identity(classpath, kwargs, trigger_id=1).description
    assert described == "dds.h_user loaded (meta.status on dwh)"


def test_a_wait_without_since_has_no_dangling_dash() -> None:
    from triggers.external_dag import ExternalDagTrigger
    from triggers.table_load import TableLoadTrigger

    without = TableLoadTrigger("dwh", ["dds.h_user", "dds.s_user"], status_table="meta.status").serialize()
    assert POLICY.identity(*without, trigger_id=1).description == (
        "dds.h_user + dds.s_user loaded (meta.status on dwh)"
    )
    since = TableLoadTrigger(
        "dwh", ["dds.h_user"], status_table="meta.status", since="2026-11-23T00:00:00+00:00"
    ).serialize()
    assert POLICY.identity(*since, trigger_id=2).description == (
        "dds.h_user loaded since 2026-11-23T00:00:00+00:00 (meta.status on dwh)"
    )
    by_date = ExternalDagTrigger("etl", external_task_ids=["load"], logical_date="2026-11-23T00:00:00+00:00")
    described = POLICY.identity(*by_date.serialize(), trigger_id=3).description
    assert described is not None and " -" not in described and "2026-11-23" in described


def test_optional_parts_of_a_template_and_the_fingerprint_conversion() -> None:
    from triggers.describe import describe, template_names

    assert describe("{a}[ since {b}] ok", {"a": "x", "b": None}) == "x ok"
    assert describe("{a}[ since {b}] ok", {"a": "x", "b": "y"}) == "x since y ok"
    assert describe("{a}[ of {b}]", {"a": "x", "b": []}) == "x"
    assert template_names("{a}[ since {b!h}]") == {"a", "b"}
    fingerprint = describe("{s!h}", {"s": "SELECT 1"})
    assert fingerprint is not None and "SELECT" not in fingerprint
    assert fingerprint == describe("{s!h}", {"s": "SELECT 1"}) != describe("{s!h}", {"s": "SELECT 2"})


def test_each_replaced_template_is_what_its_trigger_shows_today() -> None:
    from triggers.describe import REPLACED_TEMPLATES
    from triggers.external_dag import ExternalDagTrigger
    from triggers.sql_condition import SqlConditionTrigger
    from triggers.table_load import TableLoadTrigger

    current = {t.wait_description for t in (SqlConditionTrigger, TableLoadTrigger, ExternalDagTrigger)}
    assert set(REPLACED_TEMPLATES.values()) == current
    assert not set(REPLACED_TEMPLATES) & current


class Timed(DedupableTrigger):
    identity_kwargs = ("table", "since")
    wait_description = "{table} loaded[ since {since}]"

    def __init__(self, table: str, since: dt.datetime, poll_interval: float = 5) -> None:
        self.table, self.since, self.poll_interval = table, since, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "x.Timed", {"table": self.table, "since": self.since, "poll_interval": self.poll_interval}


def test_the_identity_the_triggerer_stores_is_the_kwargs_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor hashes rows as Airflow stores them (encrypted, serde-encoded; the marker left as the
    plain JSON it is): the same identity and description as the kwargs themselves, datetimes included."""
    from airflow.models.crypto import get_fernet
    from airflow.models.trigger import Trigger
    from cryptography.fernet import Fernet

    from smart_triggerer.config import Settings
    from smart_triggerer.supervisor.identities import compute_identities

    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", Fernet.generate_key().decode())
    get_fernet.cache_clear()
    classpath, kwargs = Timed("t1", dt.datetime(2026, 11, 22, 10, 0, tzinfo=dt.UTC)).serialize()
    expected = POLICY.identity(classpath, kwargs, trigger_id=7)
    try:
        stored = compute_identities([(7, classpath, Trigger.encrypt_kwargs(kwargs))], Settings(shards=64))[0]
    finally:
        get_fernet.cache_clear()
    assert stored.error is None and stored.dedupable and expected.dedupable
    assert stored.identity_hash == expected.hash and stored.shard == shard_of(expected.hash, 64)
    assert stored.description == expected.description == "t1 loaded since 2026-11-22T10:00:00+00:00"
