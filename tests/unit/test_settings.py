"""``[smart_triggerer]`` settings read from Airflow's configuration (environment variables here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from smart_triggerer.config import ConfigError, Settings

ROOT = Path(__file__).resolve().parents[2]


def test_event_loop_defaults_to_uvloop_and_accepts_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW__SMART_TRIGGERER__EVENT_LOOP", raising=False)
    assert Settings.from_airflow().event_loop == "uvloop"
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__EVENT_LOOP", " AsyncIO ")
    assert Settings.from_airflow().event_loop == "asyncio"


def test_an_unknown_event_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__EVENT_LOOP", "trio")
    expected = r"\[smart_triggerer\] event_loop must be one of uvloop, asyncio, got 'trio'"
    with pytest.raises(ConfigError, match=expected):
        Settings.from_airflow()


def settings_read(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The ``[smart_triggerer]`` keys the service and the triggers read (recorded from Airflow's conf)."""
    from airflow.configuration import conf

    from triggers.coalesce import coalescing

    read: set[str] = set()
    original_get, original_boolean = conf.get, conf.getboolean

    def get(section: str, key: str, *args: object, **kwargs: object) -> object:
        if section == "smart_triggerer":
            read.add(key)
        return original_get(section, key, *args, **kwargs)

    def getboolean(section: str, key: str, *args: object, **kwargs: object) -> bool:
        if section == "smart_triggerer":
            read.add(key)
        return original_boolean(section, key, *args, **kwargs)

    monkeypatch.setattr(conf, "get", get)
    monkeypatch.setattr(conf, "getboolean", getboolean)
    Settings.from_airflow()
    coalescing()
    return read


def provider_options() -> dict[str, dict[str, object]]:
    from smart_triggerer.provider_info import get_provider_info

    options: dict[str, dict[str, object]] = get_provider_info()["config"]["smart_triggerer"]["options"]
    return options


def test_every_setting_read_is_declared_for_airflow_config_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """`airflow config list --section smart_triggerer` shows what the provider declares: every key the
    code reads must be there, with the default the code uses."""
    read = settings_read(monkeypatch)
    options = provider_options()
    assert read == set(options), (
        f"read but not declared: {sorted(read - set(options))}; declared but "
        f"never read: {sorted(set(options) - read)}"
    )
    defaults = Settings()
    for key, option in options.items():
        code_default = getattr(defaults, key, True if key == "coalesce_checks" else None)
        declared = option["default"]
        if isinstance(code_default, bool):
            assert declared == str(code_default), key
        elif isinstance(code_default, (int, float)):
            assert float(str(declared)) == float(code_default), key
        elif isinstance(code_default, tuple):
            assert declared == ",".join(code_default), key
        else:
            assert (declared or None) == (code_default or None), key


SETTINGS_TABLE = "## `[smart_triggerer]` settings"


def table_rows(text: str, heading: str | None = None) -> list[list[str]]:
    """The cells of each table row (the header and its rule left out), in the first table after
    ``heading`` or, without one, in every table of ``text``."""
    lines = text.splitlines()
    if heading is not None:
        start = lines.index(heading)
        first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
        end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
        lines = lines[first:end]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    return [cells for cells in rows if cells[0] not in ("key", "") and not set(cells[0]) <= set("-:")]


def test_the_reference_lists_every_setting_once_with_its_default() -> None:
    """docs/reference.md holds the one settings table: each declared option exactly once, nothing else."""
    options = provider_options()
    rows = table_rows((ROOT / "docs" / "reference.md").read_text(), SETTINGS_TABLE)
    keys = [cells[0].strip("`") for cells in rows]
    assert len(keys) == len(set(keys)), f"listed twice: {sorted(k for k in set(keys) if keys.count(k) > 1)}"
    assert set(keys) == set(options), (
        f"missing: {sorted(set(options) - set(keys))}; not a setting: {sorted(set(keys) - set(options))}"
    )
    for cells in rows:
        key, default = cells[0].strip("`"), cells[1]
        declared = str(options[key]["default"])
        assert same_default(default, declared), (
            f"docs/reference.md says {key} defaults to {default!r}, the provider {declared!r}"
        )


def test_no_other_document_repeats_the_settings_table() -> None:
    """A second copy would go stale unchecked: no other document has a table row for a setting."""
    options = set(provider_options())
    documents = [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "example_dags" / "README.md",
        ROOT / "bench" / "RESULTS.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
    for path in documents:
        text = path.read_text()
        if path.name == "reference.md":  # its other tables, below the settings one
            text = text[text.index(SETTINGS_TABLE) + len(SETTINGS_TABLE) :]
            text = text[text.index("\n## ") :]
        repeated = [
            cells[0] for cells in table_rows(text) if len(cells) >= 3 and cells[0].strip("`") in options
        ]
        assert not repeated, f"{path.relative_to(ROOT)} repeats rows of the settings table: {repeated}"


def test_the_table_reader_sees_a_doubled_or_stale_row() -> None:
    text = (
        f"{SETTINGS_TABLE}\n\n| key | default | meaning |\n|---|---|---|\n| `shards` | 64 | a |\n"
        "| `shards` | 32 | b |\n| `gone` | 1 | c |\n\nafter\n| `x` | 1 | d |\n"
    )
    assert [cells[0] for cells in table_rows(text, SETTINGS_TABLE)] == ["`shards`", "`shards`", "`gone`"]


def same_default(written: str, declared: str) -> bool:
    """A document's default against the provider's: "unset" or blank for an empty one, numbers by value."""
    written = "" if written in ("unset", "") else written
    try:
        return float(written) == float(declared)
    except ValueError:
        return written == declared


@pytest.mark.parametrize("value", ["garbage!!", "NotDotted", "a..b", "mod.Class, 7up.Trigger"])
def test_dedup_classpaths_that_are_not_classpaths_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__DEDUP_CLASSPATHS", value)
    with pytest.raises(ConfigError, match=r"dedup_classpaths: '.*' is not a trigger's dotted classpath"):
        Settings.from_airflow()


def test_dedup_classpaths_of_dotted_names_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__DEDUP_CLASSPATHS", "my_pkg.triggers.Wait, other.T")
    assert Settings.from_airflow().dedup_classpaths == ("my_pkg.triggers.Wait", "other.T")
