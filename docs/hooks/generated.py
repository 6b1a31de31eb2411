"""Reference pages generated from the code itself, committed, and checked so they cannot drift.

A page holds a region per generated part, between `<!-- generated: NAME -->` and
`<!-- end generated: NAME -->`: `cli` is every command's `--help` (from the typer app),
`inventory-schema` the inventory's fields (from its pydantic models, the ones `validate`
checks against), `traces` the public traces `fleetctl traces` knows. The regions are
committed so the pages read whole in the repository; `python docs/hooks/generated.py`
rewrites them from the code, `--check` says which differ (tests/docs/test_docs_reference.py runs
it), and as an MkDocs hook it fills them again at every build.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

WIDTH = 100
DOCS = Path(__file__).resolve().parent.parent
REGION = re.compile(r"<!-- generated: ([\w-]+) -->(?:\n.*?<!-- end generated: \1 -->)?", re.S)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return fill(markdown)


def fill(markdown: str) -> str:
    """`markdown` with each generated region holding what the code gives now."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        return f"<!-- generated: {name} -->\n{PARTS[name]()}\n<!-- end generated: {name} -->"

    return REGION.sub(one, markdown)


def pages() -> list[Path]:
    """The docs pages that hold a generated region."""
    return [p for p in sorted(DOCS.rglob("*.md")) if REGION.search(p.read_text(encoding="utf-8"))]


def main(argv: list[str]) -> int:
    """Rewrite the pages' generated regions; with --check, only name the pages that differ."""
    check = "--check" in argv
    stale = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        fresh = fill(text)
        if fresh != text:
            stale.append(page)
            if not check:
                page.write_text(fresh, encoding="utf-8")
    for page in stale:
        verb = "differs from the code" if check else "rewritten"
        print(f"{page.relative_to(DOCS.parent)}: {verb}", file=sys.stderr)
    if check and stale:
        print("run `python docs/hooks/generated.py` and commit the pages", file=sys.stderr)
    return 1 if check and stale else 0


def traces_table() -> str:
    """The public traces `fleetctl traces` knows, from its own registry."""
    from fleetctl.base.public_traces import BUILTIN

    out = ["| name | what | licence | size | sha256 |", "|---|---|---|---|---|"]
    for t in BUILTIN:
        out.append(
            f"| `{t.name}` | {t.description} ([source]({t.url})) | {t.license} | "
            f"{t.size / 1e6:.1f} MB | `{t.sha256[:16]}...` |"
        )
    out.append("")
    out += [f"- `{t.name}`: {t.citation}" for t in BUILTIN if t.citation]
    return "\n".join(out)


def cli_reference() -> str:
    """Each command's help as `fleetctl COMMAND --help` prints it, in the app's order."""
    from fleetctl.cli import app

    # Typer may carry its own copy of click: its classes, not this module's, make contexts.
    root = typer.main.get_command(app)
    top = root.context_class(
        root, info_name="fleetctl", terminal_width=WIDTH, max_content_width=WIDTH
    )
    out: list[str] = []

    def walk(cmd: Any, ctx: Any, path: list[str]) -> None:
        if path == ["emulate"]:  # it takes `vllm serve`'s flags: argparse, not typer, has them
            from fleetctl.emulator.args import _parser

            os.environ["COLUMNS"] = str(WIDTH)  # argparse wraps to the terminal's width
            help_text = _parser().format_help()
        elif path:
            help_text = cmd.get_help(ctx)
        if path:
            out.extend([f"## `fleetctl {' '.join(path)}`", "", "```text", help_text, "```", ""])
        for name, sub in getattr(cmd, "commands", {}).items():
            if sub.hidden:
                continue
            child = sub.context_class(
                sub, info_name=name, parent=ctx, terminal_width=WIDTH, max_content_width=WIDTH
            )
            walk(sub, child, [*path, name])

    walk(root, top, [])
    return "\n".join(out)


def inventory_schema() -> str:
    """One table per section of the inventory: field, type, default and bounds."""
    from fleetctl.fleet.inventory import InventorySpec

    schema = InventorySpec.model_json_schema()
    defs = schema.get("$defs", {})
    out: list[str] = []
    sections = [("InventorySpec", schema), *sorted(defs.items())]
    for name, spec in sections:
        title = "the inventory (top level)" if name == "InventorySpec" else name
        out += [f"### {title}", ""]
        if spec.get("description"):
            out += [" ".join(spec["description"].split()), ""]
        out += ["| field | type | required / default | bounds |", "|---|---|---|---|"]
        required = set(spec.get("required", []))
        for field, prop in spec.get("properties", {}).items():
            need = "required" if field in required else f"`{_default(prop)}`"
            bounds = "; ".join(b for b in (_bounds(prop), prop.get("description", "")) if b)
            out.append(f"| `{field}` | {_type(prop)} | {need} | {bounds} |")
        out.append("")
    return "\n".join(out)


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        ref = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{ref}](#{ref.lower()})"
    if "anyOf" in prop:
        kinds = [_type(p) for p in prop["anyOf"]]
        return " or ".join(k for k in kinds if k != "null") + (
            " or null" if "null" in kinds else ""
        )
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    if kind == "object":
        extra = prop.get("additionalProperties")
        return f"map of {_type(extra)}" if isinstance(extra, dict) else "mapping"
    return str(kind)


def _default(prop: dict[str, Any]) -> str:
    """The default as YAML writes it; a field built empty when left out (a list, a mapping)
    has none in the schema."""
    if "default" not in prop:
        return "empty"
    return json.dumps(prop["default"]).replace("|", "\\|")


def _bounds(prop: dict[str, Any]) -> str:
    marks = {
        "minimum": ">=",
        "exclusiveMinimum": ">",
        "maximum": "<=",
        "exclusiveMaximum": "<",
        "minLength": "length >=",
        "maxLength": "length <=",
    }
    found = [
        f"{mark} {prop[key]:g}" if isinstance(prop[key], float) else f"{mark} {prop[key]}"
        for key, mark in marks.items()
        if key in prop
    ]
    for sub in prop.get("anyOf", []):
        found += [b for b in [_bounds(sub)] if b]
    return ", ".join(found)


PARTS: dict[str, Callable[[], str]] = {
    "cli": cli_reference,
    "inventory-schema": inventory_schema,
    "traces": traces_table,
}

if __name__ == "__main__":
    sys.path.insert(0, str(DOCS.parent))  # this checkout's fleetctl, not an installed one
    sys.exit(main(sys.argv[1:]))
