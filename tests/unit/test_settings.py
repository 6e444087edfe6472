"""``[smart_triggerer]`` settings read from Airflow's configuration (environment variables here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from triggerer.config import ConfigError, Settings


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
    from triggerer.provider_info import get_provider_info

    return get_provider_info()["config"]["smart_triggerer"]["options"]


def documented(path: str, keys: set[str]) -> dict[str, str]:
    """key -> default from the tables of a document whose first column is a settings key."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / path).read_text()
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].strip("`") in keys:
            found[cells[0].strip("`")] = cells[1]
    return found


def test_every_setting_read_is_declared_for_airflow_config_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """`airflow config list --section smart_triggerer` shows what the provider declares: every key the
    code reads must be there, with the default the code uses."""
    read = settings_read(monkeypatch)
    options = provider_options()
    assert read == set(options), (f"read but not declared: {sorted(read - set(options))}; declared but "
                                  f"never read: {sorted(set(options) - read)}")
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


def test_the_reference_lists_every_setting_with_its_default_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/reference.md holds the one settings table; no other document repeats it (where a second copy
    would go stale unchecked)."""
    options = provider_options()
    listed = documented("docs/reference.md", set(options))
    missing = sorted(set(options) - set(listed))
    assert set(listed) == set(options), f"missing from docs/reference.md: {missing}"
    for key, default in listed.items():
        declared = str(options[key]["default"])
        assert same_default(default, declared), (
            f"docs/reference.md says {key} defaults to {default!r}, the provider {declared!r}")
    root = Path(__file__).resolve().parents[2]
    for path in ["README.md", *(str(p.relative_to(root)) for p in (root / "docs").rglob("*.md"))]:
        if path != "docs/reference.md":
            assert documented(path, set(options)) == {}, f"{path} repeats rows of the settings table"


def same_default(written: str, declared: str) -> bool:
    """A document's default against the provider's: "unset" or blank for an empty one, numbers by value."""
    written = "" if written in ("unset", "") else written
    try:
        return float(written) == float(declared)
    except ValueError:
        return written == declared


@pytest.mark.parametrize("value", ["garbage!!", "NotDotted", "a..b", "mod.Class, 7up.Trigger"])
def test_dedup_classpaths_that_are_not_classpaths_are_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                                     value: str) -> None:
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__DEDUP_CLASSPATHS", value)
    with pytest.raises(ConfigError, match=r"dedup_classpaths: '.*' is not a trigger's dotted classpath"):
        Settings.from_airflow()


def test_dedup_classpaths_of_dotted_names_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__SMART_TRIGGERER__DEDUP_CLASSPATHS", "my_pkg.triggers.Wait, other.T")
    assert Settings.from_airflow().dedup_classpaths == ("my_pkg.triggers.Wait", "other.T")
