"""The tutorial (docs/tutorial.md) run as written: every shell block in order, in an empty
folder, and each output block checked against what its commands printed (harness/tutorial.py
says how the page is read). So a flag renamed, a message reworded or a step that stopped
working fails here.

`fleetctl traces get` downloads from a server on 127.0.0.1 (the Azure slice in tests/data),
never the network. The seconds to the first routed request are printed, not asserted: timing
is measured (benchmarks/first_hour.py), not tested.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import tutorial
from harness.tutorial import holds

REPO = Path(__file__).resolve().parent.parent
SLICE = REPO / "tests" / "data" / "azure_conv_slice.csv"  # source: tests/data/README.md


def test_expected_lines_match_numbers_and_ellipses_only() -> None:
    saved = "Saved 2 entries to .../calibration.json."
    assert holds("Saved 12 entries to /tmp/x/.fleetctl/calibration.json.", saved)
    assert not holds("Saved 2 entries in /tmp/calibration.json.", saved)
    assert holds("- KV budget 6.3  GB =\n", "KV budget 61.2 GB")
    assert not holds("KV budget 61.2 GiB", "KV budget 61.2 GB")


def test_the_page_has_its_steps() -> None:
    found = tutorial.steps(tutorial.PAGE.read_text())
    assert len(found) >= 8, "the tutorial lost its steps"
    assert any(s.expect for s in found)


@pytest.fixture
def trace_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A local HTTP server holding the Azure slice, and the registry that points there."""
    root = tmp_path / "mirror"
    root.mkdir()
    data = SLICE.read_bytes()
    (root / SLICE.name).write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kw: object) -> None:
            super().__init__(*args, directory=str(root), **kw)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    entry = {
        "name": "azure-conv-2023",
        "url": f"http://127.0.0.1:{server.server_address[1]}/{SLICE.name}",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps([entry]))
    yield {"FLEETCTL_TRACE_REGISTRY": str(registry), "FLEETCTL_CACHE": str(tmp_path / "cache")}
    server.shutdown()


def test_the_tutorial_runs_as_written(tmp_path: Path, trace_server: dict[str, str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = str(Path(sys.executable).parent)  # this environment's fleetctl first
    env = {**trace_server, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    took = tutorial.run(work, tmp_path, env)
    print(
        f"tutorial: first routed request after {took['first_routed_s']:.1f} s, "
        f"all of it {took['total_s']:.1f} s (the install excluded)"
    )
