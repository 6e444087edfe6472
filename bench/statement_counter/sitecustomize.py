"""Benchmark instrumentation: counts the metadata-DB statements of every process that imports it.

Put this directory on PYTHONPATH of the processes to measure (bench/triggerer_bench.py does, for the stock
and the smart triggerer alike). Every SQLAlchemy statement is counted with the rows it returned; at most
once a second the totals are written to ``$BENCH_STATEMENTS_DIR/<pid>`` as "statements rows" (a write per
statement would cost more than the statement). Counting only: nothing about the statements is kept.
"""

from __future__ import annotations

import os
import time

_DIR = os.environ.get("BENCH_STATEMENTS_DIR")


def _install() -> None:
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    counts = {"statements": 0, "rows": 0, "written": 0.0}

    def after(conn, cursor, *_rest):  # type: ignore[no-untyped-def]
        counts["statements"] += 1
        if cursor.description is not None and cursor.rowcount > 0:
            counts["rows"] += cursor.rowcount
        now = time.monotonic()
        if now - counts["written"] >= 1.0:
            counts["written"] = now
            path = os.path.join(_DIR, str(os.getpid()))
            with open(path + ".tmp", "w") as out:
                out.write(f"{counts['statements']} {counts['rows']}\n")
            os.replace(path + ".tmp", path)

    event.listen(Engine, "after_cursor_execute", after)


if _DIR:
    _install()
