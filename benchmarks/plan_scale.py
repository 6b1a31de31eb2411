"""How `fleetctl plan` time grows with nodes (fixed classes) and with classes (fixed nodes).

Run: python benchmarks/plan_scale.py [--quick] [--objective cost]
Writes generated inventories to benchmarks/out/ and prints a markdown table. Each figure is
the best of several runs; the whole-command figures are wall time of a fresh `fleetctl`
process (interpreter start and imports included), next to `python -c pass` for scale.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from fleetctl.base.jsonout import dump_json
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet

OUT = Path(__file__).resolve().parent / "out"

# (prefix, GPU type, GPUs per node, share of the nodes)
CLASSES = [
    ("h100", "H100-SXM-80GB", 8, 0.10),
    ("a100", "A100-SXM4-80GB", 8, 0.15),
    ("a10040", "A100-SXM4-40GB", 4, 0.15),
    ("l40s", "L40S", 4, 0.20),
    ("l4", "L4", 1, 0.20),
    ("rtx", "RTX-4090", 1, 0.20),
]
EXTRA_TYPES = ["H200", "A100-PCIE-80GB", "H100-PCIE-80GB", "A10G", "RTX-3090", "L40", "RTX-A6000"]

MODELS = """models:
  - name: llama-3.1-70b
    profile: llama-3.1-70b
    variants: {bf16: {source: meta-llama/Llama-3.1-70B-Instruct}, fp8: {source: x/70b-fp8}}
    max_context: 16384
    workload: {requests_per_s: 400, mean_prompt_tokens: 3000, mean_output_tokens: 400}
  - name: mixtral-8x7b
    profile: mixtral-8x7b
    variants: {bf16: {source: mistralai/Mixtral-8x7B-Instruct-v0.1}}
    max_context: 32768
    workload: {requests_per_s: 300, mean_prompt_tokens: 1500, mean_output_tokens: 300}
  - name: llama-3.1-8b
    profile: llama-3.1-8b
    variants: {bf16: {source: meta-llama/Llama-3.1-8B-Instruct}}
    max_context: 16384
    workload: {requests_per_s: 3000, mean_prompt_tokens: 1200, mean_output_tokens: 250}
  - name: mistral-7b
    profile: mistral-7b
    variants: {bf16: {source: a}, gptq-int4: {source: b}}
    max_context: 8192
    workload: {requests_per_s: 2000, mean_prompt_tokens: 800, mean_output_tokens: 200}
"""


def inventory(
    nodes: int, classes: list[tuple[str, str, int, float]], objective: str = "throughput"
) -> str:
    # Objective cost prices each node at its GPU profile's default price.
    lines = [f"planner: {{objective: {objective}}}", "nodes:"]
    total = 0
    for i, (prefix, gpu, count, share) in enumerate(classes):
        n = nodes - total if i == len(classes) - 1 else max(1, round(nodes * share))
        total += n
        # One range per 250 hosts (a /24), as a real inventory would be written.
        start = 0
        while start < n:
            take = min(250, n - start)
            lines += [
                f"  - name: {prefix}-[{start + 1}:{start + take}]",
                f"    host: 10.{i}.{start // 250}.[1:{take}]",
                f"    gpus: {{type: {gpu}, count: {count}}}",
            ]
            start += take
    return "\n".join(lines) + "\n" + MODELS


def class_set(k: int) -> list[tuple[str, str, int, float]]:
    """k classes: the six above, then more GPU types and per-count variants."""
    out = list(CLASSES[:k])
    j = 0
    while len(out) < k:
        gpu = EXTRA_TYPES[j % len(EXTRA_TYPES)]
        count = (1, 2, 4, 8)[(j // len(EXTRA_TYPES)) % 4]
        out.append((f"x{j}", gpu, count, 0.0))
        j += 1
    share = 1.0 / k
    return [(p, g, c, share) for p, g, c, _ in out]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _cli(*args: str) -> None:
    exe = Path(sys.executable).parent / "fleetctl"
    subprocess.run([str(exe), *args], check=True, stdout=subprocess.DEVNULL)


def measure(name: str, text: str, repeat: int) -> dict[str, object]:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.yaml"
    path.write_text(text)
    cat = load_catalog()
    load_s = best(lambda: load_inventory(path, cat), repeat)
    inv = load_inventory(path, cat)
    plan_s = best(lambda: plan_fleet(inv), repeat)
    plan = plan_fleet(inv)
    size = len(dump_json(plan.to_json()))
    return {
        "case": name,
        "nodes": len(inv.nodes),
        "GPUs": sum(n.gpu_count for n in inv.nodes),
        "classes": plan.solver.get("classes"),
        "deployments": len(plan.deployments),
        "load s": load_s,
        "plan s": plan_s,
        "solver s": plan.solver.get("seconds"),
        "fleetctl plan s": best(lambda: _cli("plan", str(path)), repeat),
        "--json s": best(lambda: _cli("plan", str(path), "--json"), repeat),
        "JSON MB": size / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--objective", choices=("throughput", "cost"), default="throughput")
    args = ap.parse_args()
    obj = args.objective
    repeat = 1 if args.quick else 3
    rows = []
    sizes = [100, 1000, 10000] if args.quick else [100, 1000, 3000, 10000]
    for n in sizes:
        rows.append(measure(f"nodes-{n}-classes-6", inventory(n, CLASSES, obj), repeat))
    for k in [1, 2, 6, 12] if args.quick else [1, 2, 4, 6, 12, 24]:
        text = inventory(10000, class_set(k), obj)
        rows.append(measure(f"classes-{k}-nodes-10000", text, repeat))
    base = best(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), repeat)
    exe = Path(sys.executable).parent / "fleetctl"
    helps = best(
        lambda: subprocess.run([str(exe), "--help"], check=True, stdout=subprocess.DEVNULL), 5
    )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print(
            "| "
            + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values())
            + " |"
        )
    print()
    print(f"`fleetctl --help`: {helps:.3f} s; `python -c pass`: {base:.3f} s (best of 5)")


if __name__ == "__main__":
    main()
