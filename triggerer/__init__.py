"""The smart triggerer service: runs Airflow triggers once per identity group, sharded across instances."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("airflow-smart-triggerer")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
