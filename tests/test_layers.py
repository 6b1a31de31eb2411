"""The package's dependency graph: imports only run down the layers, and nothing is a cycle.

Every `import` counts, those inside functions too, so a lazy import cannot hide a cycle. The
layers and the graph are read by scripts/structure.py, which also counts the code's shape.
"""

from __future__ import annotations

import pytest

from scripts.structure import (
    IO_LIBRARIES,
    PKG,
    PURE,
    REPO,
    cycles,
    graph,
    imports,
    io_imports,
    layer_of,
    module_name,
)


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


def test_benchmarks_and_the_harness_stay_below_the_command_line():
    """Planning, applying and deriving workloads are the library's, which the command line, the
    benchmarks and the harness all call: none of them reaches into a cli module (which parses
    options and renders). Running the command line whole (`from fleetctl.cli import main`) is
    what it is for."""
    modules = set(graph())
    offenders = [
        f"{path.relative_to(REPO)} imports {i}"
        for folder in ("benchmarks", "harness", "scripts")
        for path in sorted((REPO / folder).glob("**/*.py"))
        for i in sorted(imports(path, modules))
        if i.startswith("fleetctl.cli.")
    ]
    assert not offenders, "\n".join(offenders)


def test_no_cycles_even_through_imports_inside_functions():
    g = graph()
    g["fleetctl"] = set()  # the package's own __init__ only names the version
    found = cycles(g)
    assert not found, "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("top", PURE)
def test_the_pure_core_does_no_io(top):
    """Planner, routing core, model and simulator: no network, no event loop, no processes."""
    offenders = []
    folder = PKG / top.replace(".", "/")
    for path in sorted(folder.glob("**/*.py")) or [folder.with_suffix(".py")]:
        for i in io_imports(path):
            if i.split(".")[0] in IO_LIBRARIES:
                offenders.append(f"{module_name(path)} imports {i}")
    assert not offenders, "\n".join(offenders)
