"""What a trigger waits on, in plain words, from its kwargs as data (for the Smart Triggerer page).

Our triggers name their description with ``wait_description``, a format string over their identity kwargs
(see :class:`triggers.identity.DedupableTrigger`), carried in the identity marker so the triggerer formats it
without importing trigger code. Airflow's own deduplicated triggers get one here. Only the kwargs a
template names are shown, never the others (they may hold secrets), and only plain names: ``{a.b}`` and
``{a[0]}`` are refused. Conversion ``!p`` drops a URL's query, fragment and credentials.
"""

from __future__ import annotations

import datetime as dt
import string
from collections.abc import Mapping, Sequence
from typing import Any

MAX_LENGTH = 300

BUILTIN_DESCRIPTIONS: dict[str, str] = {
    "airflow.providers.standard.triggers.temporal.DateTimeTrigger": "the time {moment}",
    "airflow.providers.standard.triggers.file.FileTrigger": "a file matching {filepath}",
    "airflow.providers.standard.triggers.external_task.WorkflowTrigger":
        "DAG {external_dag_id}, tasks {external_task_ids}",
    "airflow.providers.standard.triggers.external_task.DagStateTrigger": "DAG {dag_id} runs in {states}",
}


class DescriptionError(ValueError):
    """A description template names something other than plain kwargs, or is malformed."""


def template_names(template: str) -> set[str]:
    """The kwargs a template shows; raises :class:`DescriptionError` for anything but plain names."""
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
        if conversion not in (None, "p"):
            raise DescriptionError(f"description template field {name!r}: only the conversion !p")
        names.add(name)
    return names


class _Formatter(string.Formatter):
    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion == "p":
            if isinstance(value, str):
                return _without_secrets(value)
            if isinstance(value, Sequence) and not isinstance(value, bytes):
                return [_without_secrets(v) if isinstance(v, str) else v for v in value]
        return value

    def format_field(self, value: Any, format_spec: str) -> str:
        return _plain(value)


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


def describe(template: str | None, kwargs: Mapping[str, Any]) -> str | None:
    """The template filled in with the kwargs, at most ``MAX_LENGTH`` characters; None when it cannot be."""
    if not template:
        return None
    try:
        names = template_names(template)
        text = _Formatter().vformat(template, (), {name: kwargs.get(name) for name in names})
    except (DescriptionError, ValueError, TypeError):
        return None
    return text if len(text) <= MAX_LENGTH else text[: MAX_LENGTH - 1] + "…"
