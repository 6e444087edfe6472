"""Canary: the Airflow 3.3 triggerer internals we build on are still there, with the parameters we pass.

An Airflow release that renames, removes or changes one of these makes our override dead code or our call
wrong, silently; this test fails first, naming the class and the method. (The columns our SQL reads are
checked against a migrated database in tests/integration/test_airflow_canary.py.)
"""

from __future__ import annotations

import inspect

import pytest

# Airflow's class -> method -> its parameters as of 3.3.1 and 3.3.2 (our overrides and the methods we call)
RELIED_ON: dict[str, dict[str, list[str]]] = {
    "TriggerRunnerSupervisor": {
        "run_in_process": [],
        "run_once": ["self"],
        "send_msg": ["self", "msg", "request_id", "error", "dump_opts"],
        "handle_events": ["self"],
        "handle_failed_triggers": ["self"],
        "load_triggers": ["self"],
        "_create_workload": ["self", "trigger", "dag_bag", "render_log_fname", "session"],
        "build_trigger_workloads": ["self", "new_trigger_ids"],
        "_handle_request": ["self", "msg", "log", "req_id"],
        "fetch_trigger_details": ["self", "trigger_ids", "session"],
    },
    "TriggerRunner": {
        "_handle_signal": ["self", "signum", "frame"],
        "arun": ["self"],
        "cancel_triggers": ["self"],
        "cleanup_finished_triggers": ["self"],
        "run": ["self"],
        "sync_state_to_supervisor": ["self", "finished_ids"],
        "create_triggers": ["self"],
        "run_trigger": ["self", "trigger_id", "trigger", "timeout_after", "context"],
        "create_runtime_ti": ["task_instance", "encoded_dag", "dag_run_data"],  # runner._create_one
        "get_trigger_by_classpath": ["self", "classpath"],
    },
}


@pytest.mark.parametrize(
    ("cls_name", "method"), [(c, m) for c, methods in RELIED_ON.items() for m in methods]
)
def test_the_triggerer_internals_we_override_or_call_are_unchanged(cls_name: str, method: str) -> None:
    from airflow.jobs import triggerer_job_runner

    cls = getattr(triggerer_job_runner, cls_name)
    found = getattr(cls, method, None)
    assert found is not None, f"Airflow's {cls_name}.{method} is gone: our override of it is dead code"
    params = list(inspect.signature(found).parameters)
    assert params == RELIED_ON[cls_name][method], (
        f"Airflow's {cls_name}.{method} now takes {params}, not {RELIED_ON[cls_name][method]}: "
        "our override or call must follow"
    )


def test_the_span_function_we_replace_when_untraced_is_unchanged() -> None:
    """smart_triggerer.runner.trigger_runner.skip_untraced_spans replaces this module function of
    Airflow's."""
    from airflow.jobs import triggerer_job_runner

    found = getattr(triggerer_job_runner, "_make_trigger_span", None)
    assert found is not None, "Airflow's triggerer_job_runner._make_trigger_span is gone"
    assert list(inspect.signature(found).parameters) == ["ti", "trigger_id", "name"]


def test_the_task_instance_dto_is_what_the_one_statement_build_fills() -> None:
    """smart_triggerer.supervisor.workloads builds each task's TaskInstanceDTO from the task instance columns
    it names: a field Airflow adds would make every row go Airflow's slower way (or a required one, fail
    validation)."""
    from airflow.executors.workloads.task import TaskInstanceDTO
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance

    from smart_triggerer.supervisor.workloads import DTO_FIELDS

    executor_only = {"external_executor_id", "executor_config"}  # excluded from what the runner gets
    assert set(TaskInstanceDTO.model_fields) - executor_only == set(DTO_FIELDS)
    for name in (*DTO_FIELDS, "trigger_id", "trigger_timeout"):
        assert hasattr(TaskInstance, name), f"Airflow's TaskInstance.{name} is gone"
    for name in ("bundle_version", "created_dag_version_id"):
        assert hasattr(DagRun, name), f"Airflow's DagRun.{name} is gone"


def test_every_override_of_ours_is_in_the_canary() -> None:
    """A new override must be added above, or the canary would not watch it."""
    from airflow.jobs.triggerer_job_runner import TriggerRunner, TriggerRunnerSupervisor

    from smart_triggerer.runner.trigger_runner import SmartTriggerRunner
    from smart_triggerer.supervisor import SmartTriggerRunnerSupervisor

    pairs = ((SmartTriggerRunnerSupervisor, TriggerRunnerSupervisor), (SmartTriggerRunner, TriggerRunner))
    for ours, base in pairs:
        overrides = {
            name
            for cls in ours.__mro__
            if cls.__module__.startswith("smart_triggerer.")
            for name in vars(cls)
            if not name.startswith("__") and hasattr(base, name)
        }
        assert overrides, f"no override of {base.__name__} found: the filter matches none of our modules"
        assert overrides <= set(RELIED_ON[base.__name__]), overrides - set(RELIED_ON[base.__name__])


# Airflow's module functions we call -> their parameters as of 3.3.1 and 3.3.2 (3.3.0 has no
# _decode_next_kwargs, and its handle_event_submit raises on a payload it cannot store: refused)
FUNCTIONS: dict[str, dict[str, list[str]]] = {
    "airflow.models.trigger": {
        "handle_event_submit": ["event", "task_instance", "session"],  # smart_triggerer/supervisor/fanout.py
        "_decode_next_kwargs": ["next_kwargs_raw"],  # smart_triggerer/supervisor/fanout.py
    },
    # smart_triggerer/runner/kwargs.py
    "airflow.serialization.decoders": {"smart_decode_trigger_kwargs": ["d"]},
    # smart_triggerer/supervisor/workloads.py
    "airflow.utils.helpers": {"log_filename_template_renderer": []},
}


@pytest.mark.parametrize(
    ("module", "function"), [(m, f) for m, functions in FUNCTIONS.items() for f in functions]
)
def test_the_airflow_functions_we_call_are_unchanged(module: str, function: str) -> None:
    import importlib

    found = getattr(importlib.import_module(module), function, None)
    assert found is not None, f"Airflow's {module}.{function} is gone: our call of it fails"
    params = list(inspect.signature(found).parameters)
    assert params == FUNCTIONS[module][function], (
        f"Airflow's {module}.{function} now takes {params}, not {FUNCTIONS[module][function]}"
    )


def test_the_trigger_failure_reasons_we_write_are_unchanged() -> None:
    """smart_triggerer/supervisor/fanout.py writes these values into next_kwargs, as Airflow's own failure
    path does."""
    from airflow.models.trigger import TriggerFailureReason

    assert {reason.name for reason in TriggerFailureReason} >= {"TRIGGER_FAILURE", "TRIGGER_TIMEOUT"}


# Airflow's methods whose body we follow line by line in an override (not only their parameters): the
# digest of the method's tokens (whitespace and comments aside, so the same on every Python) as of 3.3.1
# and 3.3.2
COPIED: dict[str, str] = {
    # smart_triggerer/runner/trigger_runner.py SmartTriggerRunner._create_all/_create_one: the same steps,
    # fewer yields
    "TriggerRunner.create_triggers": "eb131f8a21c73e209f83aa931fd903e403e5ccf0e2960ec268ae134628437d2f",
}


def _digest(source: str) -> str:
    """sha256 of the code's tokens without whitespace or comments (Python 3.12 splits f-strings into
    tokens of their own; joined, they read the same)."""
    import hashlib
    import io
    import tokenize

    layout = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    text = "".join(token.string for token in tokens if token.type not in layout)
    return hashlib.sha256("".join(text.split()).encode()).hexdigest()


@pytest.mark.parametrize("qualname", sorted(COPIED))
def test_the_airflow_code_we_follow_step_by_step_is_unchanged(qualname: str) -> None:
    import textwrap

    from airflow.jobs import triggerer_job_runner

    cls_name, method = qualname.split(".")
    source = textwrap.dedent(inspect.getsource(getattr(getattr(triggerer_job_runner, cls_name), method)))
    assert _digest(source) == COPIED[qualname], (
        f"Airflow's {qualname} changed: our copy of its steps (see the comment above COPIED) must follow, "
        "then record the new digest"
    )
