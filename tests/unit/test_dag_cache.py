"""Deserialized DAGs shared between the builds of one start (``smart_triggerer/supervisor/dagbag.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smart_triggerer.supervisor.dagbag import DagCache, OneBuildDagBag


@dataclass
class FakeModel:
    """A ``SerializedDagModel`` that counts its deserializations."""

    dag_version_id: str
    dag_hash: str
    made: list[str] = field(default_factory=list)

    @property
    def dag(self) -> Any:
        self.made.append(self.dag_hash)
        return object()


class FakeBag:
    def __init__(self, models: dict[str, FakeModel]) -> None:
        self.models = models

    def get_serialized_dag_model(self, version_id: str, session: Any) -> FakeModel:
        return self.models[version_id]


def test_builds_of_one_start_deserialize_a_dag_version_once() -> None:
    cache = DagCache()
    made: list[str] = []
    first = FakeModel("v1", "h1", made)
    dags = []
    for _build in range(3):  # each build reads its own model rows, as Airflow's bag does
        bag = OneBuildDagBag(FakeBag({"v1": FakeModel("v1", "h1", made)}), cache)
        model = bag.get_serialized_dag_model("v1", session=None)
        assert model is not None
        dags.append(model.dag)
    assert made == ["h1"] and dags[0] is dags[1] is dags[2]
    assert cache.dag_of(first) is dags[0] and made == ["h1"]


def test_a_changed_hash_is_deserialized_again_and_the_cache_is_bounded() -> None:
    cache = DagCache(limit=2)
    made: list[str] = []
    old = cache.dag_of(FakeModel("v1", "h1", made))
    assert cache.dag_of(FakeModel("v1", "h2", made)) is not old  # the same version, other data
    cache.dag_of(FakeModel("v2", "h3", made))
    assert len(cache) == 2
    cache.dag_of(FakeModel("v1", "h1", made))  # dropped as the least recently used: made again
    assert made == ["h1", "h2", "h3", "h1"]
    cache.clear()
    assert len(cache) == 0
