"""Two Airflow deployments on this machine (two metadata databases, two api-servers): A's outbox, the
relay, B's inbox. A producer in A runs B's consumer exactly once; crashes, B's downtime, wrong credentials
and bad payloads lose nothing and create nothing twice."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dataset_bridge import signing
from devkit.devstack import AirflowStack
from tests.helpers.waiting import rows, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).parents[2]
PRODUCER = """
import pendulum
from airflow.sdk import DAG, Asset, task

with DAG(dag_id="publish_users", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    @task(outlets=[Asset("warehouse://dds/h_user")])
    def publish():
        return "loaded"

    @task(outlets=[Asset("warehouse://dds/other")])
    def publish_other():
        return "loaded"

    publish()
    publish_other()
"""
CONSUMER = """
import pendulum
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset

with DAG(dag_id="users_in_b", schedule=[Asset("warehouse://dds/h_user")],
         start_date=pendulum.datetime(2024, 1, 1), catchup=False):
    EmptyOperator(task_id="consume")
"""


def _b_events(dsn: str) -> list[int]:
    """Source event ids of B's relayed events, in the order B created them."""
    return [
        int(r[0])
        for r in rows(dsn, "SELECT CAST(extra AS jsonb) ->> 'source_event_id' FROM asset_event ORDER BY id")
    ]


def _emit_in_a(stack: AirflowStack, uri: str, count: int) -> list[int]:
    with stack.client() as client:
        assets = client.get("/assets", params={"uri_pattern": uri}).json()["assets"]
        asset_id = next(a["id"] for a in assets if a["uri"] == uri)
        ids = []
        for n in range(count):
            response = client.post("/assets/events", json={"asset_id": asset_id, "extra": {"n": n}})
            response.raise_for_status()
            ids.append(int(response.json()["id"]))
    return ids


def _outbox(dsn: str) -> dict[str, int]:
    return {
        str(r[0]): int(r[1])
        for r in rows(dsn, "SELECT status, count(*) FROM dataset_bridge.outbox GROUP BY status")
    }


def _post(url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url, content=body, headers={"Content-Type": "application/json", **headers}, timeout=30)


def _check_refusals(inbox_url: str, secret: str, b_dsn: str) -> None:
    before = _b_events(b_dsn)
    event = {
        "id": 999999,
        "uri": "warehouse://dds/h_user",
        "name": "warehouse://dds/h_user",
        "extra": {},
        "timestamp": "2026-01-01T00:00:00+00:00",
    }
    good = json.dumps({"source": "deployment_a", "events": [event]}).encode()
    wrong = _post(inbox_url, good, signing.sign("deployment_a", "not-the-secret", good))
    assert wrong.status_code == 401 and "bad signature" in wrong.json()["detail"]
    stale = _post(inbox_url, good, signing.sign("deployment_a", secret, good, now=time.time() - 3600))
    assert stale.status_code == 401 and "window" in stale.json()["detail"]
    unsigned = _post(inbox_url, good, {})
    assert unsigned.status_code == 401
    not_json = b"{not json"
    assert _post(inbox_url, not_json, signing.sign("deployment_a", secret, not_json)).status_code == 400
    shape = json.dumps({"source": "deployment_a", "events": [{"id": "x"}]}).encode()
    bad_shape = _post(inbox_url, shape, signing.sign("deployment_a", secret, shape))
    assert bad_shape.status_code == 422 and "not an event batch" in bad_shape.json()["detail"]
    oversized = {"source": "deployment_a", "events": [{**event, "extra": {"x": "y" * 2_000_000}}]}
    huge = json.dumps(oversized).encode()
    assert _post(inbox_url, huge, signing.sign("deployment_a", secret, huge)).status_code == 413
    # chunked: no Content-Length to refuse up front, so the inbox must stop reading at the limit (the
    # headers a caller anyone can be writes pass the checks made before the body is read)
    anyones = signing.sign("deployment_a", "not the secret", b"")
    chunked = httpx.post(
        inbox_url,
        content=(b"x" * 65536 for _ in range(64)),
        timeout=30,
        headers={"Content-Type": "application/json", **anyones},
    )
    assert chunked.status_code == 413
    # without signature headers it is refused before its body is read
    unsigned_chunked = httpx.post(
        inbox_url,
        content=(b"x" * 65536 for _ in range(64)),
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert unsigned_chunked.status_code == 401
    non_ascii = {**signing.sign("deployment_a", secret, good), "X-Bridge-Signature": "sha256=\u00e9"}
    assert (
        httpx.post(
            inbox_url,
            content=good,
            timeout=30,
            # bytes values, as a client sends a raw non-ASCII header (httpx takes them; its types do not)
            headers={k: v.encode("latin-1") for k, v in non_ascii.items()},  # type: ignore[arg-type]
        ).status_code
        == 401
    )
    # a well-signed event for an asset this source is not allowed: refused alone, naming it
    payroll = json.dumps(
        {"source": "deployment_a", "events": [{**event, "uri": "warehouse://dds/payroll", "name": "payroll"}]}
    ).encode()
    not_allowed = _post(inbox_url, payroll, signing.sign("deployment_a", secret, payroll))
    assert not_allowed.status_code == 200, not_allowed.text
    [refusal] = not_allowed.json()["results"]
    assert refusal["status"] == "forbidden" and "payroll" in refusal["error"]
    assert _b_events(b_dsn) == before  # nothing created by any of them


def _relay_status(stack: AirflowStack, env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("dataset-bridge")), "relay-status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {t["target"]: t for t in json.loads(result.stdout.strip().splitlines()[-1])["targets"]}


# a scenario of many steps, each with its own limit: 200-290 s on a slow 2-core machine with the
# parallel phase's other tests, over the suite's default limit of five minutes
@pytest.mark.timeout(600)
def test_events_cross_deployments_exactly_once_through_crashes_downtime_and_bad_requests(
    airflow_stack: AirflowStack, second_airflow_stack: AirflowStack, tmp_path: Path
) -> None:
    a, b = airflow_stack, second_airflow_stack
    secret = secrets.token_urlsafe(32)
    inbox_url = f"{b.config.api_url}/dataset-bridge/inbox"
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        textwrap.dedent(f"""
        source: deployment_a
        targets:
          deployment_b:
            url: {inbox_url}
            secret_env: BRIDGE_SECRET_B
            assets: [warehouse://dds/h_user]
            max_attempts: 100
          deployment_c:
            url: {inbox_url}
            secret_env: BRIDGE_SECRET_C
            assets: [warehouse://dds/other]
            max_attempts: 2
    """)
    )
    a.config.extra.update(
        {
            "AIRFLOW__CORE__ASSET_MANAGER_CLASS": "dataset_bridge.asset_manager.OutboxAssetManager",
            "AIRFLOW__CORE__ASSET_MANAGER_KWARGS": json.dumps({"routes": str(routes)}),
        }
    )
    b.config.extra["AIRFLOW__DATASET_BRIDGE__INBOX_SECRETS"] = json.dumps({"deployment_a": secret})
    b.config.extra["AIRFLOW__DATASET_BRIDGE__INBOX_ALLOWED_ASSETS"] = json.dumps(
        {"deployment_a": ["uri:warehouse://dds/h_user", "uri:warehouse://dds/other"]}
    )
    (a.config.dags_folder / "publish_users.py").write_text(textwrap.dedent(PRODUCER))
    (b.config.dags_folder / "users_in_b.py").write_text(textwrap.dedent(CONSUMER))
    relay_env = {"BRIDGE_SECRET_B": secret, "BRIDGE_SECRET_C": "a-wrong-secret"}
    a.start_core()
    b.start_core()
    a.wait_for_dags(["publish_users"])
    b.wait_for_dags(["users_in_b"])
    a.unpause("publish_users")
    b.unpause("users_in_b")
    relay_args = ["--routes", str(routes), "--backoff-cap", "3"]
    relay = a.add_relay(relay_args, relay_env)
    a_dsn, b_dsn = a.config.database_dsn, b.config.database_dsn

    # 1. producer in A -> consumer in B, exactly once; the "other" event goes to C with a wrong secret
    run_id = a.trigger("publish_users")
    assert a.wait_for_run("publish_users", run_id, timeout=120) == "success"
    wait_for(
        lambda: rows(b_dsn, "SELECT count(*) FROM dag_run WHERE dag_id = 'users_in_b'")[0][0],
        lambda n: n == 1,
        90,
        "B's consumer to run",
    )
    first = [
        int(r[0])
        for r in rows(
            a_dsn,
            "SELECT e.id FROM asset_event e JOIN asset s "
            "ON s.id = e.asset_id WHERE s.uri = 'warehouse://dds/h_user'",
        )
    ]
    assert _b_events(b_dsn) == first
    wait_for(
        lambda: _relay_status(a, {**a.config.env(), **relay_env}).get("deployment_c", {}).get("dead"),
        lambda dead: dead == 1,
        60,
        "the wrongly authenticated event to be dead-lettered",
    )
    dead = _relay_status(a, {**a.config.env(), **relay_env})["deployment_c"]
    assert "401" in dead["last_error"] and "bad signature" in dead["last_error"]

    # 2. wrong credentials, malformed and oversized payloads: 4xx with the reason, nothing created
    _check_refusals(inbox_url, secret, b_dsn)

    # 3. the relay dies after B accepted a batch, before marking it: redelivered, never doubled
    a.retire(relay)
    crash_ids = _emit_in_a(a, "warehouse://dds/h_user", 5)
    crashed = subprocess.run(
        [sys.executable, "-m", "tests.helpers.crashing_relay", str(routes)],
        env={**a.config.env(), **relay_env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert crashed.returncode == 9, crashed.stdout + crashed.stderr
    assert _b_events(b_dsn) == first + crash_ids
    assert _outbox(a_dsn).get("pending", 0) == 5
    relay = a.add_relay(relay_args, relay_env, name="relay-2")
    wait_for(lambda: _outbox(a_dsn).get("pending", 0), lambda n: n == 0, 60, "the redelivery")
    assert _b_events(b_dsn) == first + crash_ids

    # 4. B down until the relay has failed to deliver twice: delivered after it returns, in order
    b.retire(next(c for c in b.components if c.name == "api-server"))
    down_ids = _emit_in_a(a, "warehouse://dds/h_user", 3)
    attempts = "SELECT min(attempts) FROM dataset_bridge.outbox WHERE status = 'pending'"
    wait_for(lambda: rows(a_dsn, attempts)[0][0] or 0, lambda n: n >= 2, 60, "two failed deliveries")
    assert _outbox(a_dsn).get("pending", 0) == 3
    b.start_api_server()
    b.wait_healthy(["metadatabase"])
    wait_for(
        lambda: _b_events(b_dsn),
        lambda ids: ids == first + crash_ids + down_ids,
        90,
        "the events made while B was down, in order",
    )
    status = _relay_status(a, {**a.config.env(), **relay_env})
    assert status["deployment_b"]["delivered"] == 1 + 5 + 3 and status["deployment_b"]["backlog"] == 0
    assert status["deployment_b"]["dead"] == 0
