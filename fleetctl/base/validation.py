"""Pydantic validation of YAML sources, turned into one-line errors naming file, line and field."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from fleetctl.base.errors import UserError, did_you_mean, shown, what_and_fix
from fleetctl.base.limits import MAX_TEXT
from fleetctl.base.yamlsrc import Path_, Source

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """Base of every user-facing schema: frozen, unknown keys are errors, numbers are finite
    and text is bounded."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, str_max_length=MAX_TEXT
    )


def validate(cls: type[M], src: Source, data: Any = None, prefix: Path_ = ()) -> M:
    """Validate `data` (default: the whole source) as `cls`; errors point into `src`."""
    value = src.data if data is None else data
    try:
        return cls.model_validate(value)
    except ValidationError as e:
        raise to_user_error(e, cls, src, prefix) from None


def to_user_error(
    e: ValidationError, cls: type[BaseModel], src: Source, prefix: Path_
) -> UserError:
    errors = e.errors(include_url=False)
    first = errors[0]
    loc: Path_ = (*prefix, *_clean_loc(first["loc"]))
    what, fix = describe(first, cls, loc)
    misspelt = _misspelling_of(first, errors) if first["type"] == "missing" else None
    if misspelt is not None:
        # The misspelt key is the same mistake, and its line is the one to edit.
        errors = [err for err in errors if err is not misspelt]
        typo = _clean_loc(misspelt["loc"])[-1]
        note = _unit_note(str(typo), loc_field(first))
        fix = f"found {shown(str(typo), 60)}: did you mean '{loc_field(first)}'{note}?"
        # Where: the misspelt key's line, under the path of the mapping that misses the key.
        typo_at = src.at((*prefix, *_clean_loc(misspelt["loc"])))
        where = dataclasses.replace(typo_at, path=src.at(loc[:-1]).path)
    else:
        where = src.at(loc)
    more = len(errors) - 1
    if more:
        fix = f"{fix}; {more} more problem{'s' if more > 1 else ''} after this one"
    return UserError(what, where, fix)


def loc_field(err: Any) -> str:
    """The key an error is about: the last part of its location."""
    loc = _clean_loc(err["loc"])
    return str(loc[-1]) if loc else ""


def _misspelling_of(missing: Any, errors: list[Any]) -> Any:
    """The unknown key beside a missing required one that is a close spelling of it, if any:
    pydantic reports the two apart, and the missing key alone would not say which was meant."""
    parent = _clean_loc(missing["loc"])[:-1]
    wanted = loc_field(missing)
    for err in errors:
        loc = _clean_loc(err["loc"])
        extra = err["type"] == "extra_forbidden" and loc[:-1] == parent
        if extra and _close(str(loc[-1]), wanted):
            return err
    return None


def _close(typed: str, wanted: str) -> bool:
    """`typed` reads as an attempt at `wanted`: a close spelling, or a shortening of it
    (`gpu` for `gpu_type`, too short a part of it for difflib's ratio)."""
    if did_you_mean(typed, [wanted]) is not None:
        return True
    return len(typed) >= 3 and wanted.lower().startswith(typed.lower())


# A key's last part names its unit; a suggestion in another unit says so, since the value
# written beside `ttft_p99_ms: 500` is 500 seconds once the key alone is corrected.
_UNITS = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}


def _unit_note(typed: str, hint: str) -> str:
    """` (seconds)` or ` (seconds, not milliseconds)` when `hint`'s unit is not `typed`'s."""
    unit = _UNITS.get(hint.rpartition("_")[2])
    was = _UNITS.get(typed.rpartition("_")[2].lower())
    if unit is None or unit == was:
        return ""
    return f" ({unit}, not {was})" if was else f" ({unit})"


def _clean_loc(loc: tuple[Any, ...]) -> Path_:
    # Pydantic adds tagged-union and function-validator names to loc; keep only real keys.
    return tuple(
        p for p in loc if isinstance(p, int) or not str(p).startswith(("function-", "tagged"))
    )


def describe(err: Any, cls: type[BaseModel], loc: Path_) -> tuple[str, str]:
    """What went wrong and how to fix it, in the user's words rather than pydantic's."""
    kind = err["type"]
    field = str(loc[-1]) if loc else ""
    got = err.get("input")
    if kind == "extra_forbidden":
        known = _known_keys(cls, loc[:-1])
        hint = did_you_mean(field, known) if known else None
        fix = (
            f"did you mean '{hint}'{_unit_note(field, hint)}?"
            if hint
            else (f"known keys: {', '.join(sorted(known))}" if known else "remove it")
        )
        return f"unknown key {shown(field, 60)}", fix
    if kind == "missing":
        return f"missing required key '{field}'", f"add '{field}:'"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {_show(got)}", "write a number such as 8"
    if kind == "finite_number":
        return f"expected a finite number, got {_show(got)}", "write a number such as 0.9"
    if kind == "string_too_long":
        n = err.get("ctx", {}).get("max_length", MAX_TEXT)
        return f"text longer than {n} characters", "shorten it"
    if kind in ("float_type", "float_parsing"):
        return f"expected a number, got {_show(got)}", "write a number such as 0.9"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {_show(got)}", "write true or false"
    if kind in ("string_type",):
        return f"expected text, got {_show(got)}", "quote the value"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping of keys, got {_show(got)}", "write 'key: value' lines here"
    if kind in ("list_type",):
        return f"expected a list, got {_show(got)}", "write a list ('- item' lines)"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{err['msg'].lower()}, got {_show(got)}", "change the value"
    if kind == "literal_error":
        return f"{_show(got)} is not allowed: {err['msg'].lower()}", "use one of the listed values"
    if kind == "value_error":
        problem, how = what_and_fix(err["ctx"]["error"] if "ctx" in err else err["msg"])
        return problem, how or "change the value"
    return f"{err['msg'].lower()}", "fix the value"


def _show(v: Any) -> str:
    if isinstance(v, dict | list):
        return "a mapping" if isinstance(v, dict) else "a list"
    return shown(v, 60)


def _known_keys(cls: type[BaseModel], loc: Path_) -> list[str]:
    """The field names allowed at `loc` inside `cls`, by walking the schema's annotations."""
    current: Any = cls
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        f = current.model_fields.get(part)
        if f is None:
            return []
        current = _inner_model(f.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return [f.alias or name for name, f in current.model_fields.items()]
    return []


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside `X | None`, `list[X]`, `dict[str, X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None
