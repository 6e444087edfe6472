"""airflow-smart-triggerer: the service that runs Airflow triggers once per identity group, sharded across
instances. Rooms by process: ``runner`` (the trigger subprocess), ``supervisor`` (the instance), ``db``,
``placement`` (pure), ``web`` (page and health), ``cli``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("airflow-smart-triggerer")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
