from __future__ import annotations

import pytest

from smart_triggerer.placement.groups import Groups


def test_join_same_hash_makes_one_group() -> None:
    groups = Groups()
    for trigger_id in (5, 3, 9):
        groups.join(trigger_id, identity_hash=42)
    groups.join(10, identity_hash=7)
    assert groups.group_count() == 2
    assert groups.waiter_count() == 4
    assert groups.by_hash[42].leader == 3


def test_leader_leaving_keeps_the_runner() -> None:
    groups = Groups()
    for trigger_id in (3, 5, 9):
        group = groups.join(trigger_id, 42)
    runner = groups.start(group)
    assert runner == 3
    groups.leave(3)
    # Leadership passes to the next member; the coroutine (runner 3) keeps running for them.
    assert group.leader == 5
    assert groups.by_runner(3) is group
    assert groups.runners == {3}


def test_empty_group_is_reported_then_forgotten() -> None:
    groups = Groups()
    group = groups.join(1, 42)
    groups.start(group)
    left = groups.leave(1)
    assert left is group and left.empty
    assert groups.group_count() == 0
    groups.finish(group)
    assert groups.by_runner(1) is None
    assert groups.by_hash == {} and groups.runners == set()


def test_leave_unknown_member_is_a_no_op() -> None:
    assert Groups().leave(99) is None


def test_an_empty_group_does_not_start() -> None:
    groups = Groups()
    group = groups.join(1, 42)
    groups.leave(1)
    assert groups.start(group) is None and group.runner_id is None


def test_a_leader_that_cannot_start_passes_leadership_on() -> None:
    groups = Groups()
    for trigger_id in (3, 5):
        group = groups.join(trigger_id, 42)
    assert groups.start(group) == 3
    group.unstartable.add(3)  # its task was cleared between load and start
    groups.stop_runner(group)
    assert groups.start(group) == 5
    group.unstartable.add(5)
    groups.stop_runner(group)
    assert groups.start(group) is None


def test_stop_runner_keeps_members_waiting() -> None:
    groups = Groups()
    group = groups.join(1, 42)
    groups.join(2, 42)
    groups.start(group)
    groups.stop_runner(group)
    assert group.runner_id is None and groups.runners == set()
    assert groups.members() == {1, 2}


def test_group_settings_are_the_most_demanding_of_its_members() -> None:
    groups = Groups()
    group = groups.join(1, 42, {"poll_interval": ("min", 30.0)})
    groups.join(2, 42, {"poll_interval": ("min", 60.0)})
    assert group.settings == {"poll_interval": 30.0}
    groups.start(group)
    assert not group.stricter_than_running()
    groups.join(3, 42, {"poll_interval": ("min", 5.0)})
    assert group.stricter_than_running()
    assert groups.restart(group, runner=3) == 3
    assert group.running_settings == {"poll_interval": 5.0} and groups.runners == {3}
    assert not group.stricter_than_running()


def test_a_push_member_joining_a_poll_only_group_restarts_it_listening() -> None:
    """Issue 11.1: a NOTIFY channel of one member must never be dropped because another member polls."""
    groups = Groups()
    group = groups.join(1, 42, {"poll_interval": ("min", 300.0), "notify_channel": ("union", None)})
    groups.start(group)
    assert group.settings["notify_channel"] is None
    groups.join(2, 42, {"poll_interval": ("min", 300.0), "notify_channel": ("union", "loads")})
    assert group.settings == {"poll_interval": 300.0, "notify_channel": ["loads"]}
    assert group.stricter_than_running()
    groups.restart(group, runner=2)
    groups.join(3, 42, {"poll_interval": ("min", 300.0), "notify_channel": ("union", "other")})
    assert group.settings["notify_channel"] == ["loads", "other"]
    assert group.stricter_than_running()
    groups.join(4, 42, {"poll_interval": ("min", 300.0), "notify_channel": ("union", None)})
    groups.restart(group, runner=3)
    assert not group.stricter_than_running()


def test_runner_must_be_a_member() -> None:
    groups = Groups()
    group = groups.join(1, 42)
    with pytest.raises(ValueError, match="not a member"):
        groups.start(group, runner=9)


def test_kept_counts_agree_with_the_groups_under_random_changes() -> None:
    """group_count, unstarted and version are kept, not computed: check them against the groups."""
    import random

    rng = random.Random(7)
    groups = Groups()
    last_runners, last_version = set(groups.runners), groups.version
    for _ in range(5000):
        action = rng.random()
        trigger_id = rng.randrange(200)
        if action < 0.4:
            if trigger_id not in groups.hash_of_member:
                groups.join(trigger_id, rng.randrange(30))
        elif action < 0.6:
            groups.leave(trigger_id)
        elif action < 0.75 and groups.unstarted:
            groups.start(rng.choice(list(groups.unstarted.values())))
        elif action < 0.85 and groups.hash_of_runner:
            group = groups.by_runner(rng.choice(sorted(groups.hash_of_runner)))
            assert group is not None
            groups.stop_runner(group)
        elif groups.by_hash:
            groups.finish(rng.choice(list(groups.by_hash.values())))
        assert groups.group_count() == sum(1 for g in groups.by_hash.values() if not g.empty)
        assert groups.runners == set(groups.hash_of_runner)
        assert {id(g) for g in groups.unstarted.values()} == {
            id(g) for g in groups.by_hash.values() if not g.empty and g.runner_id is None
        }
        if groups.runners != last_runners:
            assert groups.version != last_version
        last_runners, last_version = set(groups.runners), groups.version


def test_a_group_is_uniform_while_its_members_bring_the_same_execution_kwargs() -> None:
    groups = Groups()
    group = groups.join(1, 42, {"poll_interval": ("min", 30.0)})
    assert group.uniform == {"poll_interval": ("min", 30.0)}
    groups.join(2, 42, {"poll_interval": ("min", 30.0)})
    assert group.uniform is not None and group.settings == {"poll_interval": 30.0}
    groups.join(3, 42, {"poll_interval": ("min", 60.0)})
    assert group.uniform is None and group.settings == {"poll_interval": 30.0}
    groups.join(4, 42, {"poll_interval": ("min", 30.0)})  # never uniform again: its merges only grow
    assert group.uniform is None
    assert groups.join(5, 7).uniform == {}  # no execution kwargs at all: uniform too


def test_arrivals_count_every_way_a_group_comes_to_wait_and_nothing_else() -> None:
    """The supervisor keeps its start order until ``arrivals`` changes: every way into ``unstarted`` (and
    a member joining a waiting group, which may make it more urgent) must count, and starting must not."""
    groups = Groups()
    seen = groups.arrivals

    def arrived() -> bool:
        nonlocal seen
        changed, seen = groups.arrivals != seen, groups.arrivals
        return changed

    group = groups.join(1, 42)
    assert arrived()  # a new group
    groups.join(2, 42)
    assert arrived()  # a member of a waiting group
    groups.start(group)
    assert not arrived()
    groups.join(3, 42)
    assert not arrived()  # joins a running coroutine: nothing to start
    groups.stop_runner(group)
    assert arrived()  # waits again
    groups.suspend(group, until=10.0)
    groups.wake(now=5.0)
    assert not arrived()
    groups.wake(now=10.0)
    assert arrived()  # back from its backoff
    groups.leave(1)
    assert not arrived()
