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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, str(REPO))

from harness import tutorial  # noqa: E402
from harness.results import header, out_dir  # noqa: E402


def timed(cmd: list[str], cwd: Path) -> float:
    started = time.monotonic()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    return time.monotonic() - started


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
        work = base / "work"
        work.mkdir()
        with tutorial.trace_mirror(base / "mirror") as mirror:
            env = {"PATH": f"{clone / '.venv/bin'}:/usr/bin:/bin", **mirror}
            before = time.monotonic() - started
            took = tutorial.run(work, out, env, page=clone / "docs" / "tutorial.md")
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
