"""A newcomer's first minutes, timed: a fresh clone, the README's install, and the tutorial
(docs/tutorial.md) as written until its first routed request, then to its end.

    python benchmarks/first_hour.py [--out DIR]

The clone is of this checkout's HEAD (a newcomer clones the public repository: the same
files); `pip install .` draws from whatever package index pip is set up for. The tutorial's
public-trace download is served from a local copy of the Azure slice (tests/data), so no step
reaches the network. The target: a routed request within 5 minutes of wall time, installs
included.
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(REPO))

from harness import tutorial  # noqa: E402
from harness.results import header, out_dir  # noqa: E402

SLICE = REPO / "tests" / "data" / "azure_conv_slice.csv"


def timed(cmd: list[str], cwd: Path) -> float:
    started = time.monotonic()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    return time.monotonic() - started


def serve_slice(root: Path) -> tuple[http.server.ThreadingHTTPServer, Path]:
    """The Azure slice from 127.0.0.1, and a trace registry that points there."""
    data = SLICE.read_bytes()
    (root / SLICE.name).write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kw)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    registry = root / "registry.json"
    entry = {
        "name": "azure-conv-2023",
        "url": f"http://127.0.0.1:{server.server_address[1]}/{SLICE.name}",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    registry.write_text(json.dumps([entry]))
    return server, registry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "first_hour"))
    args = ap.parse_args()
    out = out_dir(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        started = time.monotonic()
        clone_s = timed(["git", "clone", "-q", str(REPO), str(base / "fleetctl")], base)
        clone = base / "fleetctl"
        venv_s = timed([sys.executable, "-m", "venv", ".venv"], clone)
        install_s = timed([str(clone / ".venv/bin/pip"), "install", "-q", "."], clone)
        server, registry = serve_slice(base)
        work = base / "work"
        work.mkdir()
        env = {
            "PATH": f"{clone / '.venv/bin'}:/usr/bin:/bin",
            "FLEETCTL_TRACE_REGISTRY": str(registry),
            "FLEETCTL_CACHE": str(base / "cache"),
        }
        before = time.monotonic() - started
        took = tutorial.run(work, out, env, page=clone / "docs" / "tutorial.md")
        server.shutdown()
    routed = before + took["first_routed_s"]
    lines = [
        *header(__file__, time.monotonic() - started),
        "",
        "| phase | seconds |",
        "|---|---|",
        f"| git clone | {clone_s:.1f} |",
        f"| python -m venv | {venv_s:.1f} |",
        f"| pip install . | {install_s:.1f} |",
        f"| tutorial to its first routed request | {took['first_routed_s']:.1f} |",
        f"| **from nothing to a routed request** | **{routed:.1f}** (target 300) |",
        f"| the whole tutorial, after the install | {took['total_s']:.1f} |",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
