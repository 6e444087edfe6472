"""What answers over HTTP: the page in Airflow's UI (``page``, run by the api-server) and the instance's
health and metrics endpoints (``health``, run beside the supervisor)."""
