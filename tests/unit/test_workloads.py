"""Which log file name templates the one-statement workload build may render (``triggerer/workloads.py``):
only those that read nothing a ``TaskInstanceDTO`` lacks, since Jinja renders a missing attribute as ''."""

from __future__ import annotations

import pytest

from triggerer.workloads import _reads_only

DTO = {"dag_id", "run_id", "task_id", "map_index", "try_number"}
AIRFLOWS_DEFAULT = ("dag_id={{ ti.dag_id }}/run_id={{ ti.run_id }}/task_id={{ ti.task_id }}/"
                    "{% if ti.map_index >= 0 %}map_index={{ ti.map_index }}/{% endif %}"
                    "attempt={{ try_number|default(ti.try_number) }}.log")


@pytest.mark.parametrize("template", [AIRFLOWS_DEFAULT, "{{ ti.dag_id }}/{{ try_number }}.log"])
def test_templates_reading_only_dto_fields_are_rendered_here(template: str) -> None:
    assert _reads_only(template, DTO)


@pytest.mark.parametrize("template", [
    "{{ ti.dag_id }}/{{ ti.logical_date }}.log",  # not on the DTO: would render as ''
    "{{ ti }}.log",
    "{{ ti['dag_id'] }}.log",
    "{{ ds }}/{{ ti.dag_id }}.log",
    "{{ ti.dag_run.logical_date }}.log",
    "{{ ti.dag_id",  # not even a template: Airflow's own builder says why
])
def test_other_templates_are_left_to_airflow(template: str) -> None:
    assert not _reads_only(template, DTO)
