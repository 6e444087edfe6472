"""The suite's phases (``dev.py``): tests that assert time bounds first, alone, then the rest; against
another Airflow release than the newest (``--airflow``), the tests that exercise Airflow's internals only
(unit, integration, e2e marked ``lowest_airflow``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import dev


@pytest.fixture
def newest() -> Iterator[None]:
    saved = dev.VENV.path, dev.VENV.airflow
    yield
    dev.VENV.path, dev.VENV.airflow = saved


def markers(phases: list[tuple[str, list[str], Path]]) -> list[str]:
    return [selection[selection.index("-m") + 1] for _title, selection, _junit in phases]


def test_the_newest_runs_every_test_alone_ones_first(newest: None) -> None:
    dev.VENV.airflow = None
    assert markers(dev.pytest_phases([])) == ["alone", "not alone"]


def test_another_airflow_runs_what_exercises_airflows_internals(newest: None) -> None:
    dev.use_airflow("lowest")
    assert dev.VENV.airflow == dev.lowest_airflow()
    assert markers(dev.pytest_phases([])) == [
        "alone and (not e2e or lowest_airflow)",
        "not alone and (not e2e or lowest_airflow)",
    ]


def test_a_marker_of_the_callers_own_runs_as_one_phase(newest: None) -> None:
    dev.use_airflow("3.3.1")
    assert dev.pytest_phases(["-m", "e2e"]) == [("pytest", [], dev.VENV.path / "junit.xml")]
