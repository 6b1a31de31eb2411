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
    """ "did you mean ...?" for a profile's name: its family first, then the closest spelling.
    Spelling alone picks `A10G` for `A100`, `H200` for `H100` and `int8` for `int4`; a name's
    parts (`A100`, `SXM4`, `80GB`, `gptq`, `int4`) say what was meant. The family is every name
    holding the first typed part that any name holds (`A100`: the A100s; `int4`: awq-int4 and
    gptq-int4; `NVIDIA A100`: the A100s); when each typed part is one of the family's, those
    sharing the most are named, else the closest spelling within the family (`RTX-4009`:
    RTX-4090, not every RTX), else the family."""
    typed = _parts(word) if len(word) <= 100 else []  # nothing that long is a name's typo
    parts = {c: set(_parts(c)) for c in choices}
    key = next((p for p in typed if any(p in ps for ps in parts.values())), None)
    family = {c: ps for c, ps in parts.items() if key in ps}
    if family:
        understood = set(typed) <= set().union(*family.values())
        hint = None if understood else did_you_mean(word, list(family))
        best = max(len(set(typed) & p) for p in family.values())
        named = (
            [hint] if hint else sorted(c for c, p in family.items() if len(set(typed) & p) == best)
        )
        if len(named) == 1:
            return f"did you mean '{named[0]}'?"
        names = ", ".join(f"'{c}'" for c in named[:most])
        more = f" (and {len(named) - most} more)" if len(named) > most else ""
        return f"did you mean one of {names}{more}?"
    hint = did_you_mean(word, choices)
    return f"did you mean '{hint}'?" if hint else None


def _parts(name: str) -> list[str]:
    """A name's parts, lowercased: `A100-SXM4-80GB` is a100, sxm4, 80gb."""
    import re

    return [p for p in re.split(r"[^a-z0-9]+", name.lower()) if p]
