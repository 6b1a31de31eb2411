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

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from fleetctl.base.errors import shown
from fleetctl.base.limits import MAX_DOCUMENT_BYTES, MAX_JSON_DEPTH

T = TypeVar("T")
# A key shown as it is in a field's path (`nodes.rtx-1.gpus`); any other is quoted.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")


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
    raw = read(text)
    _check_format(raw, reads, default_format)
    return _validate(text, schema)


def read_file(path: Path, limit: int = MAX_DOCUMENT_BYTES, named: bool = False) -> bytes:
    """A document file's bytes, at most one past `limit` (`read` refuses those): a huge file
    is never read whole. OSError as reading raises it, and for anything but a regular file:
    opening a FIFO waits for a writer and a device never ends, which would stop a daemon that
    reads in its event loop (route-serve's reload). `named`: a path the user gave on the
    command line, which may be a pipe (`--facts <(...)`), read as it comes."""
    if named:
        with path.open("rb") as f:
            return f.read(limit + 1)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return f.read(limit + 1)


def read(text: str | bytes) -> object:
    """The JSON value `text` holds; DocumentError for one over MAX_DOCUMENT_BYTES, malformed
    JSON or one nested deeper than MAX_JSON_DEPTH. Every state document is read through here,
    so none reaches a recursive parser, dumper or validator that a hostile file could drive
    into a RecursionError."""
    if len(text) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"larger than {MAX_DOCUMENT_BYTES >> 20} MiB")
    try:
        raw = json.loads(text)
    except RecursionError:  # json's C scanner gives up near 1,000 levels
        raise DocumentError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise DocumentError(f"not JSON: {e}") from None
    _check_depth(raw)
    return raw


def _check_depth(raw: object) -> None:
    # Iterative: the check must not itself recurse once per level.
    todo: list[tuple[object, int]] = [(raw, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            items: Any = value.values()
        elif isinstance(value, list):
            items = value
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise DocumentError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        todo.extend((v, depth + 1) for v in items)


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
    if fmt is None:
        raise DocumentError(f"format: missing (this one reads {', '.join(map(str, reads))})")
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        # `true == 1` in Python: a boolean is never a format number.
        raise DocumentError(
            f"format: expected a whole number, got {_json_kind(fmt)} "
            f"(this one reads {', '.join(map(str, reads))})"
        )
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
        elif part == "[key]":  # pydantic's mark after a mapping key it refused
            continue
        elif not _PLAIN_KEY.fullmatch(str(part)):  # a key from the file: quoted, cut
            where += f"[{shown(str(part), 40)}]"
        else:
            where += f".{part}" if where else str(part)
    what = err["msg"][:1].lower() + err["msg"][1:]
    if err["type"] == "missing":
        return f"{where}: missing"
    if err["type"] == "value_error":  # a __post_init__ check or a name's grammar: its words
        # A grammar's "what | how to fix" (base/names.py): the fix is for an inventory; the
        # reader of a document gives its own.
        said = what.removeprefix("value error, ").partition(" | ")[0]
        return f"{where or 'document'}: {said}"
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
