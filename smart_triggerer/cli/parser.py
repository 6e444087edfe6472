"""The command lines' argument parser: argparse, plus a "did you mean" for a misspelled flag or command."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any, NoReturn

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return found[0] if found else None


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest flag or command (sub-commands are made of it
    too: argparse makes a sub-parser of its parent's class)."""

    def parse_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # the command's own parser reports it: its usage line is the one that helps
            reporter = self._command_parser(parsed) or self
            reporter.error(reporter.unrecognized(extras))
        return parsed

    def unrecognized(self, extras: Sequence[str]) -> str:
        message = f"unrecognized arguments: {' '.join(extras)}"
        options = [option for action in self._actions for option in action.option_strings]
        for extra in extras:
            if extra.startswith("-") and (guess := _closest(extra.split("=", 1)[0], options)):
                return f"{message} (did you mean {guess}?)"
        return message

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.search(message)
        if choice:
            choices = [c.strip(" '") for c in choice.group(2).split(",")]
            if guess := _closest(choice.group(1), choices):
                message = f"{message}; did you mean '{guess}'?"
        super().error(message)

    def _command_parser(self, parsed: argparse.Namespace) -> Parser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen: Any = action.choices.get(getattr(parsed, action.dest, None) or "")
                return chosen if isinstance(chosen, Parser) else None
        return None
