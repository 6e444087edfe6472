"""What must hold before the service or a command touches the metadata database: a supported Airflow,
PostgreSQL, and Airflow's own tables migrated. Each refusal is a ``UserError`` that says what to do."""

from __future__ import annotations

from smart_triggerer.errors import AirflowNotMigrated, UnsupportedAirflow, UnsupportedDatabase


def supported_airflow() -> str:
    """The Airflow versions this release declares (its ``apache-airflow`` requirement, one place:
    pyproject.toml), e.g. ``>=3.3.1,<3.4``; empty when the package is not installed."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        wanted = requires("airflow-smart-triggerer") or []
    except PackageNotFoundError:  # run from a source tree that was never installed
        return ""
    found = (Requirement(r) for r in wanted)
    specifier = next(
        (
            r.specifier
            for r in found
            if canonicalize_name(r.name) == "apache-airflow"
            and (r.marker is None or r.marker.evaluate({"extra": ""}))
        ),
        None,
    )
    # lower bounds first, as people write them
    return ",".join(sorted((str(s) for s in specifier or ()), key=lambda s: s.startswith("<")))


def require_airflow(installed: str | None = None) -> None:
    """Refuse to start on an Airflow outside the tested range: the supervisor builds on the internals of
    exactly these releases (a pip install with --no-deps, or Airflow upgraded after us, gets here)."""
    from packaging.specifiers import SpecifierSet

    if installed is None:
        from airflow import __version__

        installed = str(__version__)
    supported = supported_airflow()
    if supported and installed not in SpecifierSet(supported, prereleases=True):
        raise UnsupportedAirflow(
            f"Apache Airflow {installed} is installed, but this release of airflow-smart-triggerer is built "
            f"and tested for apache-airflow{supported}: install a supported Airflow, or the release of "
            "airflow-smart-triggerer made for yours"
        )


def require_postgres() -> None:
    """Refuse a metadata database other than PostgreSQL before anything touches it."""
    from airflow.configuration import conf

    url = conf.get("database", "sql_alchemy_conn", fallback="") or ""
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in ("postgresql", "postgres"):
        raise UnsupportedDatabase(
            f"the metadata database is {scheme or 'not configured'}, but the smart triggerer and the dataset "
            "bridge need PostgreSQL: set [database] sql_alchemy_conn (AIRFLOW__DATABASE__SQL_ALCHEMY_CONN) "
            "to a postgresql:// URL"
        )


def require_migrated() -> None:
    """Refuse a metadata database ``airflow db migrate`` never ran on: every command reads Airflow's
    tables, and the first query's error was a traceback of a hundred lines."""
    from airflow.utils.session import create_session
    from sqlalchemy import text

    with create_session() as session:
        found = session.execute(
            text(
                "SELECT to_regclass('alembic_version') IS NOT NULL AND to_regclass('job') IS NOT NULL "
                "AND to_regclass('trigger') IS NOT NULL"
            )
        ).scalar()
    if not found:
        raise AirflowNotMigrated(
            "the metadata database has no Airflow tables: run `airflow db migrate` against it first "
            "([database] sql_alchemy_conn names the database this command uses)"
        )
