"""Every example DAG parses with zero import errors, at the demo's sizes and at the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLE_DAGS = Path(__file__).parents[2] / "example_dags"


@pytest.mark.parametrize(("dags", "tasks", "expected_models"), [("20", "10", 20), ("5", "8", 5)])
def test_example_dags_parse_without_import_errors(
    monkeypatch: pytest.MonkeyPatch, dags: str, tasks: str, expected_models: int
) -> None:
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("SMART_DEMO_DAGS", dags)
    monkeypatch.setenv("SMART_DEMO_TASKS", tasks)
    bag = DagBag(dag_folder=str(EXAMPLE_DAGS))
    assert bag.import_errors == {}
    models = [d for d in bag.dag_ids if d.startswith("model_")]
    assert len(models) == expected_models
    assert {
        "finance_users_report",
        "marketing_users_report",
        "operations_users_report",
        "user_mart",
        "etl_daily",
        "reporting",
        "wait_for_service",
    } <= set(bag.dag_ids)
    assert all(len(bag.dags[d].tasks) == int(tasks) for d in models)
