"""YAML files read into plain data plus the line of every field, so errors can point at it.

Only plain YAML is accepted: mappings, lists, strings, numbers, booleans and nulls. Any other
tag, a document that expands past a bound (an alias bomb), a recursive alias, control
characters and oversized files are refused with a line in the user's file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetctl.base.errors import Location, UserError, shown
from fleetctl.base.limits import MAX_FILE_BYTES, MAX_YAML_DEPTH, MAX_YAML_VALUES
from fleetctl.base.names import control_char

try:  # libyaml's composer is ~10x faster on inventories with thousands of nodes
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - depends on how PyYAML was built
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

Path_ = tuple[str | int, ...]

_TAG = "tag:yaml.org,2002:"
_PLAIN = {_TAG + t for t in ("str", "int", "float", "bool", "null", "map", "seq")}
_MERGE = _TAG + "merge"
_STR = _TAG + "str"


@dataclass
class Source:
    """Parsed YAML with a map from field path to the 1-based line it was written on."""

    file: str
    data: Any
    lines: dict[Path_, int] = field(default_factory=dict)

    def line_of(self, path: Path_) -> int | None:
        """The line of `path`, or of its nearest ancestor that has one."""
        p = tuple(path)
        while p:
            if p in self.lines:
                return self.lines[p]
            p = p[:-1]
        return self.lines.get((), None)

    def at(self, path: Path_) -> Location:
        return Location(self.file, self.line_of(path), dotted(path) or None)


def dotted(path: Path_) -> str:
    """`("nodes", 1, "gpus", "type")` -> `nodes[1].gpus.type`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def load_yaml(path: str | Path, what: str = "file", max_bytes: int | None = None) -> Source:
    """Read a YAML file; every failure is a UserError naming the file and line."""
    p = Path(path)
    limit = MAX_FILE_BYTES if max_bytes is None else max_bytes
    try:
        with p.open("rb") as f:
            raw = f.read(limit + 1)  # bounded even for a FIFO or /dev/zero
    except FileNotFoundError:
        raise UserError(f"no such {what}", Location(str(p)), "check the path") from None
    except IsADirectoryError:
        raise UserError(f"{what} is a directory", Location(str(p)), "pass a YAML file") from None
    except PermissionError:
        raise UserError(
            f"cannot read {what}: permission denied", Location(str(p)), "check its permissions"
        ) from None
    except OSError as e:
        raise UserError(f"cannot read {what}: {e.strerror or e}", Location(str(p))) from None
    if len(raw) > limit:
        raise UserError(
            f"{what} is larger than {limit} bytes",
            Location(str(p)),
            "split it, or raise FLEETCTL_MAX_INVENTORY_BYTES if it really is this large",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(
            f"{what} is not UTF-8 text (byte {e.start})", Location(str(p), line), "save it as UTF-8"
        ) from None
    return parse_yaml(text.removeprefix("\ufeff"), str(p))


def parse_yaml(text: str, file: str = "<string>") -> Source:
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        raise _syntax_error(e, text, file) from None
    except yaml.reader.ReaderError as e:
        line = text[: e.position].count("\n") + 1 if isinstance(e.position, int) else None
        raise UserError(
            f"control character {_code(e.character)} is not allowed in YAML",
            Location(file, line),
            "remove it",
        ) from None
    except yaml.YAMLError as e:
        raise UserError(
            f"YAML error: {str(e)[:200]}", Location(file), "fix the YAML syntax"
        ) from None
    src = Source(file, None)
    if root is None:  # an empty document: point at its first line
        src.lines[()] = 1
        return src
    src.data = _Builder(src).build(root, ())
    return src


def _code(ch: object) -> str:
    """ReaderError's character: a str from PyYAML's reader, an int from libyaml's."""
    code = ord(ch) if isinstance(ch, str) and len(ch) == 1 else ch
    return f"{code:#04x}" if isinstance(code, int) else "?"


def _syntax_error(e: yaml.MarkedYAMLError, text: str, file: str) -> UserError:
    mark = e.problem_mark or e.context_mark
    line = mark.line + 1 if mark is not None else None
    problem = e.problem or e.context or "invalid YAML"
    at = _char_at(mark, text)
    if "single document" in f"{e.context} {e.problem}":
        return UserError(
            "the file holds more than one YAML document ('---')",
            Location(file, line),
            "keep one document per file",
        )
    if at == "\t" or "tab character" in problem:
        return UserError(
            "a tab is used for indentation", Location(file, line), "indent with spaces"
        )
    return UserError(
        f"YAML syntax error: {problem}",
        Location(file, line),
        "check the indentation and quoting on this line",
    )


def _char_at(mark: Any, text: str) -> str:
    """The character a syntax error points at ('' past the end)."""
    if mark is None:
        return ""
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    return line[mark.column : mark.column + 1]


class _Scalars(yaml.constructor.SafeConstructor):
    """Resolves plain scalar nodes (ints, floats, bools, nulls, strings) as safe_load would."""


class _Builder:
    """Turns composed nodes into data, within the bounds, recording each field's line."""

    def __init__(self, src: Source):
        self.src = src
        self.scalars = _Scalars()
        self.values = 0
        self.active: set[int] = set()  # nodes being built: one seen again is a recursive alias
        self.depth = 0  # nesting being built, merges (`<<`) included

    def at(self, node: yaml.Node, path: Path_) -> Location:
        return Location(self.src.file, node.start_mark.line + 1, dotted(path) or None)

    def build(self, node: yaml.Node, path: Path_) -> Any:
        self.values += 1
        if self.values > MAX_YAML_VALUES:
            raise UserError(
                f"the document expands to more than {MAX_YAML_VALUES} values",
                self.at(node, path),
                "write it out without aliases that repeat large parts (an alias bomb?)",
            )
        if self.depth > MAX_YAML_DEPTH:
            raise UserError(
                f"the document nests deeper than {MAX_YAML_DEPTH} levels",
                self.at(node, path),
                "flatten it",
            )
        if id(node) in self.active:
            raise UserError(
                "a recursive alias (a value that contains itself)",
                self.at(node, path),
                "point the alias (*name) at something other than its own parent",
            )
        self.src.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, path)
        self.check_tag(node, path)
        self.active.add(id(node))
        self.depth += 1
        try:
            if isinstance(node, yaml.MappingNode):
                return self.mapping(node, path)
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        finally:
            self.depth -= 1
            self.active.discard(id(node))

    def check_tag(self, node: yaml.Node, path: Path_) -> None:
        if node.tag in _PLAIN:
            return
        tag = node.tag.removeprefix(_TAG)
        if tag == "timestamp":
            raise UserError(
                f"{shown(node.value)} reads as a date, not text",
                self.at(node, path),
                "quote it",
            )
        raise UserError(
            f"YAML tag {shown(node.tag if tag == node.tag else '!!' + tag)} is not allowed",
            self.at(node, path),
            "write a plain value (quote it if it is text)",
        )

    def scalar(self, node: yaml.ScalarNode, path: Path_) -> Any:
        self.check_tag(node, path)
        bad = control_char(node.value)
        if bad is not None:
            raise UserError(
                f"control character {ord(bad):#04x} in {shown(node.value)}",
                self.at(node, path),
                "remove it: names, hosts, paths and values are single-line text",
            )
        if node.tag == _STR:  # most scalars: skip the constructor's bookkeeping
            return node.value
        return self.scalars.construct_object(node)

    def key(self, node: yaml.Node, path: Path_) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise UserError(
                "a mapping key must be a plain value",
                self.at(node, path),
                "write the key as a plain word",
            )
        return self.scalar(node, path)

    def mapping(self, node: yaml.MappingNode, path: Path_) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        merged: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:  # `<<: *defaults`: explicit keys win over merged ones
                merged = {**self.merge(value_node, path), **merged}
                continue
            key = self.key(key_node, path)
            if key in out:
                raise UserError(
                    f"duplicate key {shown(key)}",
                    self.at(key_node, path),
                    "remove one of the two entries",
                )
            child = (*path, key if isinstance(key, str) else str(key))
            self.src.lines[child] = key_node.start_mark.line + 1
            out[key] = self.build(value_node, child)
        for key, value in merged.items():
            if key not in out:
                out[key] = value
        return out

    def merge(self, node: yaml.Node, path: Path_) -> dict[Any, Any]:
        """The mapping(s) a merge key names, the first one winning like YAML's `<<` does."""
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        out: dict[Any, Any] = {}
        for item in sources:
            value = self.build(item, path)
            if not isinstance(value, dict):
                raise UserError(
                    "'<<' must name a mapping or a list of mappings",
                    self.at(item, path),
                    "point the alias at a mapping",
                )
            out = {**value, **out}
        return out
