"""What a trigger waits on, in plain words, from its kwargs as data (for the Smart Triggerer page).

Our triggers name their description with ``wait_description``, a format string over their identity kwargs
(see :class:`triggers.identity.DedupableTrigger`), carried in the identity marker so the triggerer formats it
without importing trigger code. Airflow's own deduplicated triggers get one here. Only the kwargs a
template names are shown, never the others (they may hold secrets), and only plain names: ``{a.b}`` and
``{a[0]}`` are refused. Conversion ``!p`` drops a URL's query, fragment and credentials; ``!h`` shows a
fingerprint of a value instead of the value (a statement that may hold a rendered secret). A part in
square brackets is left out when a kwarg it shows has no value: ``loaded[ since {since}]``. A format spec
(``{a:>5}``) is ignored, and square brackets inside a field are not allowed (the template describes
nothing).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

MAX_LENGTH = 300

BUILTIN_DESCRIPTIONS: dict[str, str] = {
    "airflow.providers.standard.triggers.temporal.DateTimeTrigger": "the time {moment}",
    "airflow.providers.standard.triggers.file.FileTrigger": "a file matching {filepath}",
    "airflow.providers.standard.triggers.external_task.WorkflowTrigger": (
        "DAG {external_dag_id}, tasks {external_task_ids}"
    ),
    "airflow.providers.standard.triggers.external_task.DagStateTrigger": "DAG {dag_id} runs in {states}",
}


# Templates our triggers carried in earlier releases: the markers of tasks deferred before an upgrade still
# hold them, and each is read as the template that replaced it (the first showed a SQL statement, which may
# hold a rendered secret; the others a dangling "-" for a kwarg without a value).
REPLACED_TEMPLATES: dict[str, str] = {
    "a true answer from {conn_id}: {sql}": "a true answer from {conn_id} to query {sql!h}",
    "{required_tables} loaded since {since} ({status_table} on {conn_id})": (
        "{required_tables} loaded[ since {since}] ({status_table} on {conn_id})"
    ),
    "DAG {external_dag_id} run {run_id}, tasks {external_task_ids} in {allowed_states}": (
        "DAG {external_dag_id}[ run {run_id}][ of {logical_date}], "
        "tasks {external_task_ids} in {allowed_states}"
    ),
}
CONVERSIONS = (None, "p", "h")
_OPTIONAL = re.compile(r"\[([^\[\]]*)\]")


class DescriptionError(ValueError):
    """A description template names something other than plain kwargs, or is malformed."""


def template_names(template: str) -> set[str]:
    """The kwargs a template shows; raises :class:`DescriptionError` for anything but plain names."""
    return set(_template_names(template))


@functools.lru_cache(maxsize=256)
def _template_names(template: str) -> frozenset[str]:
    """Parsed once per template: a start hashes tens of thousands of rows of a few templates."""
    names = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise DescriptionError(f"malformed description template: {err}") from err
    for _literal, name, _spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise DescriptionError(f"description template field {name!r}: only plain kwarg names")
        if conversion not in CONVERSIONS:
            raise DescriptionError(f"description template field {name!r}: only the conversions !p and !h")
        names.add(name)
    return frozenset(names)


def _converted(value: Any, conversion: str | None) -> Any:
    if conversion == "h":
        return fingerprint(value)
    if conversion == "p":
        if isinstance(value, str):
            return _without_secrets(value)
        if isinstance(value, Sequence) and not isinstance(value, bytes):
            return [_without_secrets(v) if isinstance(v, str) else v for v in value]
    return value


def fingerprint(value: Any) -> str | None:
    """``#`` and 8 hex digits of the value's SHA-256: tells two values apart without showing either."""
    if value is None:
        return None
    encoded = json.dumps(value, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8")
    return "#" + hashlib.sha256(encoded).hexdigest()[:8]


def _without_secrets(url: str) -> str:
    """A URL or path without its query, fragment and user:password@ (where tokens tend to live). Anything
    up to the last "@" after the scheme goes, even in a path: a password with an unescaped "/" must not
    survive, and a path losing an "@" only reads worse."""
    base = url.split("?", 1)[0].split("#", 1)[0]
    scheme, sep, rest = base.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else base


def _plain(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return " + ".join(_plain(v) for v in value)
    return str(value)


# a template, parsed: its parts in order, each with the kwargs whose lack leaves it out (None: always shown)
# and its pieces (literal text, then a kwarg and its conversion, or None at the end)
Piece = tuple[str, str | None, str | None]
Compiled = tuple[tuple[frozenset[str] | None, tuple[Piece, ...]], ...]


def describe(template: str | None, kwargs: Mapping[str, Any]) -> str | None:
    """The template filled in with the kwargs, at most ``MAX_LENGTH`` characters; None when it cannot be."""
    if not template:
        return None
    try:
        parts = _compiled(template)
    except (DescriptionError, ValueError):
        return None
    try:
        text = "".join(_rendered(parts, kwargs))
    except (ValueError, TypeError):  # a value that cannot be shown (a kwarg's own __str__ failing)
        return None
    return text if len(text) <= MAX_LENGTH else text[: MAX_LENGTH - 1] + "…"


def _rendered(parts: Compiled, kwargs: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for needed, pieces in parts:
        if needed and any(_empty(kwargs.get(name)) for name in needed):
            continue  # a bracketed part that shows a kwarg without a value
        for literal, name, conversion in pieces:
            out.append(literal)
            if name is not None:
                out.append(_plain(_converted(kwargs.get(name), conversion)))
    return out


@functools.lru_cache(maxsize=256)
def _compiled(template: str) -> Compiled:
    """Parsed once per template (a start describes tens of thousands of rows of a few templates): the
    parts outside square brackets always shown, each bracketed part (brackets dropped) only when every
    kwarg it shows has a value. A format spec is ignored: values are shown as ``_plain`` makes them."""
    template_names(template)  # only plain names and known conversions, or DescriptionError
    parts: list[tuple[frozenset[str] | None, str]] = []
    shown = 0
    for match in _OPTIONAL.finditer(template):
        parts.append((None, template[shown : match.start()]))
        parts.append((_template_names(match.group(1)), match.group(1)))
        shown = match.end()
    parts.append((None, template[shown:]))
    return tuple((needed, _pieces(text)) for needed, text in parts if text)


def _pieces(text: str) -> tuple[Piece, ...]:
    return tuple(
        (literal, name, conversion) for literal, name, _spec, conversion in string.Formatter().parse(text)
    )


def _empty(value: Any) -> bool:
    return value is None or (
        isinstance(value, str | Sequence | Mapping) and not isinstance(value, bytes) and len(value) == 0
    )
