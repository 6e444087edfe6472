"""Each command line's --help says what every exit code means (an operator's alerting reads them)."""

from __future__ import annotations

import re

import pytest

from smart_triggerer.errors import ExitCode


def help_text(which: str) -> str:
    if which == "smart-triggerer":
        from smart_triggerer.cli.main import build_parser

        return build_parser().format_help()
    from dataset_bridge.cli import build_parser as bridge_parser

    return bridge_parser().format_help()


# what each can exit with: the bridge checks neither shards, nor the Airflow range, nor the triggerer's schema
CAN_EXIT = {
    "smart-triggerer": {0, 1} | {int(code) for code in ExitCode},
    "dataset-bridge": {
        0,
        1,
        int(ExitCode.CONFIG),
        int(ExitCode.DATABASE_UNREACHABLE),
        int(ExitCode.DATABASE_UNSUPPORTED),
        int(ExitCode.DATABASE_PRIVILEGE),
        int(ExitCode.AIRFLOW_NOT_MIGRATED),
    },
}


@pytest.mark.parametrize("which", sorted(CAN_EXIT))
def test_help_lists_every_exit_code(which: str) -> None:
    text = " ".join(help_text(which).split())
    listed = {int(code) for code in re.findall(r"\b(\d) [A-Za-z]", text.partition("Exit codes:")[2])}
    assert listed >= CAN_EXIT[which], (which, sorted(CAN_EXIT[which] - listed))
