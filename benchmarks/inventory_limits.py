"""Worst-case inventories against the input bounds: `fleetctl validate`'s time and peak memory.

Each case is a file written to a temporary folder and validated in a fresh process (so peak
RSS is that process's own); the process's interpreter start-up and imports are measured alone
as `baseline` and shown beside it. The target: any inventory up to the caps is validated
or refused in under 1 s and 150 MB.

    python benchmarks/inventory_limits.py            # table in markdown
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetctl.base.limits import MAX_FILE_BYTES, MAX_NODES

MODEL = (
    "models:\n  - name: llama-3-8b\n    profile: llama-3-8b\n"
    "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}\n    max_context: 8192\n"
)


def nodes_listed(n: int, label_bytes: int = 0) -> str:
    """n nodes written out one by one (no ranges), optionally with long labels."""
    pad = "x" * label_bytes
    rows = [
        f"  - {{name: node-{i}, host: 10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}, "
        f"gpus: {{type: A100-SXM4-80GB, count: 8}}"
        + (f", labels: {{rack: r{i % 40}, note: a{pad}}}" if label_bytes else "")
        + "}\n"
        for i in range(n)
    ]
    return "nodes:\n" + "".join(rows) + MODEL


def to_size(text_of_n, limit: int) -> str:
    """The largest listing of nodes under `limit` bytes."""
    lo, hi = 1, 200_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(text_of_n(mid).encode()) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return text_of_n(lo)


def bomb(levels: int) -> str:
    out = "x: &a0 [a,a,a,a,a,a,a,a,a]\n"
    for i in range(1, levels):
        out += f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n"
    return out + "nodes: [*a" + str(levels - 1) + "]\n"


CASES = {
    "baseline: --version": None,
    f"{MAX_NODES} nodes as one range": "nodes:\n  - {name: 'n-[1:"
    + str(MAX_NODES)
    + "]', gpus: {type: L4, count: 8}}\n"
    + MODEL,
    "10 ranges of 99,999 nodes (refused)": "nodes:\n"
    + "".join(f"  - {{name: 'x{i}-[1:99999]', gpus: {{type: L4}}}}\n" for i in range(10))
    + MODEL,
    f"{MAX_NODES} nodes listed": nodes_listed(MAX_NODES),
    "file at the size cap (nodes with labels; refused: too many)": to_size(
        lambda n: nodes_listed(n, 300), MAX_FILE_BYTES
    ),
    "file at the size cap, nodes listed (refused)": to_size(nodes_listed, MAX_FILE_BYTES),
    "alias bomb, 9 levels of 9 (refused)": bomb(9),
    "nesting 10,000 deep (refused)": "nodes: " + "[" * 10_000 + "]" * 10_000 + "\n",
    "one 3 MB value (refused)": "nodes:\n  - {name: '" + "n" * 3_000_000 + "', gpus: {type: L4}}\n",
    "file over the size cap (refused)": "#" * (MAX_FILE_BYTES + 1),
}


# Runs fleetctl's main() and, at exit, writes the process's peak RSS (VmHWM: per address
# space, so not inflated by the parent's pages the way a forked child's ru_maxrss is).
WRAP = """
import atexit, os, sys
def hwm():
    kb = next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]
    open(os.environ['HWM_FILE'], 'w').write(kb)
atexit.register(hwm)
sys.argv = ['fleetctl', *sys.argv[1:]]
from fleetctl.cli import main
main()
"""


def measure(args: list[str], tmp: str) -> tuple[float, float, int]:
    """Best seconds of three runs, peak RSS MB and exit code of `fleetctl ARGS`."""
    best, peak, code = float("inf"), 0.0, 0
    hwm = Path(tmp) / "hwm"
    for _ in range(3):
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-c", WRAP, *args],
            env={**os.environ, "HWM_FILE": str(hwm)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, int(hwm.read_text()) / 1024)
        code = r.returncode
    return best, peak, code


def main() -> None:
    print("| case | file KB | exit | seconds | peak RSS MB |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for i, (name, text) in enumerate(CASES.items()):
            if text is not None:
                files[name] = Path(tmp) / f"case{i}.yaml"
                files[name].write_text(text)
        for name in CASES:
            path = files.get(name)
            secs, mb, code = measure(["validate", str(path)] if path else ["version"], tmp)
            size = path.stat().st_size / 1024 if path else 0
            print(f"| {name} | {size:,.0f} | {code} | {secs:.3f} | {mb:.0f} |", flush=True)


if __name__ == "__main__":
    main()
