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
        # Every value quoted in `what` is cut by shown(); this bounds what slipped through.
        where = _cut(str(self.where), 300)
        what = _cut(self.what, 400)
        fix = _cut(self.fix, 400) if self.fix else None
        text = f"{where}: {what}" if where else what
        return f"{text} ({fix})" if fix else text


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class OperationError(FleetError):
    """An operation failed for reasons outside the user's input (exit code 1)."""


def what_and_fix(e: object) -> tuple[str, str | None]:
    """A validator's ValueError("what | how to fix") (or its text), split; the fix may be
    absent. Validators below the layer that knows the file and line raise in this form."""
    what, _, fix = str(e).partition(" | ")
    return what, fix or None


def shown(value: object, limit: int = 80) -> str:
    """`value` as an error quotes it: repr, cut to about `limit` characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 12]}... ({len(str(value))} chars)"


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str | None:
    """The closest known name to `word`, case-insensitively, or None when nothing is close."""
    import difflib

    if len(word) > 100:  # nothing that long is a typo of a name, and difflib is quadratic
        return None
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hits[0]] if hits else None


def suggestion(word: str, choices: list[str] | tuple[str, ...], most: int = 4) -> str | None:
    """ "did you mean ...?" for `word`: the names that contain it first (`A100` names every
    A100 variant, where spelling closeness alone picks `A10G`), else the closest spelling."""
    typed = word.strip().lower()
    within = [c for c in choices if typed and typed in c.lower()] if len(typed) >= 2 else []
    if len(within) == 1:
        return f"did you mean '{within[0]}'?"
    if within:
        names = ", ".join(f"'{c}'" for c in sorted(within)[:most])
        more = f" (and {len(within) - most} more)" if len(within) > most else ""
        return f"did you mean one of {names}{more}?"
    hint = did_you_mean(word, choices)
    return f"did you mean '{hint}'?" if hint else None
