"""The runner subprocess: the event loop where trigger coroutines run (``trigger_runner``), its collector
tuning and loop-lag meter. It talks to its supervisor over Airflow's comms channel only and imports
nothing that opens a database session (Airflow's ADR-0005 for its own triggerer)."""
