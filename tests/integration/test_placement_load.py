"""Placement that follows load (``smart_triggerer/placement/shards.py``, ``supervisor/load.py``) on real
``smart-triggerer run`` processes and a real PostgreSQL: capacity as a cap, also in a full fleet (the waits
beyond it wait deferred for room), and an instance whose runner lags shedding shards and taking them again
once calm, without flapping."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devkit.devstack import AirflowStack, Component
from smart_triggerer.placement.rendezvous import Member, assign, shards_of
from tests.helpers.chaos.databases import AUDIT_DDL, doubled_resumes
from tests.helpers.seeding import Seeded, seed_deferred
from tests.helpers.shards import keys_per_shard
from tests.helpers.throttle import RunnerThrottle
from tests.helpers.triggers import FlagFileTrigger
from tests.helpers.waiting import execute, lease_owners, settled_owners, ti_states, wait_for
from tests.integration.test_smart_triggerer import ENV, FLAG_FILE, SHARDS, health_url, metrics


@pytest.fixture
def stack(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    yield airflow_stack


def start(stack: AirflowStack, name: str, capacity: int | None = None, **settings: str) -> Component:
    extra = {f"AIRFLOW__SMART_TRIGGERER__{k}": v for k, v in settings.items()}
    return stack.start_smart_triggerer(name, capacity=capacity, env={**ENV, **extra})


def seed_flag_waits(stack: AirflowStack, flag: Path, count: int) -> Seeded:
    """``count`` waits, each its own group, all firing once ``flag`` exists; every write of a task leaving
    DEFERRED is audited (a double resume shows in the trail, not only in a counter)."""
    execute(stack.config.database_dsn, AUDIT_DDL)
    return seed_deferred(
        stack.config.database_dsn,
        stack.config.dags_folder,
        count=count,
        classpath=FLAG_FILE,
        kwargs_for=lambda i: {"key": f"k{i}", "flag": str(flag)},
    )


def seed_even_flag_waits(stack: AirflowStack, flag: Path, per_shard: int) -> Seeded:
    """``per_shard`` waits on every shard, each its own group, all firing once ``flag`` exists (audited as
    ``seed_flag_waits``): equal shards, so that where placement puts them depends on no chance."""
    keys = keys_per_shard(lambda key: FlagFileTrigger(key, str(flag)), SHARDS, per_shard)
    execute(stack.config.database_dsn, AUDIT_DDL)
    return seed_deferred(
        stack.config.database_dsn,
        stack.config.dags_folder,
        count=len(keys),
        classpath=FLAG_FILE,
        kwargs_for=lambda i: {"key": keys[i], "flag": str(flag)},
    )


def instances(stack: AirflowStack) -> dict[int, dict[str, object]]:
    return {i["job_id"]: i for i in stack.smart_status()["instances"] if i["healthy"]}


def resume_all_once(stack: AirflowStack, flag: Path, seeded: Seeded, urls: list[str]) -> None:
    """Every wait fires and its task is resumed, exactly once (the instances' resumed counters and the
    task instances agree)."""
    flag.touch()
    dsn = stack.config.database_dsn
    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        120,
        "every wait resumed",
    )
    resumed = wait_for(
        lambda: sum(metrics(u)["smart_triggerer_resumed_total"] for u in urls),
        lambda n: n >= len(seeded.ti_ids),
        30,
        "the resumes counted",
    )
    assert resumed == len(seeded.ti_ids)
    assert doubled_resumes(dsn) == {}, "task instances written twice as they left DEFERRED"


class CoroutineSampler:
    """Samples each instance's running coroutines (its /metrics) every 0.2 s in a thread, until stopped:
    what a capacity is judged by, over the whole test, not at a moment the test chose."""

    def __init__(self) -> None:
        self.urls: dict[str, tuple[str, int]] = {}
        self.peaks: dict[str, float] = {}
        self.samples: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def watch(self, name: str, url: str, capacity: int) -> None:
        self.urls[name] = (url, capacity)
        if not self.thread.is_alive():
            self.thread.start()

    def over_capacity(self) -> dict[str, tuple[float, int]]:
        return {
            name: (self.peaks[name], capacity)
            for name, (_, capacity) in self.urls.items()
            if self.peaks.get(name, 0) > capacity
        }

    def _sample(self) -> None:
        while not self.done.wait(0.2):
            for name, (url, _) in list(self.urls.items()):
                try:
                    running = metrics(url)["smart_triggerer_coroutines"]
                except (httpx.HTTPError, KeyError):
                    continue  # starting, or stopping: nothing to judge
                self.peaks[name] = max(self.peaks.get(name, 0), running)
                self.samples[name] = self.samples.get(name, 0) + 1


def test_a_full_fleet_runs_no_instance_over_capacity_and_a_join_starts_the_rest(
    stack: AirflowStack, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    seeded = seed_flag_waits(stack, flag, 60)
    sampler = CoroutineSampler()
    small = start(stack, "small", capacity=20)
    small_url = health_url(small)
    sampler.watch("small", small_url, 20)
    try:
        # alone with 60 groups and a capacity of 20: it holds them all (no wait without an instance), runs
        # 20, and the 40 others wait deferred for room; the fleet says it is full
        wait_for(
            lambda: metrics(small_url),
            lambda m: (
                m.get("smart_triggerer_groups") == 60
                and m.get("smart_triggerer_coroutines") == 20
                and m.get("smart_triggerer_waiting_for_room") == 40
                and m.get("smart_triggerer_fleet_full") == 1
            ),
            60,
            "20 of 60 running, the fleet full",
        )
        full = wait_for(stack.smart_status, lambda s: s["totals"]["fleet_full"], 30, "fleet full")
        assert full["totals"]["groups"] == 60
        assert small.log_tail(200_000).count("the fleet is full") == 1
        assert set(ti_states(stack.config.database_dsn, seeded.dag_id).values()) == {"deferred"}

        big = start(stack, "big", capacity=100)
        big_url = health_url(big)
        sampler.watch("big", big_url, 100)
        # room in the fleet: every group runs once, the small one within its capacity
        settled = wait_for(
            lambda: (metrics(small_url), metrics(big_url)),
            lambda ms: (
                ms[0]["smart_triggerer_groups"] <= 20
                and ms[0]["smart_triggerer_groups"] + ms[1]["smart_triggerer_groups"] == 60
                and ms[0]["smart_triggerer_coroutines"] + ms[1]["smart_triggerer_coroutines"] == 60
            ),
            60,
            "every group running once, the small one at or under its capacity",
        )
        assert settled[0]["smart_triggerer_groups"] > 0  # its share (60 x 20/120 = 10), not nothing
        wait_for(stack.smart_status, lambda s: not s["totals"]["fleet_full"], 30, "room again")
        assert "the fleet has room again" in small.log_tail(200_000) + big.log_tail(200_000)
        resume_all_once(stack, flag, seeded, [small_url, big_url])
    finally:
        sampler.done.set()
    # sampled all along (how many times depends on the machine's speed): the small one seen at its cap
    # while the fleet was full, the big one once it ran its share
    assert sampler.peaks.get("small") == 20 and sampler.samples.get("big", 0) >= 3, (
        sampler.samples,
        sampler.peaks,
    )
    assert not sampler.over_capacity(), (sampler.samples, sampler.peaks)


def test_a_lagging_instance_sheds_shards_and_takes_them_again_once_calm(
    stack: AirflowStack, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    seeded = seed_flag_waits(stack, flag, 64)
    limits = {"MAX_LOOP_LAG_MS": "400"}
    # the limits name no capacity (mypy cannot know a dict[str, str] does not)
    slow, other = start(stack, "slow", **limits), start(stack, "other", **limits)  # type: ignore[arg-type]
    slow_url, other_url = health_url(slow), health_url(other)
    both = wait_for(
        lambda: (metrics(slow_url), metrics(other_url)),
        lambda ms: (
            ms[0]["smart_triggerer_groups"] >= 20
            and ms[1]["smart_triggerer_groups"] >= 20
            and ms[0]["smart_triggerer_groups"] + ms[1]["smart_triggerer_groups"] == 64
        ),
        60,
        "the groups spread over both",
    )
    before = int(both[0]["smart_triggerer_groups"])
    runner = slow.tree()[1]

    with RunnerThrottle(runner, stopped=0.7, period=1.0):
        shedding = wait_for(
            lambda: metrics(slow_url),
            lambda m: m["smart_triggerer_accepting"] == 0,
            60,
            "the slow instance shedding",
        )
        assert shedding["smart_triggerer_loop_lag_p99_ms"] > 400
        # it hands shards over, a step at a time while still over its limit; every group still runs once
        wait_for(
            lambda: (metrics(slow_url), metrics(other_url)),
            lambda ms: (
                ms[0]["smart_triggerer_groups"] <= before // 2
                and ms[0]["smart_triggerer_groups"] + ms[1]["smart_triggerer_groups"] == 64
            ),
            90,
            "half of its groups handed over",
        )
        status = instances(stack)
        slow_row = next(i for i in status.values() if not i["accepting"])
        assert "event-loop lag" in str(slow_row["shedding"])

    # calm again: after the hysteresis it takes shards again, and the groups spread over both once more
    wait_for(lambda: metrics(slow_url), lambda m: m["smart_triggerer_accepting"] == 1, 120, "taking shards")
    wait_for(
        lambda: (metrics(slow_url), metrics(other_url)),
        lambda ms: (
            ms[0]["smart_triggerer_groups"] >= 20
            and ms[0]["smart_triggerer_groups"] + ms[1]["smart_triggerer_groups"] == 64
        ),
        120,
        "groups back on the slow one (its limit raised a step every 10 s)",
    )
    log = slow.log_tail(500_000)
    # one episode: shedding began once and ended once (no flapping between the two)
    assert log.count("over a limit: taking no new shards") == 1, log[-5000:]
    assert log.count("back under the limits") == 1
    resume_all_once(stack, flag, seeded, [slow_url, other_url])


def test_shards_are_spread_by_load_not_by_job_id(stack: AirflowStack, tmp_path: Path) -> None:
    """Four instances of equal capacity hold 4 of 16 shards each (plain rendezvous hashing over small job
    ids gave one of them 28 of 64). Ten groups on every shard: with waits at random (the flag's path
    differs per run) four shards could weigh more than a share, and placement by load rightly moved one.
    Ten, not fewer: a shard's count is published again only when it moves by ``LOAD_STEP`` (5), so a count
    taken while a peer still hashed its rows may stay a few short, which ten per shard absorbs (four shards
    stay within a share and its margin)."""
    flag = tmp_path / "go"
    seeded = seed_even_flag_waits(stack, flag, 10)
    components = [start(stack, f"smart-{n}") for n in range(4)]
    urls = [health_url(c) for c in components]
    spread = wait_for(
        lambda: [metrics(u) for u in urls],
        lambda ms: (
            sorted(m["smart_triggerer_shards_owned"] for m in ms) == [4, 4, 4, 4]
            and sum(m["smart_triggerer_coroutines"] for m in ms) == len(seeded.ti_ids)
        ),
        90,
        "4 shards each",
    )
    assert len(spread) == SHARDS // 4
    resume_all_once(stack, flag, seeded, urls)


def test_a_join_and_a_leave_move_only_the_shards_they_must(stack: AirflowStack, tmp_path: Path) -> None:
    """A fourth instance joining three takes shards and at most one shard passes between the three; its
    graceful leave hands back the shards it held and at most one more (bounded-load placement with
    minimal moves). 40 groups on every shard: with waits at random (the flag's path differs per run) a
    spread that packs unevenly could move a second shard now and then (uneven loads are unit-tested over
    seeded spreads in tests/unit/test_placement.py)."""
    dsn = stack.config.database_dsn
    flag = tmp_path / "go"
    seeded = seed_even_flag_waits(stack, flag, 40)
    waits = len(seeded.ti_ids)
    components = [start(stack, f"smart-{n}") for n in range(3)]
    urls = [health_url(c) for c in components]
    wait_for(
        lambda: [metrics(u) for u in urls],
        lambda ms: sum(m["smart_triggerer_coroutines"] for m in ms) == waits,
        120,
        "every group running",
    )
    before = settled_owners(dsn)
    handed_before = sum(metrics(u)["smart_triggerer_shards_handed_over_total"] for u in urls)

    joiner = start(stack, "joiner")
    joiner_url = health_url(joiner)
    joiner_job = int(
        wait_for(
            lambda: httpx.get(f"{joiner_url}/health", timeout=5).json().get("job_id"),
            bool,
            60,
            "the joiner's job id",
        )
    )
    wait_for(lambda: lease_owners(dsn), lambda o: joiner_job in o.values(), 60, "the joiner owning shards")
    joined = settled_owners(dsn)
    moved = {shard for shard, owner in joined.items() if before[shard] != owner}
    assert any(joined[shard] == joiner_job for shard in moved), "a joiner of equal capacity takes a share"
    # at most one shard passes between the others (one whose weight fits neither its owner's new share
    # nor what the joiner has left: placement.py, unit-tested over seeded loads)
    between = {shard for shard in moved if joined[shard] != joiner_job}
    assert len(between) <= 1, f"shards moved between the other instances on a join: {before} -> {joined}"
    # the moves as each instance counts them: what the joiner took, the others handed over
    taken = metrics(joiner_url)["smart_triggerer_shards_taken_total"]
    handed = sum(metrics(u)["smart_triggerer_shards_handed_over_total"] for u in urls) - handed_before
    assert handed == len(moved) and taken == len(moved) - len(between), (taken, handed, moved, between)

    joiner.signal(signal.SIGTERM)
    assert joiner.process is not None
    joiner.process.wait(60)
    left = settled_owners(dsn)
    moved = {shard for shard, owner in left.items() if joined[shard] != owner}
    leavers = {shard for shard, owner in joined.items() if owner == joiner_job}
    assert leavers <= moved and len(moved - leavers) <= 1, (
        f"a leave moved other shards than the leaver's: {joined} -> {left}"
    )
    resume_all_once(stack, flag, seeded, urls)


def test_while_an_older_release_is_live_every_instance_places_shards_as_it_does(
    stack: AirflowStack, tmp_path: Path
) -> None:
    """A rolling upgrade: an instance of the previous release (placement 1, rendezvous by capacity) is live,
    so the new one computes that placement too (the fleet agrees on one map); once it has left, the new
    one places by load again."""
    dsn = stack.config.database_dsn
    flag = tmp_path / "go"
    seeded = seed_flag_waits(stack, flag, 16)
    new = start(stack, "new", capacity=1000)
    url = health_url(new)
    wait_for(
        lambda: metrics(url),
        lambda m: m.get("smart_triggerer_shards_owned") == SHARDS,
        60,
        "the new instance alone owning every shard",
    )
    job = _job_id(url)
    old_job = job + 1000
    while not 0 < len(shards_of(job, assign(SHARDS, [Member(job, 1000), Member(old_job, 1000)]))) < SHARDS:
        old_job += 1  # a job id that rendezvous gives some shards and not all (almost any)
    # the previous release's register_instance: no placement column, so the default (1)
    execute(
        dsn,
        "INSERT INTO smart_triggerer.instance (job_id, hostname, capacity) VALUES (%s, %s, 1000)",
        old_job,
        "old-release",
    )
    beating = threading.Event()

    def heartbeat() -> None:
        while not beating.wait(1.0):
            execute(
                dsn, "UPDATE smart_triggerer.instance SET heartbeat_at = now() WHERE job_id = %s", old_job
            )

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        expected = shards_of(job, assign(SHARDS, [Member(job, 1000), Member(old_job, 1000)]))
        assert 0 < len(expected) < SHARDS
        wait_for(
            lambda: {s for s, o in lease_owners(dsn).items() if o == job},
            lambda mine: mine == expected,
            60,
            "the new instance holding its rendezvous shards only",
        )
    finally:
        beating.set()
        thread.join(5)
    # the old one's membership lapses: load-following placement again, every shard here
    wait_for(lambda: lease_owners(dsn), lambda o: set(o.values()) == {job}, 60, "every shard back")
    resume_all_once(stack, flag, seeded, [url])


def _job_id(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=5).json()["job_id"])


def test_an_instance_over_its_memory_limit_hands_shards_over_while_that_helps(
    stack: AirflowStack, tmp_path: Path
) -> None:
    """``max_rss_mb`` below what a supervisor and its runner need: alone, the instance still runs every
    wait (the fleet is full); once another instance joins, it hands a step of its groups over. CPython
    does not give the memory of those groups back, so it stops there (rather than hand over everything
    and sit idle), takes nothing new and says so once."""
    flag = tmp_path / "go"
    seeded = seed_flag_waits(stack, flag, 32)
    tight = start(stack, "tight", MAX_RSS_MB="50")  # far below any supervisor's RSS
    tight_url = health_url(tight)
    alone = wait_for(
        lambda: metrics(tight_url),
        lambda m: m.get("smart_triggerer_coroutines") == 32 and m.get("smart_triggerer_accepting") == 0,
        60,
        "all 32 groups on the one shedding",
    )
    assert alone["smart_triggerer_rss_mb"] > 50 and alone["smart_triggerer_fleet_full"] == 1
    row = next(i for i in instances(stack).values() if not i["accepting"])
    assert str(row["shedding"]).startswith("memory"), row

    roomy = start(stack, "roomy")
    roomy_url = health_url(roomy)
    held = wait_for(
        lambda: (metrics(roomy_url), metrics(tight_url), tight.log_tail(200_000)),
        lambda got: (
            "memory not given back" in got[2]
            and got[0]["smart_triggerer_coroutines"] + got[1]["smart_triggerer_coroutines"] == 32
        ),
        90,
        "a step handed over, then the tight one holding",
    )
    # the first step: down to three quarters (24) or below, by whole shards; not everything
    assert 0 < held[1]["smart_triggerer_groups"] <= 24 and held[1]["smart_triggerer_accepting"] == 0
    assert held[2].count("memory not given back") == 1
    row = next(i for i in instances(stack).values() if not i["accepting"])
    assert "holding" in str(row["shedding"]), row
    resume_all_once(stack, flag, seeded, [roomy_url, tight_url])
