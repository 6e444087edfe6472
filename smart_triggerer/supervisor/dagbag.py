"""Airflow's DAG bag for one ``build_trigger_workloads`` call, reading each DAG version once.

Airflow's ``_create_workload`` looks up the task's serialized DAG and deserializes it
(``SerializedDagModel.dag``, uncached) for every trigger it starts, only to check the task's
``start_from_trigger``; runs without a bundle version also cost one "latest version" query each. A start
of thousands of coroutines spent nearly all of the supervisor's CPU there (docs/design.md, Measurements
behind the code). Within one build (one session, a few hundred triggers) a DAG version does not change,
so its model and DAG are read once and shared.

A takeover or a start of thousands is many builds in a row: each build still reads its models (a DAG's
latest version may change between builds), but a DAG whose version and hash it has deserialized in an
earlier build of the same start is taken from ``DagCache`` (same version and hash: the same DAG). The
cache is emptied when the start is over: a deserialized DAG is large.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

DAGS_KEPT = 32  # deserialized DAGs kept between the builds of one start, least recently used dropped


class DagCache:
    """Deserialized DAGs by (DAG version, hash of its serialized data), between the builds of one start."""

    def __init__(self, limit: int = DAGS_KEPT) -> None:
        self.limit = limit
        self._dags: OrderedDict[tuple[Any, str], Any] = OrderedDict()
        # (version, hash, task id) -> the task starts from the trigger (workloads.StartFromTrigger)
        self.flags: dict[tuple[Any, str, str], bool] = {}

    def __len__(self) -> int:
        return len(self._dags)

    def dag_of(self, model: Any) -> Any:
        key = (model.dag_version_id, model.dag_hash)
        dag = self._dags.get(key)
        if dag is None:
            dag = self._dags[key] = model.dag
            while len(self._dags) > self.limit:
                self._dags.popitem(last=False)
        self._dags.move_to_end(key)
        return dag

    def clear(self) -> None:
        self._dags.clear()
        self.flags.clear()


class _SharedModel:
    """A ``SerializedDagModel`` whose ``dag`` is deserialized once; every other attribute is the model's."""

    def __init__(self, model: Any, cache: DagCache) -> None:
        self._model = model
        self._cache = cache

    @functools.cached_property
    def dag(self) -> Any:
        return self._cache.dag_of(self._model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class OneBuildDagBag:
    """Wraps the ``DBDagBag`` Airflow made for one build; lives only as long as that build."""

    def __init__(self, bag: Any, cache: DagCache | None = None) -> None:
        self.bag = bag
        self.cache = cache if cache is not None else DagCache()
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
            shared = self._by_version[version_id] = _SharedModel(model, self.cache)
        return shared

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bag, name)
