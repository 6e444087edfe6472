"""The supervisor in parts (``triggerer/supervisor/``): each part owns its job, the conductor has them all."""

from __future__ import annotations

import inspect
from pathlib import Path

from triggerer.supervisor import SmartTriggerRunnerSupervisor
from triggerer.supervisor.state import SupervisorState

PACKAGE = Path(inspect.getfile(SupervisorState)).parent


def test_every_call_between_parts_is_implemented_by_a_part() -> None:
    declared = [name for name, value in vars(SupervisorState).items()
                if callable(value) and "NotImplementedError" in inspect.getsource(value)]
    assert declared, "the state names the calls parts make into each other"
    for name in declared:
        owner = next(cls for cls in SmartTriggerRunnerSupervisor.__mro__ if name in vars(cls))
        assert owner is not SupervisorState, f"{name} is declared on the state but no part implements it"
        assert owner.__module__.startswith("triggerer.supervisor."), owner


def test_no_part_is_over_500_lines_and_each_says_what_it_owns() -> None:
    for module in sorted(PACKAGE.glob("*.py")):
        text = module.read_text()
        assert len(text.splitlines()) <= 500, module.name
        assert text.startswith('"""'), f"{module.name} has no docstring saying what it owns"
