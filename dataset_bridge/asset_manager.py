"""``[core] asset_manager_class = dataset_bridge.asset_manager.OutboxAssetManager``: see ``outbox.py``.

A module of its own: Airflow imports the configured class while ``airflow.assets.manager`` is still being
imported, so nothing else of ours may import that module at its top level.
"""

from __future__ import annotations

from typing import Any

from airflow.assets.manager import AssetManager

from dataset_bridge.outbox import record, routes_from


class OutboxAssetManager(AssetManager):
    """Airflow's asset manager, plus one outbox row per routed target in the same transaction."""

    def __init__(self, routes: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.routes_path = routes

    def register_asset_change(self, **kwargs: Any) -> Any:  # type: ignore[override]
        event = super().register_asset_change(**kwargs)
        if event is None or not self.routes_path:
            return event
        asset = kwargs["asset"]
        record(kwargs["session"], routes_from(self.routes_path), event, asset.uri, asset.name)
        return event
