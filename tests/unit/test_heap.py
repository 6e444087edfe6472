"""The collector settings every smart triggerer process runs with (triggerer/heap.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from triggerer.heap import YOUNG_THRESHOLD, tune_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_start_up_objects_are_frozen_and_young_collections_are_rare(restored_collector: None) -> None:
    gc.unfreeze()
    _, middle, old = gc.get_threshold()
    loaded_at_start = [{"module": n} for n in range(1000)]  # containers, as imports leave behind
    tune_collector()
    assert gc.get_freeze_count() >= len(loaded_at_start)
    # young collections every YOUNG_THRESHOLD allocations; the older generations keep their cadence
    assert gc.get_threshold() == (YOUNG_THRESHOLD, middle, old)
