"""Point this (test) process's Airflow ORM at one test database."""

from __future__ import annotations

from devkit.pgserver import sqlalchemy_url


def use_airflow_db(dsn: str) -> None:
    from airflow import settings
    from airflow.configuration import conf

    url = sqlalchemy_url(dsn)
    if settings.engine is not None and conf.get("database", "sql_alchemy_conn") == url:
        return  # already there: keep the engine (and what a test attached to it)
    conf.set("database", "sql_alchemy_conn", url)
    settings.configure_vars()
    settings.reconfigure_orm()
