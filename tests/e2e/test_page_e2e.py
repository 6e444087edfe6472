"""The Smart Triggerer page on the real stack: the api-server with the plugin (and Airflow's own
authentication), two smart triggerers, seeded waiters in groups, and Debian's Chromium driven headless."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import AirflowStack
from tests.helpers.auth import HIDDEN_PREFIX, LIMITED_USER, OUTSIDER
from tests.helpers.seeding import seed_deferred
from tests.helpers.waiting import rows, wait_for

# also against the lowest supported Airflow (dev.py test --airflow): it exercises Airflow's internals
pytestmark = [pytest.mark.e2e, pytest.mark.lowest_airflow]

AT_TIME = "tests.helpers.triggers.AtTimeTrigger"
ENV = {"AIRFLOW__SMART_TRIGGERER__SHARDS": "16", "AIRFLOW__SMART_TRIGGERER__LEASE_SECONDS": "6"}
PASSWORDS = {"admin": "admin-password", LIMITED_USER: "limited-password", OUTSIDER: "outsider-password"}
# where the page's screenshot is kept (CI keeps it with the run's other artifacts)
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("SMART_TRIGGERER_ARTIFACTS") or ROOT / ".artifacts")
# Chromium flags for a closed network and a root user (background networking would only be refused)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def moment(days: int) -> str:
    return (dt.datetime(2099, 1, 1, tzinfo=dt.UTC) + dt.timedelta(days=days)).isoformat()


def configure_auth(stack: AirflowStack) -> None:
    """Real logins (Airflow's SimpleAuthManager: admin, and limited who may not read hidden_ DAGs)."""
    stack.config.all_admins = False
    (stack.config.home / "passwords.json").write_text(json.dumps(PASSWORDS))
    stack.config.extra.update(
        {
            "AIRFLOW__CORE__AUTH_MANAGER": "tests.helpers.auth.LimitedAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": (
                f"admin:admin,{LIMITED_USER}:viewer,{OUTSIDER}:viewer"
            ),
            "PYTHONPATH": str(ROOT),  # the auth manager and the test trigger live in tests/helpers
        }
    )


def token(stack: AirflowStack, user: str) -> str:
    response = httpx.post(
        f"{stack.config.api_url}/auth/token", timeout=30, json={"username": user, "password": PASSWORDS[user]}
    )
    assert response.status_code == 201, response.text
    return str(response.json()["access_token"])


def get(stack: AirflowStack, path: str, bearer: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    return httpx.get(f"{stack.config.api_url}/smart-triggerer/{path}", headers=headers, timeout=30)


def get_json(stack: AirflowStack, path: str, bearer: str) -> Any:
    response = get(stack, path, bearer)
    assert response.status_code == 200, (path, response.status_code, response.text)
    return response.json()


def groups_in_database(dsn: str, dag_ids: set[str]) -> list[int]:
    """Group sizes straight from the tables (deferred tasks by identity), biggest first."""
    found = rows(
        dsn,
        "SELECT i.identity_hash, ti.dag_id FROM smart_triggerer.trigger_identity i "
        "JOIN task_instance ti ON ti.trigger_id = i.trigger_id AND ti.state = 'deferred'",
    )
    return sorted(Counter(h for h, dag_id in found if dag_id in dag_ids).values(), reverse=True)


def full_overview(stack: AirflowStack, bearer: str) -> Any:
    """The overview once it counts every waiter: 15 in 3 groups."""
    return wait_for(
        lambda: get_json(stack, "api/overview", bearer),
        lambda o: (o["totals"]["waiters"], o["totals"]["groups"]) == (15, 3),
        60,
        "the overview to count 15 waiters in 3 groups",
    )


def seed_waiters(stack: AirflowStack) -> dict[str, list[int]]:
    """visible_a: 7 tasks on day 1, 3 on day 2; hidden_b: 4 on day 1, 1 on day 3 (groups 11, 3, 1)."""
    dsn, dags = stack.config.database_dsn, stack.config.dags_folder
    plan = {"visible_a": [1] * 7 + [2] * 3, f"{HIDDEN_PREFIX}b": [1] * 4 + [3]}
    for dag_id, days in plan.items():
        seed_deferred(
            dsn,
            dags,
            count=len(days),
            classpath=AT_TIME,
            dag_id=dag_id,
            # the default binds this loop's days; mypy cannot infer a lambda with a default
            kwargs_for=lambda i, days=days: {"moment": moment(days[i]), "poll_interval": 30},  # type: ignore[misc]
        )
    return plan


def test_the_page_and_its_api_show_instances_and_groups_to_signed_in_users(
    airflow_stack: AirflowStack,
) -> None:
    configure_auth(airflow_stack)
    plan = seed_waiters(airflow_stack)
    airflow_stack.start_api_server()
    airflow_stack.wait_healthy(["metadatabase"])
    airflow_stack.start_smart_triggerer("smart-1", env=ENV)
    airflow_stack.start_smart_triggerer("smart-2", env=ENV)
    wait_for(
        lambda: airflow_stack.smart_status()["totals"],
        lambda t: (
            t["waiters"] == 15
            and t["groups"] == 3
            and t["instances"] == 2
            and t["shards_owned"] == t["shards"]
        ),
        120,
        "two instances serving 15 waiters in 3 groups",
    )

    # no credentials, or a forged token: refused, for the API and the page alike
    for path in ("api/overview", "api/groups", "ui/"):
        assert get(airflow_stack, path).status_code == 401, path
        assert get(airflow_stack, path, bearer="not-a-token").status_code in (401, 403), path
    for path in ("docs", "redoc", "openapi.json"):  # FastAPI's defaults would serve these to anyone
        assert get(airflow_stack, path).status_code == 404, path

    admin = token(airflow_stack, "admin")
    # each instance publishes its counts with its heartbeat: while placement still moves a shard to the
    # instance that joined second, its waiters are counted by neither for a moment (CI on 3.3.1: 14)
    overview = full_overview(airflow_stack, admin)
    assert sorted(i["host"] for i in overview["instances"] if i["healthy"]) == sorted(
        r[0]
        for r in rows(
            airflow_stack.config.database_dsn,
            "SELECT hostname FROM smart_triggerer.instance WHERE stopped_at IS NULL",
        )
    )
    groups = get_json(airflow_stack, "api/groups?limit=2&offset=0", admin)
    assert groups["total"] == 3
    assert (
        [g["members"] for g in groups["groups"]]
        == groups_in_database(airflow_stack.config.database_dsn, set(plan))[:2]
        == [11, 3]
    )
    biggest = groups["groups"][0]
    assert biggest["waits_on"] == f"the time {moment(1)}" and biggest["dags"] == 2
    assert biggest["serving_instance"] is not None
    assert {m["dag_id"] for m in biggest["first_members"]} == set(plan)
    last = get_json(airflow_stack, "api/groups?limit=2&offset=2", admin)
    assert [g["members"] for g in last["groups"]] == [1]

    # a user who may not read hidden_b sees neither its tasks nor the group only its tasks make up
    limited_token = token(airflow_stack, LIMITED_USER)
    limited = get_json(airflow_stack, "api/groups", limited_token)
    assert (
        [g["members"] for g in limited["groups"]]
        == groups_in_database(airflow_stack.config.database_dsn, {"visible_a"})
        == [7, 3]
    )
    assert all(m["dag_id"] == "visible_a" for g in limited["groups"] for m in g["first_members"])
    # limited may view triggers: the deployment-wide counts
    assert full_overview(airflow_stack, limited_token)["totals"]["waiters"] == 15
    # a user who may view neither triggers nor any DAG: no deployment-wide counts, no group
    outsider = token(airflow_stack, OUTSIDER)
    assert get(airflow_stack, "api/overview", outsider).status_code == 403
    nothing = {"total": 0, "limit": 50, "offset": 0, "groups": []}
    assert get_json(airflow_stack, "api/groups", outsider) == nothing

    text, instance_rows, outsider_text = open_page_in_chromium(airflow_stack)
    assert "of 0 groups" in outsider_text and "healthy instances" not in outsider_text, outsider_text
    assert f"the time {moment(1)}" in text and "11 tasks" in text
    jobs = sorted(str(i["job_id"]) for i in overview["instances"])
    assert sorted(row.split("\t")[0] for row in instance_rows) == jobs and len(jobs) == 2, instance_rows
    for host in {i["host"] for i in overview["instances"]}:
        assert host in text
    # each instance's load as placement reads it: groups against capacity, and whether it takes shards.
    # Which instance holds which group may change after the overview above (placement still settling
    # the join: CI on 3.3.1 saw the lone group move), so the page's own numbers are checked as a whole.
    loads = [row.split("\t")[5] for row in instance_rows]
    assert sum(int(load.split(" / ")[0]) for load in loads) == 3, loads
    for instance in overview["instances"]:
        assert instance["accepting"] is True and instance["capacity"] > 0, instance
    assert sorted(int(load.split(" / ")[1]) for load in loads) == sorted(
        i["capacity"] for i in overview["instances"]
    ), loads
    assert text.count("taking shards") == 2, text
    # the runner's loop lag and the instance's memory, as each instance reported them with its heartbeat
    for row in instance_rows:
        lag, rss = row.split("\t")[6:8]
        assert re.fullmatch(r"\d+ ms", lag) and re.fullmatch(r"[1-9]\d* MB", rss), row


LOADS_COUNT_EVERY_GROUP = """(groups) => {
    const rows = [...document.querySelectorAll('#instances tbody tr')];
    const loads = rows.map((row) => Number((row.cells[5]?.innerText || '').split(' / ')[0]));
    return rows.length === 2 && loads.reduce((sum, n) => sum + n, 0) === groups;
}"""


def open_page_in_chromium(stack: AirflowStack) -> tuple[str, list[str], str]:
    """Sign in on Airflow's login page, open "Smart Triggerer" from the navigation, return the page's text
    and its instance rows once it rendered; the screenshot is kept in ARTIFACTS. Then follow a task link:
    Airflow's UI must show that task instance. Last, the page as the outsider sees it."""
    from playwright.sync_api import sync_playwright

    chromium = os.environ.get("SMART_TRIGGERER_CHROMIUM") or "/usr/bin/chromium"
    assert Path(chromium).exists(), f"no Chromium at {chromium}: `python3 dev.py test` installs it"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    base = stack.config.api_url
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = _sign_in(browser, base, "admin")
            # from Airflow's own navigation: Browse -> Smart Triggerer
            page.get_by_role("button", name="Browse").click()
            page.get_by_role("menuitem", name="Smart Triggerer").click()
            frame = _page_frame(page)
            try:
                frame.wait_for_selector("#groups tbody tr", timeout=60_000)
                frame.wait_for_selector("#instances tbody tr", timeout=60_000)
                # each instance records a chart point 10 s after start; the page refreshes every 10 s
                frame.wait_for_selector("#chart circle", timeout=60_000)
                # a refresh that counts every group on the instances (not one taken during a shard move)
                frame.wait_for_function(LOADS_COUNT_EVERY_GROUP, arg=3, timeout=60_000)
                frame.locator("#groups details summary").first.click()  # the biggest group's tasks
                frame.wait_for_selector("#groups details[open] li a", timeout=10_000)
                assert frame.url.endswith("/smart-triggerer/ui/"), frame.url
                link = frame.locator("#groups details[open] li a").first
                href = link.get_attribute("href") or ""
                # the oldest member: map index 0 of visible_a's mapped task, in Airflow's own UI
                assert href.startswith(f"{base}/dags/visible_a/runs/"), href
                assert href.endswith("/tasks/wait/mapped/0") and link.get_attribute("target") == "_top", href
            finally:  # kept whether or not the page rendered: what the browser showed is the evidence
                page.screenshot(path=str(ARTIFACTS / "smart-triggerer-page.png"), full_page=True)
            text: str = frame.inner_text("body")
            instance_rows = [r.inner_text() for r in frame.locator("#instances tbody tr").all()]
            link.click()  # in the sandboxed frame: the page hands the URL to the UI's router
            page.wait_for_url(lambda url: url.endswith("/tasks/wait/mapped/0"), timeout=30_000)
            # the UI's router rendered that view: the plugin's frame is gone (a URL change alone is not)
            page.wait_for_function("() => document.querySelectorAll('iframe').length === 0", timeout=30_000)
            # a user who may not view triggers still gets the page: their groups, and why the rest is hidden
            page = _sign_in(browser, base, OUTSIDER)
            page.goto(f"{base}/smart-triggerer/ui/")
            said = "() => document.getElementById('error').textContent.includes('Triggers view')"
            page.wait_for_function(said, timeout=30_000)
            return text, instance_rows, page.inner_text("body")
        except Exception as err:
            shown = "\n".join(f"{f.url}: {f.inner_text('body')[:1500]}" for f in page.frames)
            raise AssertionError(f"{err}\nthe browser showed:\n{shown}") from err
        finally:
            browser.close()


def _sign_in(browser: Any, base: str, user: str) -> Any:
    """A new browser context signed in on Airflow's own login page."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.goto(f"{base}/auth/login", wait_until="networkidle")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", PASSWORDS[user])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(lambda url: "/auth/login" not in url, timeout=60_000)
    return page


def _page_frame(page: Any) -> Any:
    """The page is shown in Airflow's UI as an external view: an iframe of our ``ui/``."""
    iframe = page.wait_for_selector("iframe", timeout=60_000)
    frame = iframe.content_frame()
    assert frame is not None, "the external view has no frame"
    return frame
