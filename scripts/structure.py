"""Counts of the code's shape, read from its imports and definitions: what a new maintainer
trips over first.

    python scripts/structure.py [--json] [--list]

- files directly in fleetctl/ (the rest sit in packages named for what they own);
- imports that run up the layers (LAYERS below, which tests/test_layers.py enforces), and
  import cycles between modules;
- modules over 500 lines, and whether their docstring says why they are one module;
- functions over 60 lines (nested functions count inside their parent and on their own).

`--list` names each module and function counted. Exit 0 always: the tests enforce the layers.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "fleetctl"
LONG_MODULE, LONG_FUNCTION = 500, 60

# Lower layers first: the folders, in the order of the data flow. A module may import its own
# layer and any below it, never above. An entry names a package or a module (`fleet.ssh`); a
# module's layer is that of the longest entry its dotted name starts with.
LAYERS: list[tuple[str, ...]] = [
    ("base",),  # errors, limits, names, YAML sources, text, tables: nothing of GPUs or vLLM
    ("vllm",),  # what vLLM does, read from its sources: releases, flags, /metrics, hashes
    ("model",),  # profiles, the performance model, its calibration, one server's estimate
    ("fleet",),  # the inventory, prices, facts, plan and state documents, the state folder
    ("fleet.http", "fleet.ssh"),  # reaching nodes
    ("fleet.probe", "fleet.health"),  # what the nodes report
    ("planner",),  # placement
    ("routing",),  # the pure routing core: policies, scheduler, sessions
    ("sim",),  # the same core over simulated engines
    ("whatif",),  # a fleet's deployments simulated on a trace; cost plans checked by it
    ("planner.make",),  # a fleet's plan from facts, calibration and SLO-checked cost plans
    ("daemon",),  # route-serve: the same core behind HTTP
    ("emulator",),  # a vLLM-like server for tests and benchmarks
    ("apply",),  # carrying a plan out over SSH
    ("autopilot",),  # the fleet following its traffic: forecasts, re-plans, sleeps and wakes
    ("cli", "__main__", "__init__"),
]
# Modules and packages that do no I/O: no network, no event loop, no processes.
PURE = (
    "base.errors",
    "base.names",
    "base.validation",
    "base.yamlsrc",
    "vllm",
    "model",
    "fleet.inventory",
    "fleet.prices",
    "fleet.facts",
    "fleet.facts_parse",
    "fleet.plan",
    "fleet.state",
    "fleet.engines",
    "planner",
    "routing",
    "sim",
    "whatif",
    "autopilot.forecast",
    "autopilot.changes",
    "autopilot.decide",
)
IO_LIBRARIES = ("aiohttp", "asyncio", "redis", "paramiko", "urllib", "socket", "subprocess")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """Every fleetctl module `path` imports, anywhere in it, as absolute names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                # `from fleetctl.cli import common` imports the module fleetctl.cli.common;
                # `from fleetctl.fleet.plan import Plan` imports fleetctl.fleet.plan.
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    # Importing a.b.c runs a/b/__init__.py first: a dependency on the package too, unless the
    # importer lives inside it (Python is already running that __init__ then).
    for name in list(out):
        parts = name.split(".")
        for n in range(2, len(parts)):
            parent = ".".join(parts[:n])
            if not (me + ".").startswith(parent + "."):
                out.add(parent)
    return {i for i in out if i in modules and i != me}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    return {name: imports(path, set(modules)) for name, path in modules.items()}


def layer_of(module: str) -> int:
    name = module.removeprefix("fleetctl.") if "." in module else "__init__"
    best, found = "", -1
    for i, names in enumerate(LAYERS):
        for entry in names:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > len(best):
                best, found = entry, i
    assert found >= 0, f"{module}: no layer; add its package to LAYERS"
    return found


def io_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle found, as the modules around it (a package importing its own modules
    to register them is not one)."""
    state: dict[str, int] = {}
    path: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if d.startswith(m + "."):  # a package importing its own modules
                continue
            if state.get(d) == 1:
                found.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def functions(tree: ast.Module, module: str) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            out.append((f"{module}:{node.lineno} {node.name}", length))
    return out


def measure() -> dict[str, Any]:
    paths = sorted(PKG.rglob("*.py"))
    trees = {module_name(p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in paths}
    g = graph()
    upward = [
        f"{m} imports {i}"
        for m, deps in g.items()
        for i in deps
        if layer_of(i) > layer_of(m) and m != "fleetctl"
    ]
    long_modules: list[dict[str, Any]] = []
    for m, (p, tree) in trees.items():
        lines = len(p.read_text(encoding="utf-8").splitlines())
        if lines > LONG_MODULE:
            doc = ast.get_docstring(tree) or ""
            why = "kept whole because" in doc.lower() or "one module because" in doc.lower()
            long_modules.append({"module": m, "lines": lines, "says_why": why})
    long_functions = [
        {"function": name, "lines": n}
        for m, (_, tree) in trees.items()
        for name, n in functions(tree, m)
        if n > LONG_FUNCTION
    ]
    return {
        "files_at_top": sorted(p.name for p in PKG.glob("*.py")),
        "modules": len(trees),
        "upward_imports": sorted(upward),
        "cycles": [" -> ".join(c) for c in cycles(g)],
        "modules_over_500_lines": sorted(long_modules, key=lambda x: -x["lines"]),
        "functions_over_60_lines": sorted(long_functions, key=lambda x: -x["lines"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--list", action="store_true", help="name what each count counts")
    args = parser.parse_args()
    got = measure()
    if args.json:
        json.dump(got, sys.stdout, indent=1)
        print()
        return
    counts = {k: len(v) if isinstance(v, list) else v for k, v in got.items()}
    justified = sum(m["says_why"] for m in got["modules_over_500_lines"])
    for key, value in counts.items():
        extra = f" ({justified} say why they are one module)" if key.startswith("modules_") else ""
        print(f"{key.replace('_', ' ')}: {value}{extra}")
        if args.list and isinstance(got[key], list):
            for item in got[key]:  # type: ignore[attr-defined]
                print(f"  {item if isinstance(item, str) else ' '.join(map(str, item.values()))}")


if __name__ == "__main__":
    main()
