"""``decode_kwargs`` (triggerer/identities.py) gives what Airflow's runner gives, calling Airflow's
decoder only for values it can change."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from airflow.models.trigger import Trigger
from airflow.serialization.decoders import smart_decode_trigger_kwargs

from triggerer.identities import decode_kwargs


def _base_serialized(value: Any) -> Any:
    """A value as Airflow's older serializer wrote it (``{"__type": ..., "__var": ...}``): what the
    decoder is for."""
    from airflow.serialization.serialized_objects import BaseSerialization

    return BaseSerialization.serialize(value)


KWARGS: list[dict[str, Any]] = [
    {"url": "http://example", "key": "k1", "poll_interval": 30.0, "attempts": 3, "verify": True,
     "none": None},
    {"moment": dt.datetime(2026, 11, 27, 10, 0, tzinfo=dt.UTC), "wait": dt.timedelta(minutes=5)},
    {"old": _base_serialized(dt.timedelta(seconds=7)), "olds": [_base_serialized(dt.timedelta(seconds=1))],
     "deep": {"x": _base_serialized(dt.datetime(2026, 1, 1, tzinfo=dt.UTC))}},
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
