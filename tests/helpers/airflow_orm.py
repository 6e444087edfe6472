"""Point this (test) process's Airflow ORM at one test database."""

from __future__ import annotations

from triggerer.pgserver import sqlalchemy_url


def use_airflow_db(dsn: str) -> None:
    from airflow import settings
    from airflow.configuration import conf

    conf.set("database", "sql_alchemy_conn", sqlalchemy_url(dsn))
    settings.configure_vars()
    settings.reconfigure_orm()
