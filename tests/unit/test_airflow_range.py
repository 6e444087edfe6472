"""The Airflow versions a start accepts: the package's own ``apache-airflow`` requirement (pyproject.toml)."""

from __future__ import annotations

import pytest

from smart_triggerer.db.preflight import require_airflow, supported_airflow
from smart_triggerer.errors import ExitCode, UnsupportedAirflow


def test_the_range_is_the_package_requirement() -> None:
    assert supported_airflow() == ">=3.3.1,<3.4"


@pytest.mark.parametrize("version", ["3.3.1", "3.3.2", "3.3.10"])
def test_releases_in_the_range_start(version: str) -> None:
    require_airflow(version)


@pytest.mark.parametrize("version", ["3.3.0", "3.4.0", "3.4.0rc1", "3.2.2"])
def test_releases_outside_it_are_refused_with_their_exit_code(version: str) -> None:
    with pytest.raises(UnsupportedAirflow) as refused:
        require_airflow(version)
    # the documented number too (mypy's strict equality does not see that an IntEnum member equals it)
    assert refused.value.exit_code == ExitCode.AIRFLOW_UNSUPPORTED == 7  # type: ignore[comparison-overlap]
    assert f"Apache Airflow {version} is installed" in str(refused.value)
