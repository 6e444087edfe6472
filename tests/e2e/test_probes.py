"""What a deployment probes: Airflow's own `airflow jobs check` (the Helm chart's triggerer probe) and /health
served on a non-loopback address for Kubernetes and Prometheus."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx
import psutil
import pytest

from devkit.devstack import AirflowStack

pytestmark = pytest.mark.e2e

TOKEN = "probe-token-for-tests"
# The chart runs `airflow jobs check --job-type TriggererJob --hostname $(hostname)`; Airflow records a
# job's host with [core] hostname_callable, so both must name the host the same way.
HOST_ENV = {
    "AIRFLOW__CORE__HOSTNAME_CALLABLE": "socket.gethostname",
    "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "6",
}


def non_loopback_ipv4() -> str:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)  # psutil is untyped here
    raise AssertionError("this machine has no non-loopback IPv4 address; the test needs one")


BY_HOSTNAME = '--hostname "$(hostname)"'


def jobs_check(stack: AirflowStack, where: str = BY_HOSTNAME) -> subprocess.CompletedProcess[str]:
    """The chart's probe: ``--hostname $(hostname)`` (older charts) or ``--local`` (newer ones)."""
    command = f'exec "$AIRFLOW_BIN" jobs check --job-type TriggererJob {where}'
    env = {**stack.config.env(), **HOST_ENV, "AIRFLOW_BIN": stack.config.airflow_bin()}
    return subprocess.run(
        ["sh", "-c", command], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise AssertionError(f"not {what} after {timeout:.0f}s")


def test_the_charts_probe_and_a_network_health_endpoint(airflow_stack: AirflowStack) -> None:
    host = non_loopback_ipv4()
    env = {**HOST_ENV, "AIRFLOW__SMART_TRIGGERER__HEALTH_TOKEN": TOKEN}
    triggerer = airflow_stack.start_smart_triggerer(env=env, health_host=host)
    wait_until(lambda: any(i["healthy"] for i in airflow_stack.smart_status()["instances"]), 90, "registered")
    url = airflow_stack.smart_status()["instances"][0]["health_url"]
    assert url.startswith(f"http://{host}:"), url

    # /health on the machine's network address: refused without the token, served with it
    assert httpx.get(f"{url}/health", timeout=10).status_code == 401
    wrong = httpx.get(f"{url}/health", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert wrong.status_code == 401
    wait_until(
        lambda: (
            httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code
            == 200
        ),
        30,
        "healthy",
    )
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert metrics.status_code == 200 and "smart_triggerer_shards_owned" in metrics.text
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{url.rsplit(':', 1)[1]}/health", timeout=5)

    # the chart's liveness probe passes for the live instance ...
    for where in (BY_HOSTNAME, "--local"):
        alive = jobs_check(airflow_stack, where)
        assert alive.returncode == 0 and "Found one alive job" in alive.stdout, (where, alive.stderr[-2000:])

    # ... and fails once it is dead (no heartbeat for longer than the threshold)
    triggerer.signal(signal.SIGKILL)
    wait_until(lambda: jobs_check(airflow_stack).returncode != 0, 60, "reported dead")
    dead = jobs_check(airflow_stack)
    assert "No alive jobs found" in dead.stderr + dead.stdout
