"""Deferrable sensors for DAG authors: they hand their wait to an async trigger at once."""
