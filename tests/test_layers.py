"""The package's dependency graph: imports only run down the layers, and nothing is a cycle.

Every `import` counts, those inside functions too, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "fleetctl"

# Lower layers first. A module may import its own layer and any below it, never above.
LAYERS: list[tuple[str, ...]] = [
    (
        "errors",
        "limits",
        "text",
        "jsonout",
        "resources",
        "tables",
        "vllm_release",
        "vllm_metrics",
        "vllm_hash",
    ),
    ("names", "validation", "yamlsrc", "vllm_flags"),
    ("catalog", "hfconfig"),
    ("inventory", "cost"),
    ("perf",),
    ("plan", "facts", "facts_parse", "calibration", "startup"),
    ("state",),
    ("statedir", "planner", "routing", "progress", "estimate"),
    ("sim", "ssh", "http"),
    ("whatif",),  # a fleet's deployments simulated on a trace
    ("slo_plan",),  # cost plans checked by whatif against each model's SLO
    ("probe", "health", "router", "emulator", "calibrate_io"),
    ("apply", "warmup"),
    ("render",),
    ("cli", "__main__", "__init__"),
]
PURE = (
    "routing",
    "planner",
    "cost",
    "perf",
    "plan",
    "state",
    "facts",
    "facts_parse",
    "sim",
    "whatif",
    "slo_plan",
    "calibration",
    "startup",
    "vllm_metrics",
    "vllm_hash",
)
IO_LIBRARIES = ("aiohttp", "asyncio", "redis", "paramiko", "urllib", "socket", "subprocess")


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
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
                # `from fleetctl.plan import Plan` imports fleetctl.plan.
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
    top = module.split(".")[1] if "." in module else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: no layer; add its top-level name to LAYERS")


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)


def test_imports_run_down_the_layers():
    upward = [
        f"{m} (layer {layer_of(m)}) imports {i} (layer {layer_of(i)})"
        for m, deps in graph().items()
        for i in deps
        if layer_of(i) > layer_of(m) and not (m == "fleetctl" and i.startswith("fleetctl."))
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_cycles_even_through_imports_inside_functions():
    g = graph()
    g["fleetctl"] = set()  # the package's own __init__ only names the version
    state: dict[str, int] = {}
    path: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            # A package imports its own submodules to register them: that is not a cycle.
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                found.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not found, "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("top", PURE)
def test_the_pure_core_does_no_io(top):
    """Planner, routing core, model and simulator: no network, no event loop, no processes."""
    offenders = []
    for path in sorted(PKG.glob(f"{top}/**/*.py")) or [PKG / f"{top}.py"]:
        for i in io_imports(path):
            if i.split(".")[0] in IO_LIBRARIES:
                offenders.append(f"{module_name(path)} imports {i}")
    assert not offenders, "\n".join(offenders)


def io_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out
