"""The hostname each bench instance reports in its job row (``[core] hostname_callable``): its own name, so
the bench can start a whole fleet at once and still tell which job row is whose."""

from __future__ import annotations

import os
import socket


def instance_name() -> str:
    return os.environ.get("BENCH_INSTANCE") or socket.getfqdn()
