"""Airflow 3.3 multi-team: a team's waits run only on that team's instances, never in a coroutine shared
with another team's identical wait, on real processes.

Two teams defer identical waits (``TeamMarkTrigger``: the same moment); each team's instance runs with
its own environment (``TEAM_MARK``), which the event carries. What is checked is what the database holds:
each task resumed once (the audit trigger) with its own team's mark, each team's shard space held only by
its instances, and the combinations Airflow's triggerer refuses refused with one line and an exit code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from devkit.devstack import AirflowStack
from tests.helpers.chaos.databases import AUDIT_DDL
from tests.helpers.waiting import rows, ti_states, wait_for
from tests.integration.test_smart_triggerer import ENV, in_seconds, metrics, next_kwargs, seed

TEAM_MARK = "tests.helpers.triggers.TeamMarkTrigger"
PER_TEAM = 6


@pytest.fixture
def teams(airflow_stack: AirflowStack) -> Iterator[AirflowStack]:
    rows(
        airflow_stack.config.database_dsn,
        AUDIT_DDL + "; INSERT INTO team (name) VALUES ('alpha'), ('beta') RETURNING 1",
    )
    yield airflow_stack


def test_identical_waits_of_two_teams_run_apart_each_with_its_own_payload(teams: AirflowStack) -> None:
    dsn = teams.config.database_dsn
    moments = [in_seconds(30 + k) for k in range(2)]  # two identities, each waited on by both teams
    seeded = seed(teams, 2 * PER_TEAM, TEAM_MARK, lambda i: {"moment": moments[i % 2]})
    team_of = {i: "alpha" if i < PER_TEAM else "beta" for i in range(2 * PER_TEAM)}
    rows(
        dsn,
        "UPDATE trigger t SET team_name = CASE WHEN ti.map_index < %s THEN 'alpha' ELSE 'beta' END "
        "FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.dag_id = %s RETURNING 1",
        PER_TEAM,
        seeded.dag_id,
    )
    alpha = teams.start_smart_triggerer("smart-alpha", team_name="alpha", env={**ENV, "TEAM_MARK": "alpha"})
    beta = teams.start_smart_triggerer("smart-beta", team_name="beta", env={**ENV, "TEAM_MARK": "beta"})
    urls = {"alpha": alpha.health_url(30), "beta": beta.health_url(30)}
    running = wait_for(
        lambda: {t: metrics(u) for t, u in urls.items()},
        lambda m: all(v.get("smart_triggerer_waiters") == PER_TEAM for v in m.values()),
        60,
        "each team's instance runs its own team's waits",
    )
    for team, values in running.items():
        assert values["smart_triggerer_groups"] == 2, (team, values)  # its own two, not the other's
    spaces = dict(
        rows(
            dsn,
            "SELECT DISTINCT i.queues, i.job_id FROM smart_triggerer.instance i WHERE i.stopped_at IS NULL",
        )
    )
    assert set(spaces) == {"@alpha", "@beta"}, spaces
    for space, job in spaces.items():
        owners = {
            o
            for (o,) in rows(
                dsn, "SELECT DISTINCT owner_job_id FROM smart_triggerer.shard_lease WHERE queues = %s", space
            )
        }
        assert owners == {job}, (space, owners)

    wait_for(
        lambda: ti_states(dsn, seeded.dag_id),
        lambda s: set(s.values()) == {"scheduled"},
        90,
        "every task resumed",
    )
    for map_index, value in next_kwargs(dsn, seeded.dag_id).items():
        assert value["event"] == {"moment": moments[map_index % 2], "ran_in": team_of[map_index]}, value
    resolved = Counter(
        ti for ti, op in rows(dsn, "SELECT ti_id::text, op FROM chaos.ti_audit WHERE op = 'resolved'")
    )
    assert len(resolved) == 2 * PER_TEAM and set(resolved.values()) == {1}, resolved
    assert sum(metrics(u)["smart_triggerer_events_total"] for u in urls.values()) == 4  # 2 per team


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--team-name", "alpha"], {"AIRFLOW__CORE__MULTI_TEAM": "False"}, "[core] multi_team is True"),
        (["--team-name", "gamma"], {"AIRFLOW__CORE__MULTI_TEAM": "True"}, "no such team"),
        (["--queues", "reports"], {"AIRFLOW__TRIGGERER__QUEUES_ENABLED": "False"}, "queues_enabled is True"),
        (["--queues", ",,"], {"AIRFLOW__TRIGGERER__QUEUES_ENABLED": "True"}, "has an empty queue name"),
    ],
    ids=["team-without-multi-team", "unknown-team", "queues-not-enabled", "empty-queue-names"],
)
def test_what_airflow_refuses_is_refused_in_one_line(
    teams: AirflowStack, args: list[str], env: dict[str, str], said: str
) -> None:
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [str(Path(sys.executable).with_name("smart-triggerer")), "run", "--skip-serve-logs", *args],
        env={**teams.config.env(), **ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and said in errors[0], done.stderr[-2000:]
