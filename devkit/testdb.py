"""One PostgreSQL server and one migrated Airflow template for a whole test run (``dev.py test``).

Without it each pytest process (each phase, and each of its xdist workers) started a server of its own
and ran ``airflow db migrate`` into a template of its own: about 15 s of a core each, all at once when a
phase starts. Run as ``python -m devkit.testdb``: it prints one line of JSON (``dsn``, ``template``) once
the template is migrated, then waits until its standard input closes, drops the template and stops the
server it started (``SMART_TRIGGERER_DSN``, when set, is used instead and left running).
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from devkit.devstack import AirflowConfig, migrate
from devkit.pgserver import create_database, drop_database, postgres_dsn

DSN_ENV = "SMART_TRIGGERER_DSN"
TEMPLATE_ENV = "SMART_TRIGGERER_TEST_TEMPLATE"


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="smart-triggerer-template-"))
    try:
        with postgres_dsn() as dsn:
            name = f"st_template_run_{secrets.token_hex(4)}"
            template_dsn = create_database(dsn, name)
            try:
                migrate(
                    AirflowConfig(home=home / "airflow", database_dsn=template_dsn, dags_folder=home / "dags")
                )
                print(json.dumps({"dsn": dsn, "template": name}), flush=True)
                sys.stdin.read()  # until the test run is over (or its caller is gone)
            finally:
                drop_database(dsn, name)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
