"""The state folder's JSON documents, read and written through one typed schema each: the
dataclasses themselves, validated and dumped by pydantic, with a format number in every file
and one line naming the field for a bad or newer one.

A document's schema is its dataclass: field types say what each key holds (checked strictly,
as JSON types: a string is never a number, a number never a boolean), defaults say what a
file from before a key existed gets, and `Annotated[..., Field(alias=...)]` keeps a key's
name where it differs from the field's. Unknown keys are ignored, so a newer fleetctl may add
some without a new format number; a change of meaning gets one.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


class DocumentError(ValueError):
    """A document that is not one of its kind: the message names the field and why."""


_ADAPTERS: dict[type, TypeAdapter[Any]] = {}


def _adapter(schema: type) -> TypeAdapter[Any]:
    """One adapter per schema: building one costs milliseconds, using it microseconds."""
    found = _ADAPTERS.get(schema)
    if found is None:
        found = _ADAPTERS[schema] = TypeAdapter(schema)
    return found


def load(
    text: str | bytes,
    schema: type[T],
    *,
    reads: tuple[int, ...],
    default_format: int | None = None,
) -> T:
    """The document `text` holds, as `schema`; DocumentError for malformed JSON, a format this
    release does not read (`reads`; `default_format` for files from before the key existed),
    or a field of the wrong type (its path, e.g. `deployments[2].port`)."""
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise DocumentError(f"not JSON: {e}") from None
    _check_format(raw, reads, default_format)
    return _validate(text, schema)


def parse(
    raw: object, schema: type[T], *, reads: tuple[int, ...], default_format: int | None = None
) -> T:
    """`load` for a document already parsed from JSON."""
    _check_format(raw, reads, default_format)
    return _validate(json.dumps(raw), schema)


def _check_format(raw: object, reads: tuple[int, ...], default_format: int | None) -> None:
    if not isinstance(raw, dict):
        raise DocumentError("not a JSON object")
    fmt = raw.get("format", default_format)
    if fmt not in reads:
        newer = isinstance(fmt, int) and fmt > max(reads)
        raise DocumentError(
            f"format {fmt!r} was written by a {'newer' if newer else 'different'} fleetctl "
            f"(this one reads {', '.join(map(str, reads))})"
        )


def _validate(text: str | bytes, schema: type[T]) -> T:
    # Strict, as JSON types: a string is never a number; a JSON array may fill a tuple.
    try:
        found: T = _adapter(schema).validate_json(text, strict=True)
        return found
    except ValidationError as e:
        raise DocumentError(first_error(e)) from None


def parse_part(raw: object, schema: type[T]) -> T:
    """A part of a document (one deployment of a plan) as `schema`; DocumentError as `parse`."""
    return _validate(json.dumps(raw), schema)


def dump(document: object, fmt: int, *, omit_unknown: bool = False) -> dict[str, Any]:
    """`document` as JSON-ready data under its format number, keys by their aliases."""
    return {"format": fmt, **data(document, omit_unknown=omit_unknown)}


def data(part: object, *, omit_unknown: bool = False) -> Any:
    """A document or a part of one as JSON-ready data, keys by their aliases. With
    `omit_unknown`, fields that are None are left out rather than written as null."""
    return _adapter(type(part)).dump_python(
        part, mode="json", by_alias=True, exclude_none=omit_unknown
    )


def first_error(e: ValidationError) -> str:
    """The first problem pydantic found, as `where: what, got what` (`nodes.a100-1.gpus[0].
    index: input should be a valid integer, got a string`)."""
    err = e.errors()[0]
    where = ""
    for part in err["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        else:
            where += f".{part}" if where else str(part)
    what = err["msg"][:1].lower() + err["msg"][1:]
    if err["type"] == "missing":
        return f"{where}: missing"
    if err["type"] == "value_error":  # a __post_init__ check: its own words
        return f"{where or 'document'}: {what.removeprefix('value error, ')}"
    return f"{where or 'document'}: {what}, got {_json_kind(err.get('input'))}"


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"
