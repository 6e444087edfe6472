"""Fixtures shared by the integration tests that drive a supervisor in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devkit.devstack import AirflowConfig
from tests.helpers.airflow_orm import use_airflow_db


@pytest.fixture
def env(airflow_config: AirflowConfig) -> Iterator[AirflowConfig]:
    """A fresh metadata database, and Airflow's ORM in this process pointed at it."""
    use_airflow_db(airflow_config.database_dsn)
    yield airflow_config
