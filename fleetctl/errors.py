"""The error types that cross layers, and how a user mistake is worded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Location:
    """Where in a user's file something is: file, line (1-based) and dotted field path."""

    file: str | None = None
    line: int | None = None
    path: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file if self.line is None else f"{self.file}:{self.line}")
        if self.path:
            parts.append(self.path)
        return ": ".join(parts)


class FleetError(Exception):
    """Base of every error fleetctl reports without a traceback."""

    exit_code = 1


class UserError(FleetError):
    """Bad input: one line saying what is wrong, where, and how to fix it (exit code 2)."""

    exit_code = 2

    def __init__(self, what: str, where: Location | None = None, fix: str | None = None):
        self.what = what
        self.where = where or Location()
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        where = str(self.where)
        text = f"{where}: {self.what}" if where else self.what
        return f"{text} ({self.fix})" if self.fix else text


class OperationError(FleetError):
    """An operation failed for reasons outside the user's input (exit code 1)."""


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str | None:
    """The closest known name to `word`, case-insensitively, or None when nothing is close."""
    import difflib

    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hits[0]] if hits else None
