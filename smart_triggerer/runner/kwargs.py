"""Reading a trigger row's kwargs as Airflow's runner does, only faster where nothing changes: the runner
reads them for each new coroutine, the supervisor for each row it hashes into an identity."""

from __future__ import annotations

import json
from typing import Any, cast

from triggers.identity import IDENTITY_KWARG


def decode_kwargs(kwargs: dict[str, Any], *, as_is: str | None = None) -> dict[str, Any]:
    """Airflow's ``smart_decode_trigger_kwargs`` over each value (as its runner does), called only where it
    can change something: it gives any value but a dict or a list back as it is, yet costs an import on
    every call, and most kwargs are strings and numbers (docs/design.md, Measurements behind the code).
    ``as_is``: a kwarg left undecoded."""
    from airflow.serialization.decoders import smart_decode_trigger_kwargs

    return {
        k: smart_decode_trigger_kwargs(v) if isinstance(v, (dict, list)) and k != as_is else v
        for k, v in kwargs.items()
    }


_ABSENT: Any = object()


def decrypt_kwargs(encrypted: str) -> dict[str, Any]:
    """Airflow's ``Trigger._decrypt_kwargs`` (the same steps, the same fallback), except that the identity
    marker, when it is plain JSON as our own ``serialize()`` wrote it (``identity_marker``: strings,
    numbers, lists and dicts of them), is not passed through Airflow's deserializer, which would give it
    back as it is: it is the biggest kwarg of most of our triggers (decrypting and decoding kwargs is paid
    for each new coroutine, and a start hashes tens of thousands of rows; docs/design.md, Measurements
    behind the code). The marker comes back as the last key (our ``serialize()`` writes it last; no reader
    depends on order)."""
    from airflow.models.crypto import get_fernet
    from airflow.sdk.serde import deserialize

    if encrypted.startswith("{"):  # as Airflow: rows some migration paths left unencrypted
        decrypted = json.loads(encrypted)
    else:
        decrypted = json.loads(get_fernet().decrypt(encrypted.encode("utf-8")).decode("utf-8"))
    marker = _ABSENT
    if isinstance(decrypted, dict) and IDENTITY_KWARG in decrypted and _plain(decrypted[IDENTITY_KWARG]):
        marker = decrypted.pop(IDENTITY_KWARG)
    try:
        result = cast("dict[str, Any]", deserialize(decrypted))
    except (ImportError, KeyError, AttributeError, TypeError):
        # Airflow's fallback for kwargs stored in the older format, over the whole of them
        from airflow.serialization.serialized_objects import BaseSerialization

        if marker is not _ABSENT:
            decrypted[IDENTITY_KWARG] = marker
        return cast("dict[str, Any]", BaseSerialization.deserialize(decrypted))
    if marker is not _ABSENT:
        result[IDENTITY_KWARG] = marker
    return result


_SCALARS = (str, int, float, bool)


def _plain(value: Any) -> bool:
    """JSON as our ``identity_marker`` writes it: strings, numbers, lists and dicts of them, no key an
    encoding's tag (every one of Airflow's starts with ``__``). A marker that went through another
    serializer (an asset watcher's trigger, built from the serialized DAG, carries it encoded by Airflow's
    older one) is not plain and is read Airflow's way. A tuple of types and a plain loop over a dict, not a
    union type and generators, which cost more (once per new coroutine in the runner, once per hashed row
    in the supervisor; docs/design.md, Measurements behind the code)."""
    if value is None or isinstance(value, _SCALARS):
        return True
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or key.startswith("__") or not _plain(item):
                return False
        return True
    return False
