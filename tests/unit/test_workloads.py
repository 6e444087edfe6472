"""Which log file name templates the one-statement workload build may render
(``smart_triggerer/supervisor/workloads.py``): only those that read nothing a ``TaskInstanceDTO`` lacks, since
Jinja renders a missing attribute as ''."""

from __future__ import annotations

import pytest

from smart_triggerer.supervisor.workloads import _reads_only

DTO = {"dag_id", "run_id", "task_id", "map_index", "try_number"}
AIRFLOWS_DEFAULT = (
    "dag_id={{ ti.dag_id }}/run_id={{ ti.run_id }}/task_id={{ ti.task_id }}/"
    "{% if ti.map_index >= 0 %}map_index={{ ti.map_index }}/{% endif %}"
    "attempt={{ try_number|default(ti.try_number) }}.log"
)


@pytest.mark.parametrize("template", [AIRFLOWS_DEFAULT, "{{ ti.dag_id }}/{{ try_number }}.log"])
def test_templates_reading_only_dto_fields_are_rendered_here(template: str) -> None:
    assert _reads_only(template, DTO)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ti.dag_id }}/{{ ti.logical_date }}.log",  # not on the DTO: would render as ''
        "{{ ti }}.log",
        "{{ ti['dag_id'] }}.log",
        "{{ ds }}/{{ ti.dag_id }}.log",
        "{{ ti.dag_run.logical_date }}.log",
        "{{ ti.dag_id",  # not even a template: Airflow's own builder says why
    ],
)
def test_other_templates_are_left_to_airflow(template: str) -> None:
    assert not _reads_only(template, DTO)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"map_index": 0, "try_number": 3},
        {"map_index": 17},
        {
            "dag_id": "sales.daily-v2",
            "task_id": "group.wait_for_<orders>&co",
            "run_id": "manual__2026-11-27T10:00:00+00:00",
        },
        {"dag_id": "données", "run_id": "scheduled__2026-01-01T00:00:00+00:00", "task_id": "attendre_l'été"},
    ],
)
def test_airflows_default_template_is_named_as_jinja_names_it(fields: dict[str, object]) -> None:
    import jinja2

    from smart_triggerer.supervisor.workloads import AIRFLOW_DEFAULT_LOG_TEMPLATE, default_log_filename
    from tests.helpers.task_instances import task_instance_dto

    assert AIRFLOW_DEFAULT_LOG_TEMPLATE == AIRFLOWS_DEFAULT
    ti = task_instance_dto(**fields)
    jinja = jinja2.Template(AIRFLOW_DEFAULT_LOG_TEMPLATE).render  # Airflow's renderer (utils/helpers.py)
    assert default_log_filename(ti=ti) == jinja(ti=ti)
    assert default_log_filename(ti=ti, try_number=9) == jinja(ti=ti, try_number=9)


def test_the_fast_name_is_taken_only_for_airflows_default_template() -> None:
    from airflow.configuration import conf

    from smart_triggerer.supervisor import workloads

    assert conf.get_default_value("logging", "log_filename_template") == AIRFLOWS_DEFAULT  # still Airflow's
    assert workloads.renderer_for(AIRFLOWS_DEFAULT) is workloads.default_log_filename
    for other in ("{{ ti.dag_id }}/{{ ti.run_id }}.log", AIRFLOWS_DEFAULT.replace("attempt=", "try=")):
        render = workloads.renderer_for(other)
        assert render is not None and render is not workloads.default_log_filename  # Airflow's renderer
    assert workloads.renderer_for("{dag_id}/{task_id}/{logical_date}/{try_number}.log") is None
