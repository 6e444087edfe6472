"""An auth manager for the page's e2e test: Airflow's SimpleAuthManager, except that user ``limited`` may not
read DAGs whose id starts with ``hidden_``, and user ``outsider`` may read no DAG and not view triggers
(SimpleAuthManager knows roles only, not per-DAG or per-view access)."""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

LIMITED_USER = "limited"
OUTSIDER = "outsider"
HIDDEN_PREFIX = "hidden_"


class LimitedAuthManager(SimpleAuthManager):
    def is_authorized_view(self, *, access_view: Any, user: Any) -> bool:
        return user.get_name() != OUTSIDER and super().is_authorized_view(access_view=access_view, user=user)

    def is_authorized_dag(
        self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None
    ) -> bool:
        if user.get_name() == OUTSIDER:
            return False
        if (
            user.get_name() == LIMITED_USER
            and details is not None
            and details.id
            and details.id.startswith(HIDDEN_PREFIX)
        ):
            return False
        return super().is_authorized_dag(
            method=method, user=user, access_entity=access_entity, details=details
        )
