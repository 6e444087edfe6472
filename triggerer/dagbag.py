"""Airflow's DAG bag for one ``build_trigger_workloads`` call, reading each DAG version once.

Airflow's ``_create_workload`` looks up the task's serialized DAG and deserializes it
(``SerializedDagModel.dag``, uncached) for every trigger it starts, only to check the task's
``start_from_trigger``; runs without a bundle version also cost one "latest version" query each. Starting
30,000 coroutines spent 95% of the supervisor's CPU there. Within one build (one session, a few hundred
triggers) a DAG version does not change, so its model and DAG are read once and shared.
"""

from __future__ import annotations

import functools
from typing import Any


class _SharedModel:
    """A ``SerializedDagModel`` whose ``dag`` is deserialized once; every other attribute is the model's."""

    def __init__(self, model: Any) -> None:
        self._model = model

    @functools.cached_property
    def dag(self) -> Any:
        return self._model.dag

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class OneBuildDagBag:
    """Wraps the ``DBDagBag`` Airflow made for one build; lives only as long as that build."""

    def __init__(self, bag: Any) -> None:
        self.bag = bag
        self._by_run_key: dict[Any, _SharedModel | None] = {}
        self._by_version: dict[Any, _SharedModel | None] = {}

    def get_serialized_dag_model_for_run(self, dag_run: Any, *, session: Any) -> _SharedModel | None:
        # Airflow resolves a run to its own DAG version when it has a bundle version, else to the DAG's
        # latest version (DBDagBag._version_from_dag_run): runs that resolve alike share one entry
        if dag_run.bundle_version and dag_run.created_dag_version_id:
            key: Any = ("version", dag_run.created_dag_version_id)
        else:
            key = ("latest", dag_run.dag_id)
        if key not in self._by_run_key:
            model = self.bag.get_serialized_dag_model_for_run(dag_run, session=session)
            self._by_run_key[key] = None if model is None else self._shared(model)
        return self._by_run_key[key]

    def get_serialized_dag_model(self, version_id: Any, session: Any) -> _SharedModel | None:
        if version_id not in self._by_version:
            model = self.bag.get_serialized_dag_model(version_id=version_id, session=session)
            self._by_version[version_id] = None if model is None else self._shared(model)
        return self._by_version[version_id]

    def _shared(self, model: Any) -> _SharedModel:
        version_id = model.dag_version_id
        shared = self._by_version.get(version_id)
        if shared is None:
            shared = self._by_version[version_id] = _SharedModel(model)
        return shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bag, name)
