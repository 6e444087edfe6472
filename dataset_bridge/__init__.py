"""Producer success -> exactly one asset event -> consumer DAG runs."""
