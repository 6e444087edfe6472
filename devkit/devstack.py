"""A real, local Airflow stack: dag-processor, scheduler, api-server and triggerer(s) as processes.

Used by the end-to-end tests, the benchmarks and the demo. Every component runs in a process group of
its own with its output in a log file; stopping the stack signals each group and then kills whatever is
left of each component's process tree (task runners put themselves in groups of their own).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from devkit.pgserver import free_port, sqlalchemy_url

TERMINAL_RUN_STATES = {"success", "failed"}


class StackError(RuntimeError):
    """A component of the local Airflow stack failed or did not become healthy in time."""


def new_fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


@dataclass
class AirflowConfig:
    """Everything that makes one local Airflow deployment: home, database, dags folder, ports, secrets."""

    home: Path
    database_dsn: str
    dags_folder: Path
    fernet_key: str = field(default_factory=new_fernet_key)
    jwt_secret: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    api_port: int = field(default_factory=free_port)
    parallelism: int = 4
    all_admins: bool = True
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def env(self) -> dict[str, str]:
        """The process environment for every Airflow command of this deployment."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
        env.update(
            {
                "AIRFLOW_HOME": str(self.home),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(self.database_dsn),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": "3",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_MAX_OVERFLOW": "6",
                "AIRFLOW__CORE__FERNET_KEY": self.fernet_key,
                "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": str(self.all_admins),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
                "AIRFLOW__API__BASE_URL": self.api_url,
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.api_port),
                "AIRFLOW__API__SECRET_KEY": self.jwt_secret,
                "AIRFLOW__API_AUTH__JWT_SECRET": self.jwt_secret,
                # Several deployments (and the machine's own Airflow) may share this host.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
                # New DAG files are written before the dag-processor starts, but tests add some later.
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
                "AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "2",
                "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "2",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra)
        return env

    def airflow_bin(self) -> str:
        """The ``airflow`` script of the running interpreter's environment."""
        return str(Path(sys.executable).with_name("airflow"))


def migrate(config: AirflowConfig, timeout: float = 300) -> None:
    """Run ``airflow db migrate`` against the deployment's database."""
    config.home.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [config.airflow_bin(), "db", "migrate"],
        env=config.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise StackError(f"airflow db migrate failed ({result.returncode}):\n{result.stderr[-4000:]}")


@dataclass
class Component:
    """One long-running process of the stack and its log file."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str], cwd: Path) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv,
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tree(self) -> list[psutil.Process]:
        """This component's process and all its descendants, whatever group they moved to."""
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def log_tail(self, chars: int = 3000) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-chars:]

    def health_url(self, timeout: float = 30.0) -> str:
        """A smart triggerer's health endpoint, from the line it logs once the port is bound."""
        line = self.wait_for_log("health endpoint listening", timeout)
        return line.split("url=")[1].split()[0]

    def wait_for_log(self, text: str, timeout: float = 60.0) -> str:
        """The first line of this component's log that contains ``text``, once it is there."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_tail(50_000).splitlines():
                if text in line:
                    return line
            if not self.running():
                raise StackError(f"{self.name} exited before logging {text!r}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name} logged no {text!r} in {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.2)


def stop_components(components: Sequence[Component], grace: float = 20.0) -> None:
    """SIGTERM every group, wait up to ``grace`` seconds, then SIGKILL every leftover process."""
    started = [c for c in components if c.process is not None]
    trees = {c.name: c.tree() for c in started}
    for component in started:
        component.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for component in started:
        assert component.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            component.process.wait(max(0.0, deadline - time.monotonic()))
    for component in started:
        component.signal(signal.SIGKILL)
        for proc in trees[component.name]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        assert component.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            component.process.wait(10)
    _, alive = psutil.wait_procs([p for tree in trees.values() for p in tree], timeout=10)
    if alive:
        raise StackError(f"processes survived SIGKILL: {[p.pid for p in alive]}")


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group ``pgid`` (zombies of ours do not count)."""
    for proc in psutil.process_iter(["pid", "status"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if os.getpgid(proc.info["pid"]) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


@dataclass
class AirflowStack:
    """dag-processor, scheduler and api-server (+ triggerers) of one deployment, and a REST client."""

    config: AirflowConfig
    components: list[Component] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        path = self.config.home / "component-logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        """Start one process with the deployment's environment (plus ``env``); stopped with the stack."""
        component = Component(name, argv, self.log_dir / f"{name}.log")
        component.start({**self.config.env(), **(env or {})}, cwd=self.config.home)
        self.components.append(component)
        return component

    def start_core(self) -> None:
        """Start api-server, dag-processor and scheduler and wait until all are healthy."""
        airflow = self.config.airflow_bin()
        self.start_api_server()
        self.add("dag-processor", [airflow, "dag-processor"])
        self.add("scheduler", [airflow, "scheduler", "--skip-serve-logs"])
        self.wait_healthy(["metadatabase", "scheduler", "dag_processor"])

    def start_api_server(self) -> Component:
        return self.add(
            "api-server",
            [
                self.config.airflow_bin(),
                "api-server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.config.api_port),
                "--apps",
                "all",
            ],
        )

    def start_stock_triggerer(self, name: str = "triggerer") -> Component:
        return self.add(name, [self.config.airflow_bin(), "triggerer", "--skip-serve-logs"])

    def start_smart_triggerer(
        self,
        name: str = "smart-triggerer",
        *,
        capacity: int | None = None,
        health_port: int = 0,
        env: dict[str, str] | None = None,
        queues: str | None = None,
        health_host: str | None = None,
        team_name: str | None = None,
        command: Path | None = None,
    ) -> Component:
        """One ``smart-triggerer run`` instance; ``health_port`` 0 picks a free port. ``queues`` turns on
        ``[triggerer] queues_enabled`` and ``team_name`` ``[core] multi_team`` for it, as a user must.
        ``command``: another release's ``smart-triggerer`` (default: this environment's)."""
        argv = [
            str(command or Path(sys.executable).with_name("smart-triggerer")),
            "run",
            "--skip-serve-logs",
            "--health-port",
            str(health_port),
        ]
        if health_host is not None:
            argv += ["--health-host", health_host]
        if capacity is not None:
            argv += ["--capacity", str(capacity)]
        env = dict(env or {})
        if queues is not None:
            argv += ["--queues", queues]
            env.setdefault("AIRFLOW__TRIGGERER__QUEUES_ENABLED", "True")
        if team_name is not None:
            argv += ["--team-name", team_name]
            env.setdefault("AIRFLOW__CORE__MULTI_TEAM", "True")
        return self.add(name, argv, env)

    def start_bridge(
        self, name: str = "dataset-bridge", args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> Component:
        """One ``dataset-bridge run`` process (mapped task successes and the reconciler)."""
        argv = [str(Path(sys.executable).with_name("dataset-bridge")), "run", *args]
        return self.add(name, argv, env)

    def start_bridge_ready(
        self, name: str = "dataset-bridge", args: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> Component:
        """``start_bridge``, then wait until it runs: a mapped task's successes count from the moment its
        bridge first registers it (its horizon), so a run triggered before that makes no event."""
        bridge = self.start_bridge(name, args, env)
        bridge.wait_for_log("dataset bridge running", timeout=120)
        return bridge

    def add_relay(
        self, args: Sequence[str], env: dict[str, str] | None = None, name: str = "relay"
    ) -> Component:
        """One ``dataset-bridge relay`` process (this deployment's outbox -> other deployments)."""
        argv = [str(Path(sys.executable).with_name("dataset-bridge")), "relay", *args]
        return self.add(name, argv, env)

    def start_smart(self, dag_ids: Sequence[str], env: dict[str, str] | None = None) -> Component:
        """Core + one smart triggerer, then wait for ``dag_ids`` to be parsed and unpause them."""
        self.start_core()
        triggerer = self.start_smart_triggerer(env=env)
        self.wait_for_dags(dag_ids)
        # its schema is migrated and it is registered: a test may read smart_triggerer's tables from now on
        triggerer.wait_for_log("smart triggerer started", timeout=120)
        for dag_id in dag_ids:
            self.unpause(dag_id)
        return triggerer

    def smart_status(self) -> dict[str, Any]:
        """``smart-triggerer status --json`` of this deployment."""
        result = subprocess.run(
            [str(Path(sys.executable).with_name("smart-triggerer")), "status", "--json"],
            env=self.config.env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            raise StackError(f"smart-triggerer status failed: {result.stderr[-2000:]}")
        status: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
        return status

    def stop(self) -> None:
        stop_components(self.components)

    def retire(self, component: Component) -> None:
        """Stop one component on purpose; the stack no longer expects it to be running."""
        stop_components([component])
        self.components.remove(component)

    def log_tails(self, chars: int = 3000) -> str:
        return "\n".join(
            f"----- {c.name} (pid {c.process.pid if c.process else '-'}) -----\n{c.log_tail(chars)}"
            for c in self.components
        )

    # --- REST helpers (public API v2; the test stack makes every caller an admin) ---

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.config.api_url}/api/v2", timeout=30)

    def _check_alive(self) -> None:
        for component in self.components:
            if not component.running():
                raise StackError(f"{component.name} exited early:\n{component.log_tail()}")

    def wait_healthy(self, parts: Sequence[str], timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: Any = None
        with self.client() as client:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    response = client.get("/monitor/health")
                    last = response.json() if response.status_code == 200 else response.text
                    if isinstance(last, dict) and all(
                        last.get(p, {}).get("status") == "healthy" for p in parts
                    ):
                        self.warm_execution_api(deadline - time.monotonic())
                        return last
                time.sleep(0.5)
        raise StackError(f"stack not healthy after {timeout:.0f}s (wanted {parts}): {last}")

    def warm_execution_api(self, timeout: float) -> None:
        """Send the api-server's first Execution API request before any task does.

        The Execution API (a Cadwyn app) builds its versioned routers on its first request, on the
        server's event loop: 3-5 s of CPU here, during which every request to that api-server waits. On a
        loaded machine that took over 30 s, the first task's PATCH /run timed out and the task failed.
        """
        with httpx.Client(base_url=self.config.api_url, timeout=max(timeout, 30.0)) as client:
            client.get("/execution/health").raise_for_status()

    def wait_for_dags(self, dag_ids: Sequence[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        missing = list(dag_ids)
        with self.client() as client:
            while time.monotonic() < deadline:
                self._check_alive()
                missing = [d for d in missing if client.get(f"/dags/{d}").status_code != 200]
                if not missing:
                    return
                time.sleep(0.5)
            errors = client.get("/importErrors").text
        raise StackError(f"DAGs not parsed after {timeout:.0f}s: {missing}; import errors: {errors}")

    def unpause(self, dag_id: str) -> None:
        with self.client() as client:
            response = client.patch(f"/dags/{dag_id}", json={"is_paused": False})
            response.raise_for_status()

    def trigger(
        self, dag_id: str, conf: dict[str, Any] | None = None, logical_date: dt.datetime | None = None
    ) -> str:
        when = logical_date or dt.datetime.now(dt.UTC)
        body = {"logical_date": when.isoformat(), "conf": conf or {}}
        with self.client() as client:
            response = client.post(f"/dags/{dag_id}/dagRuns", json=body)
            response.raise_for_status()
            run_id: str = response.json()["dag_run_id"]
            return run_id

    def run_state(self, dag_id: str, run_id: str) -> str:
        with self.client() as client:
            response = client.get(f"/dags/{dag_id}/dagRuns/{run_id}")
            response.raise_for_status()
            state: str = response.json()["state"]
            return state

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        with self.client() as client:
            response = client.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 1000})
            response.raise_for_status()
            return {ti["task_id"]: ti["state"] for ti in response.json()["task_instances"]}

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 180) -> str:
        """Wait for a run's final state; raise with the task states when it takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            state = self.run_state(dag_id, run_id)
            if state in TERMINAL_RUN_STATES:
                return state
            time.sleep(0.5)
        raise StackError(
            f"run {dag_id}/{run_id} not finished after {timeout:.0f}s: {self.task_states(dag_id, run_id)}"
        )


@contextlib.contextmanager
def running_stack(config: AirflowConfig) -> Iterator[AirflowStack]:
    """Start the core of a stack on an already migrated database, stop all of it on exit."""
    stack = AirflowStack(config)
    try:
        stack.start_core()
        yield stack
    finally:
        stack.stop()
