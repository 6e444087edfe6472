"""Airflow 3.3 multi-team on the page, on the real stack: the api-server with Airflow's SimpleAuthManager
(users in teams), one smart triggerer per team. A team's instances are shown to that team's users only
(``is_authorized_team``), in the list, the totals and the chart; a group is served from its own team's
shard space; ``smart-triggerer status --team-name`` scopes the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.waiting import rows, wait_for
from tests.integration.test_smart_triggerer import ENV, in_seconds, seed

pytestmark = pytest.mark.e2e

TEAM_MARK = "tests.helpers.triggers.TeamMarkTrigger"
PASSWORDS = {"admin": "admin-password", "alice": "alice-password", "bob": "bob-password"}
ROOT = Path(__file__).resolve().parents[2]


def token(stack: AirflowStack, user: str) -> str:
    response = httpx.post(
        f"{stack.config.api_url}/auth/token", timeout=30, json={"username": user, "password": PASSWORDS[user]}
    )
    assert response.status_code == 201, response.text
    return str(response.json()["access_token"])


def overview(stack: AirflowStack, bearer: str) -> Any:
    response = httpx.get(
        f"{stack.config.api_url}/smart-triggerer/api/overview",
        timeout=30,
        headers={"Authorization": f"Bearer {bearer}"},
    )
    assert response.status_code == 200, response.text
    return response.json()


def groups(stack: AirflowStack, bearer: str) -> Any:
    response = httpx.get(
        f"{stack.config.api_url}/smart-triggerer/api/groups?limit=10",
        timeout=30,
        headers={"Authorization": f"Bearer {bearer}"},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_teams_instances_are_shown_to_its_users_only(airflow_stack: AirflowStack) -> None:
    stack, dsn = airflow_stack, airflow_stack.config.database_dsn
    rows(dsn, "INSERT INTO team (name) VALUES ('alpha'), ('beta') RETURNING 1")
    stack.config.all_admins = False
    (stack.config.home / "passwords.json").write_text(json.dumps(PASSWORDS))
    stack.config.extra.update(
        {
            "AIRFLOW__CORE__MULTI_TEAM": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,alice:viewer:alpha,bob:viewer:beta",
            "PYTHONPATH": str(ROOT),  # the test trigger lives in tests/helpers
        }
    )
    moment = in_seconds(3600)
    seeded = seed(stack, 4, TEAM_MARK, lambda i: {"moment": moment})  # one identity, two teams
    rows(
        dsn,
        "UPDATE trigger t SET team_name = CASE WHEN ti.map_index < 2 THEN 'alpha' ELSE 'beta' END "
        "FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.dag_id = %s RETURNING 1",
        seeded.dag_id,
    )
    stack.start_api_server()
    stack.wait_healthy(["metadatabase"])
    alpha = stack.start_smart_triggerer("smart-alpha", team_name="alpha", env=ENV)
    beta = stack.start_smart_triggerer("smart-beta", team_name="beta", env=ENV)
    jobs = {
        team: int(c.wait_for_log("smart triggerer started").split("job_id=")[1].split()[0])
        for team, c in (("alpha", alpha), ("beta", beta))
    }

    admin = token(stack, "admin")
    every = wait_for(
        lambda: overview(stack, admin),
        lambda o: o["totals"].get("waiters") == 4 and len([i for i in o["instances"] if i["healthy"]]) == 2,
        90,
        "both teams' instances counting their waits",
    )
    assert {i["team"] for i in every["instances"] if i["healthy"]} == {"alpha", "beta"}
    for user, team in (("alice", "alpha"), ("bob", "beta")):
        seen = overview(stack, token(stack, user))
        assert [(i["job_id"], i["team"]) for i in seen["instances"]] == [(jobs[team], team)], seen
        assert seen["totals"]["waiters"] == 2 and seen["totals"]["groups"] == 1, seen["totals"]

    # one identity, two teams: two groups, each served by its own team's instance
    served = wait_for(
        lambda: groups(stack, admin)["groups"],
        lambda g: len(g) == 2 and all(x["serving_instance"]["job_id"] for x in g),
        60,
        "each team's group served",
    )
    assert sorted(g["serving_instance"]["job_id"] for g in served) == sorted(jobs.values())

    status_of_beta = subprocess.run(
        [str(Path(sys.executable).with_name("smart-triggerer")), "status", "--json", "--team-name", "beta"],
        env={**stack.config.env(), "AIRFLOW__CORE__MULTI_TEAM": "True"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    shown = json.loads(status_of_beta.stdout)
    assert [(i["job_id"], i["team"]) for i in shown["instances"]] == [(jobs["beta"], "beta")], shown
