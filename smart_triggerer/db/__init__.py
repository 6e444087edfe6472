"""The database layer: the triggerer's own schema (versioned migrations in ``sql/``, named queries in
``sql/queries.sql``), the store that runs them, connection bounds, membership notices, error kinds. Only
the supervisor, the commands and the page use it: the runner never opens a database session."""
