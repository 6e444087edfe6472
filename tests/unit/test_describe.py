"""``describe`` parses each template once (triggers/describe.py); it must say what the straightforward
rendering (bracketed parts removed, then ``string.Formatter``) said, for every template it accepts."""

from __future__ import annotations

import datetime as dt
import random
import string
from collections.abc import Mapping
from typing import Any

from triggers.describe import (
    _OPTIONAL,
    BUILTIN_DESCRIPTIONS,
    MAX_LENGTH,
    REPLACED_TEMPLATES,
    DescriptionError,
    _converted,
    _empty,
    _plain,
    describe,
    template_names,
)


class _Reference(string.Formatter):
    def convert_field(self, value: Any, conversion: str | None) -> Any:
        return _converted(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> str:
        return _plain(value)


def reference(template: str | None, kwargs: Mapping[str, Any]) -> str | None:
    """The rendering before templates were parsed once (release 0.2.0's first describe)."""
    if not template:
        return None
    try:
        names = template_names(template)
        values = {name: kwargs.get(name) for name in names}

        def part(match: Any) -> str:
            shown = template_names(match.group(1))
            return "" if any(_empty(values.get(name)) for name in shown) else str(match.group(1))

        text = _Reference().vformat(_OPTIONAL.sub(part, template), (), values)
    except (DescriptionError, ValueError, TypeError):
        return None
    return text if len(text) <= MAX_LENGTH else text[: MAX_LENGTH - 1] + "…"


NAMES = ("a", "b", "url", "since")
VALUES: tuple[Any, ...] = (
    None,
    "",
    [],
    "x",
    "https://u:p@h.example/a?t=1#f",
    ["https://h1/x?q", 3],
    dt.datetime(2026, 11, 27, 12, tzinfo=dt.UTC),
    42,
    {"k": "v"},
    "y" * 400,
)
BITS = (
    "x ",
    "{{",
    "}}",
    "[",
    "]",
    "{a}",
    "{b!p}",
    "{url!p}",
    "{since!h}",
    "{a:>5}",
    "{c.d}",
    "{0}",
    "{}",
    "{a!r}",
    "{",
    "}",
    " loaded",
    "[ since {since}]",
    "[ of {a} and {b}]",
    "[]",
    "[{{ {a} }}]",
)


def test_every_template_our_triggers_and_airflows_use_reads_as_before() -> None:
    templates = [
        *BUILTIN_DESCRIPTIONS.values(),
        *REPLACED_TEMPLATES,
        *REPLACED_TEMPLATES.values(),
        "{key} ready at {url!p}",
        "HTTP {method} {endpoint!p} on {http_conn_id} answering {expected_statuses}",
        "new rows of {status_table} on {conn_id}",
    ]
    chooser = random.Random(7)
    for template in templates:
        names = sorted(template_names(template))
        for _ in range(50):
            kwargs = {name: chooser.choice(VALUES) for name in names}
            assert describe(template, kwargs) == reference(template, kwargs), (template, kwargs)


def test_random_templates_read_as_before() -> None:
    """Fields, conversions, escapes, optional parts, stray brackets and braces, refused names: the same
    text, or None for the same templates."""
    chooser = random.Random(2026)
    refused = shown = 0
    for _ in range(3000):
        template = "".join(chooser.choice(BITS) for _ in range(chooser.randint(1, 8)))
        kwargs = {name: chooser.choice(VALUES) for name in NAMES if chooser.random() < 0.8}
        expected = reference(template, kwargs)
        assert describe(template, kwargs) == expected, (template, kwargs)
        refused, shown = refused + (expected is None), shown + (expected is not None)
    assert refused > 300 and shown > 300  # both kinds were tried
