"""How fast real vLLM servers read their weights at start-up, against fleetctl's estimate.

Reads the real GPU start-up log lines quoted in benchmarks/accuracy/kv_points.yaml (each row
names its public source) with the parser apply uses (fleetctl.model.calibration.parse_startup_log):
"Model loading took X GiB [memory] and Y seconds", per rank. Prints each row's read rate per
rank, and the estimate's weights term (all the server's weights / DISK_READ_BYTES_S) beside
the measured load.

    python benchmarks/warmup_load_rate.py
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetctl.apply.warmup import DISK_READ_BYTES_S
from fleetctl.model.calibration import parse_startup_log

POINTS = Path(__file__).resolve().parent / "accuracy" / "kv_points.yaml"
GIB = 2**30


def main() -> None:
    doc = yaml.safe_load(POINTS.read_text())
    rows = doc["points"] if isinstance(doc, dict) else doc
    out = []
    for r in rows:
        line = next((x for x in (r.get("quote") or "").splitlines() if "Model loading" in x), "")
        took = parse_startup_log(line).get("model_load_s")
        gib = re.search(r"took ([0-9.]+) GiB", line)
        if took is None or gib is None:
            continue
        per_rank = float(gib.group(1)) * GIB
        tp = int(r.get("tensor_parallel_size") or 1)
        estimate = per_rank * tp / DISK_READ_BYTES_S
        out.append((r["id"], tp, per_rank / took / 1e9, took, estimate))
    print(f"{'row':44} {'TP':>2} {'GB/s/rank':>9} {'load s':>7} {'estimate s':>10}")
    for row, tp, rate, took, est in out:
        print(f"{row:44} {tp:>2} {rate:>9.2f} {took:>7.1f} {est:>10.1f}")
    rates = sorted(r[2] for r in out)
    ratios = sorted(r[4] / r[3] for r in out)
    n = len(out)
    print(
        f"\n{n} rows: read rate per rank median {statistics.median(rates):.2f} GB/s "
        f"(p10 {rates[n // 10]:.2f}, p90 {rates[9 * n // 10]:.2f}); estimate / measured load: "
        f"median {statistics.median(ratios):.2f} (p10 {ratios[n // 10]:.2f}, "
        f"p90 {ratios[9 * n // 10]:.2f})"
    )
    tp1 = sorted(r[4] / r[3] for r in out if r[1] == 1)
    tpn = sorted(r[4] / r[3] for r in out if r[1] > 1)
    print(
        f"TP=1: {len(tp1)} rows, median ratio {statistics.median(tp1):.2f}; "
        f"TP>1: {len(tpn)} rows, median ratio {statistics.median(tpn):.2f}"
    )


if __name__ == "__main__":
    main()
