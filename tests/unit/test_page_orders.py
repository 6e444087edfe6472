"""The page's kept order of groups (smart_triggerer.web.page.GroupOrders): read once per set of DAGs, served
stale while one refresh runs, dropped when unused; an injected clock and a refresh the test runs itself."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from smart_triggerer.web.page import GroupCount, GroupOrders

A = frozenset({"dag_a"})
B = frozenset({"dag_b"})


class Reads:
    """A reader that counts its reads and answers with the read's number as the only group's size."""

    def __init__(self) -> None:
        self.calls: list[frozenset[str]] = []
        self.fail = False

    def __call__(self, dag_ids: frozenset[str]) -> list[GroupCount]:
        if self.fail:
            raise ConnectionError("database down")
        self.calls.append(dag_ids)
        return [GroupCount((1, None, ""), members=len(self.calls), dags=1, waiting_since=None)]


@pytest.fixture
def clock() -> list[float]:
    return [100.0]


def orders(reads: Reads, clock: list[float], spawned: list[Callable[[], None]], **kw: float) -> GroupOrders:
    return GroupOrders(reads, clock=lambda: clock[0], spawn=spawned.append, **kw)  # type: ignore[arg-type]


def test_an_order_is_read_once_then_served_until_stale(clock: list[float]) -> None:
    spawned: list[Callable[[], None]]
    reads, spawned = Reads(), []
    kept = orders(reads, clock, spawned, fresh_seconds=10)
    assert kept.get(A)[0].members == 1
    clock[0] += 9
    assert kept.get(A)[0].members == 1 and reads.calls == [A] and spawned == []
    assert kept.get(B)[0].members == 2  # each set of DAGs has its own


def test_a_stale_order_is_served_while_one_refresh_reads_it_again(clock: list[float]) -> None:
    spawned: list[Callable[[], None]]
    reads, spawned = Reads(), []
    kept = orders(reads, clock, spawned, fresh_seconds=10)
    kept.get(A)
    clock[0] += 11
    assert kept.get(A)[0].members == 1 and kept.get(A)[0].members == 1  # stale, served at once
    assert len(spawned) == 1  # one refresh, not one per request
    spawned.pop()()
    assert kept.get(A)[0].members == 2 and spawned == []


def test_a_failed_refresh_keeps_the_order_and_the_next_request_tries_again(clock: list[float]) -> None:
    spawned: list[Callable[[], None]]
    reads, spawned = Reads(), []
    kept = orders(reads, clock, spawned, fresh_seconds=10)
    kept.get(A)
    clock[0] += 11
    kept.get(A)
    reads.fail = True
    spawned.pop()()
    assert kept.get(A)[0].members == 1 and len(spawned) == 1


def test_unused_orders_are_dropped_and_only_so_many_kept(clock: list[float]) -> None:
    spawned: list[Callable[[], None]]
    reads, spawned = Reads(), []
    kept = orders(reads, clock, spawned, fresh_seconds=10, keep_seconds=60, kept=2)
    kept.get(A)
    clock[0] += 61
    kept.get(B)  # A unused for over a minute: dropped
    assert kept.get(A)[0].members == 3
    kept.get(frozenset({"dag_c"}))  # three sets, two kept: B was read least recently
    kept.get(B)
    assert reads.calls == [A, B, A, frozenset({"dag_c"}), B]
