"""``decode_kwargs`` (smart_triggerer/runner/kwargs.py) gives what Airflow's runner gives, calling Airflow's
decoder only for values it can change; ``decrypt_kwargs`` gives what Airflow's ``_decrypt_kwargs`` gives,
without passing our identity marker through Airflow's deserializer."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from airflow.models.trigger import Trigger
from airflow.serialization.decoders import smart_decode_trigger_kwargs

from bench.triggers import PollTrigger
from smart_triggerer.runner.kwargs import decode_kwargs, decrypt_kwargs
from triggers.http import HttpConditionTrigger
from triggers.identity import IDENTITY_KWARG


def _base_serialized(value: Any) -> Any:
    """A value as Airflow's older serializer wrote it (``{"__type": ..., "__var": ...}``): what the
    decoder is for."""
    from airflow.serialization.serialized_objects import BaseSerialization

    return BaseSerialization.serialize(value)


KWARGS: list[dict[str, Any]] = [
    {
        "url": "http://example",
        "key": "k1",
        "poll_interval": 30.0,
        "attempts": 3,
        "verify": True,
        "none": None,
    },
    {"moment": dt.datetime(2026, 11, 27, 10, 0, tzinfo=dt.UTC), "wait": dt.timedelta(minutes=5)},
    {
        "old": _base_serialized(dt.timedelta(seconds=7)),
        "olds": [_base_serialized(dt.timedelta(seconds=1))],
        "deep": {"x": _base_serialized(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))},
    },
    {"statuses": [200, 204], "nested": {"a": [1, {"b": dt.timedelta(seconds=2)}], "c": "d"}},
    {"pair": (1, "two"), "names": {"x", "y"}, "listed": ["x", "y"], "empty": {}, "none": []},
]


@pytest.mark.parametrize("kwargs", KWARGS)
def test_the_decoded_kwargs_are_airflows(kwargs: dict[str, Any]) -> None:
    stored = Trigger._decrypt_kwargs(Trigger.encrypt_kwargs(kwargs))  # as Airflow stores and reads them
    airflows = {k: smart_decode_trigger_kwargs(v) for k, v in stored.items()}  # its runner's decoding
    assert decode_kwargs(stored) == airflows


def test_a_kwarg_kept_as_is_is_not_decoded() -> None:
    kwargs = {"marker": _base_serialized(dt.timedelta(seconds=1))}
    stored = Trigger._decrypt_kwargs(Trigger.encrypt_kwargs(kwargs))
    assert decode_kwargs(stored, as_is="marker") == stored
    assert decode_kwargs(stored) == {"marker": dt.timedelta(seconds=1)}  # decoded otherwise


def _ours() -> list[dict[str, Any]]:
    """Kwargs as our triggers serialize them: with the identity marker (a dict, lists in it)."""
    http = HttpConditionTrigger(
        http_conn_id="api", endpoint="/status", json_path="state", expected_value="done", poll_interval=30.0
    )
    return [PollTrigger("http://127.0.0.1:1", "k1", 30.0).serialize()[1], http.serialize()[1]]


@pytest.mark.parametrize("kwargs", [*KWARGS, *_ours()])
def test_the_decrypted_kwargs_are_airflows(kwargs: dict[str, Any]) -> None:
    encrypted = Trigger.encrypt_kwargs(kwargs)
    assert decrypt_kwargs(encrypted) == Trigger._decrypt_kwargs(encrypted)


def test_our_kwargs_carry_the_marker_through_decrypting() -> None:
    kwargs = _ours()[0]
    assert isinstance(kwargs[IDENTITY_KWARG], dict)  # what makes it worth leaving out of the deserializer
    assert decrypt_kwargs(Trigger.encrypt_kwargs(kwargs))[IDENTITY_KWARG] == kwargs[IDENTITY_KWARG]


def test_a_marker_another_serializer_encoded_is_read_airflows_way() -> None:
    """An asset watcher's trigger row is made from the serialized DAG: its marker arrives encoded by
    Airflow's older serializer inside kwargs of the newer one. Left out of the deserializer, it stayed
    encoded and the identity could not be read (the chaos run's watchers failed as "kwargs unreadable")."""
    from airflow.serialization.serialized_objects import BaseSerialization

    from smart_triggerer.supervisor.identities import _decrypt

    marker = {"v": 1, "shared_stream": ["conn_id", "table"], "describe": "{table} rows"}
    encoded = BaseSerialization.serialize(marker)
    encrypted = Trigger.encrypt_kwargs({"conn_id": "db", "table": "etl_status", IDENTITY_KWARG: encoded})
    assert decrypt_kwargs(encrypted) == Trigger._decrypt_kwargs(encrypted)
    assert decrypt_kwargs(encrypted)[IDENTITY_KWARG] == marker
    assert _decrypt(encrypted)[IDENTITY_KWARG] == marker  # what the supervisor hashes
    nested = {"v": 1, "identity": ["key"], "merge": BaseSerialization.serialize({"poll_interval": "min"})}
    encrypted = Trigger.encrypt_kwargs({"key": "k", IDENTITY_KWARG: nested})  # a tag deeper inside
    assert decrypt_kwargs(encrypted) == Trigger._decrypt_kwargs(encrypted)
    assert decrypt_kwargs(encrypted)[IDENTITY_KWARG]["merge"] == {"poll_interval": "min"}


def test_kwargs_without_a_marker_are_read_as_airflow_reads_them() -> None:
    kwargs = {"key": "k", "poll_interval": 5.0}
    encrypted = Trigger.encrypt_kwargs(kwargs)
    assert decrypt_kwargs(encrypted) == Trigger._decrypt_kwargs(encrypted) == kwargs


def test_unencrypted_and_older_format_rows_are_read_as_airflow_reads_them() -> None:
    import json

    from airflow.serialization.serialized_objects import BaseSerialization

    marker = _ours()[0][IDENTITY_KWARG]
    plain = json.dumps({"key": "k1", IDENTITY_KWARG: marker})  # a row some migration left unencrypted
    assert decrypt_kwargs(plain) == Trigger._decrypt_kwargs(plain)
    # Airflow 2's format: the new deserializer refuses it, and both fall back to the older one
    older = json.dumps(BaseSerialization.serialize({"wait": dt.timedelta(seconds=3), IDENTITY_KWARG: marker}))
    assert (
        decrypt_kwargs(older)
        == Trigger._decrypt_kwargs(older)
        == {"wait": dt.timedelta(seconds=3), IDENTITY_KWARG: marker}
    )
