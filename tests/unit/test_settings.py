"""``[smart_triggerer]`` settings read from Airflow's configuration (environment variables here)."""

from __future__ import annotations

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
