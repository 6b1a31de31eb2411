"""YAML files read into plain data plus the line of every field, so errors can point at it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetctl.errors import Location, UserError

try:  # libyaml's composer is ~10x faster on inventories with thousands of nodes
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - depends on how PyYAML was built
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

Path_ = tuple[str | int, ...]


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


def load_yaml(path: str | Path, what: str = "file") -> Source:
    """Read a YAML file; every failure is a UserError naming the file and line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"no such {what}", fix_location(p), "check the path") from None
    except IsADirectoryError:
        raise UserError(f"{what} is a directory", fix_location(p), "pass a YAML file") from None
    except PermissionError:
        raise UserError(
            f"cannot read {what}: permission denied", fix_location(p), "check its permissions"
        ) from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} is not UTF-8 text (byte {e.start})", fix_location(p), "save it as UTF-8"
        ) from None
    return parse_yaml(text, str(p))


def fix_location(p: Path) -> Location:
    return Location(str(p))


def parse_yaml(text: str, file: str = "<string>") -> Source:
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = e.problem or e.context or "invalid YAML"
        raise UserError(
            f"YAML syntax error: {problem}",
            Location(file, line),
            "check the indentation and quoting on this line",
        ) from None
    except yaml.YAMLError as e:
        raise UserError(f"YAML error: {e}", Location(file), "fix the YAML syntax") from None
    src = Source(file, None)
    if root is None:  # an empty document: point at its first line
        src.lines[()] = 1
        return src
    src.data = _build(root, (), src, _Scalars())
    return src


class _Scalars(yaml.constructor.SafeConstructor):
    """Resolves scalar nodes (ints, bools, nulls, timestamps) as safe_load would."""


def _build(node: yaml.Node, path: Path_, src: Source, scalars: _Scalars) -> Any:
    src.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        scalars.flatten_mapping(node)  # applies YAML merge keys (<<)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = scalars.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool) and key is not None:
                raise UserError(
                    "a mapping key must be a plain value",
                    Location(src.file, key_node.start_mark.line + 1, dotted(path) or None),
                    "write the key as a plain word",
                )
            if key in out:
                raise UserError(
                    f"duplicate key {key!r}",
                    Location(src.file, key_node.start_mark.line + 1, dotted(path) or None),
                    "remove one of the two entries",
                )
            child = (*path, key if isinstance(key, str) else str(key))
            src.lines[child] = key_node.start_mark.line + 1
            out[key] = _build(value_node, child, src, scalars)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, (*path, i), src, scalars) for i, item in enumerate(node.value)]
    return scalars.construct_object(node, deep=True)
