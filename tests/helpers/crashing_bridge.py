"""A dataset bridge that dies (SIGKILL-like ``os._exit``) right after creating an asset event, before its
transaction commits: the crash the exactly-once ledger must survive.

Run: ``python -m tests.helpers.crashing_bridge MAPPING``."""

from __future__ import annotations

import os
import sys
from typing import Any

from airflow.assets import manager

from dataset_bridge import service
from dataset_bridge.task_success import TaskMapping

real = manager.asset_manager.register_asset_change


def register_then_die(**kwargs: Any) -> Any:
    event = real(**kwargs)
    kwargs["session"].flush()  # the event row is written inside the open transaction...
    print(f"created asset event {event.id if event else None}; crashing before commit", flush=True)
    os._exit(9)  # ...and the process dies before the commit


manager.asset_manager.register_asset_change = register_then_die  # type: ignore[method-assign]

if __name__ == "__main__":
    mapping = TaskMapping.load(sys.argv[1])
    service.prepare(mapping)
    service.emit_pending(mapping)
    sys.exit(0)  # nothing was pending
