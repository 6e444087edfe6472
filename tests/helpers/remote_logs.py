"""A remote log store that hangs (``[logging] logging_config_class`` = this module's ``LOGGING_CONFIG``).

Airflow reads ``REMOTE_TASK_LOG`` beside the logging config it is pointed at. Each upload writes
``<HANGING_UPLOADS_DIR>/<n>.started`` and then blocks until the file ``release`` exists there, as an upload
to a store that accepts the connection and never answers does; then ``<n>.uploaded`` with the path."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from airflow.config_templates.airflow_local_settings import DEFAULT_LOGGING_CONFIG

LOGGING_CONFIG = DEFAULT_LOGGING_CONFIG
_numbers = itertools.count()


class HangingRemoteLogIO:
    processors: tuple[Any, ...] = ()

    def upload(self, path: os.PathLike[str] | str, ti: Any = None) -> None:
        folder = Path(os.environ["HANGING_UPLOADS_DIR"])
        number = next(_numbers)
        (folder / f"{number}.started").write_text(str(path))
        while not (folder / "release").exists():
            time.sleep(0.1)
        (folder / f"{number}.uploaded").write_text(str(path))

    def read(self, relative_path: str, ti: Any) -> tuple[list[str], list[str]]:
        return [], []


REMOTE_TASK_LOG = HangingRemoteLogIO()
