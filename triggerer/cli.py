"""The ``smart-triggerer`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from triggerer import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smart-triggerer",
        description=(
            "A deduplicating, sharded replacement for `airflow triggerer`. "
            "Uses the usual Airflow configuration (AIRFLOW_HOME, AIRFLOW__... environment)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
