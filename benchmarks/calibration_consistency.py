"""One calibration, every command: the figures estimate, plan, simulate and status print for a
calibrated class, beside the node's truth and the GPU's physical ceiling.

    python benchmarks/calibration_consistency.py [--out DIR]

Three real emulators on loopback, each calibrated by `fleetctl calibrate` under live traffic:
- skewed: an RTX 4090 whose truth is 30% less speed and 15% less KV cache than its profile
  (`--truth-speed 0.7 --truth-kv 0.85`), 10 clients ramping up;
- own profile: a new user's case, an emulator of its own profile at 3-7 concurrent
  requests, where a fit stretched to batch 1 once printed 112.7 tok/s past the roofline;
- mixed prefill: the skewed node's speed under heavier prefill, six clients sending distinct
  400-700-token prompts (no prefix-cache hits) for 48-112 tokens each, where the prompt
  chunks computed beside the decodes were once read as slow decoding (18% below the truth).

Then estimate (batch 1, 8 and 32), plan --json, simulate --json and status's engines read the
one calibration file. The report gives each command's decode tok/s per sequence at those
batches, prefill tok/s and KV tokens, the spread between commands, the error against the
node's truth, and the roofline: weights and KV read at peak bandwidth, prefill FLOPs at peak.
tests/model/test_calibration_consistency.py is the suite's version of the same checks.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fleetctl.emulator.truth import slower
from fleetctl.fleet.engines import server_engines
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.planner import plan_fleet
from harness.commands import emulate_cmd
from harness.procs import Proc, free_port
from harness.ready import http_request, wait_status
from harness.results import header, machine, out_dir

NAME, SOURCE, SCALE = "llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "20"
BATCHES = ("1", "8", "32")
UTILIZATION = 0.92
INVENTORY = f"""\
nodes:
  - name: rtx-1
    host: 127.0.0.1
    gpus: {{type: RTX-4090, count: 1}}
models:
  - name: {NAME}
    profile: {NAME}
    variants:
      bf16: {{source: {SOURCE}}}
    max_context: 8192
    gpu_memory_utilization: {UTILIZATION}
    workload: {{requests_per_s: 1, mean_prompt_tokens: 500, mean_output_tokens: 64}}
"""
Traffic = tuple[tuple[int, int] | None, tuple[int, int]]  # prompt tokens (None: text), output
TEXT: Traffic = (None, (20, 200))
CASES: dict[str, tuple[float, float, int, float, Traffic]] = {
    # name: (truth speed, truth KV, clients, the window's seconds, traffic)
    "skewed (0.7x speed, 0.85x KV)": (0.7, 0.85, 10, 8.0, TEXT),
    "own profile, 3-7 concurrent": (1.0, 1.0, 5, 6.0, TEXT),
    "mixed prefill (0.7x speed, 400-700-token prompts, 6 concurrent)": (
        0.7, 1.0, 6, 8.0, ((400, 700), (48, 112)),
    ),
}  # fmt: skip


class Load:
    """Clients sending completions of mixed lengths, one more joining per finished request,
    so the calibration's windows see different batch sizes. Prompts are text sharing its
    prefix, or, with a range of prompt tokens, distinct token ids that the prefix cache never
    holds."""

    def __init__(self, port: int, clients: int, traffic: Traffic = TEXT) -> None:
        self.port, self.stop, self.done = port, threading.Event(), 0
        self.traffic = traffic
        self.threads = [threading.Thread(target=self.run, args=(k,)) for k in range(clients)]

    def run(self, k: int) -> None:
        rng = random.Random(k)
        while not self.stop.is_set():
            prompts, outputs = self.traffic
            prompt: str | list[int] = "hi " * rng.randint(50, 400)
            if prompts is not None:
                prompt = [rng.randrange(100, 30_000) for _ in range(rng.randint(*prompts))]
            tokens = rng.randint(*outputs)
            body = {"model": NAME, "prompt": prompt, "max_tokens": tokens}
            status, _, _ = http_request(self.port, "POST", "/v1/completions", body, None, 120)
            if status != 200:
                raise SystemExit(f"the emulator answered HTTP {status}")
            self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            want = self.done + 1
            t.start()
            end = time.monotonic() + 30
            while self.done < want and time.monotonic() < end:
                time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def fleetctl(*args: object) -> str:
    cmd = [sys.executable, "-m", "fleetctl", *(str(a) for a in args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[2:])} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def run_case(
    work: Path, speed: float, kv: float, clients: int, window: float, traffic: Traffic
) -> dict[str, Any]:
    port = free_port()
    flags = ["--truth-speed", str(speed), "--truth-kv", str(kv)]
    cmd = emulate_cmd(port, "RTX-4090", NAME, SOURCE, NAME, SCALE, *flags)
    emu = Proc(f"emulator-{port}", cmd, work)
    inv, backends, state = work / "fleet.yaml", work / "backends.yaml", work / ".fleetctl"
    inv.write_text(INVENTORY)
    entry = {"url": f"http://127.0.0.1:{port}", "node": "rtx-1", "gpu_type": "RTX-4090"}
    backends.write_text(json.dumps({"backends": [{**entry, "model": NAME}]}))
    try:
        wait_status(port, "/health", emu, 200, 60)
        with Load(port, clients, traffic):
            fleetctl("calibrate", inv, "--backends", backends, "--state-dir", state,
                     "--window", window, "--interval", 0.25)  # fmt: skip
    finally:
        emu.stop()

    est: list[object] = ["estimate", "--gpu", "RTX-4090", "--model", NAME, "--format", "bf16"]
    est += ["--json", "--gpu-memory-utilization", UTILIZATION, "--state-dir", state]
    by_batch = {b: json.loads(fleetctl(*est, "--batch", b)) for b in BATCHES}
    estimate = {
        "kv_cache_tokens": by_batch["1"]["kv_cache_tokens"],
        "prefill_tok_s": by_batch["1"]["prefill_tok_s"],
        "decode_tok_s_per_seq_at_batch": {b: by_batch[b]["decode_tok_s_per_seq"] for b in BATCHES},
    }
    plan = json.loads(fleetctl("plan", inv, "--json"))["deployments"][0]["perf"]
    sim = json.loads(fleetctl("simulate", inv, "--workload", "rate=1,duration=5",
                              "--policies", "hardware-aware", "--json"))  # fmt: skip
    calibration = StateDir(state).load_calibration()
    loaded = load_inventory(inv, load_catalog())
    deployments = plan_fleet(loaded, None, calibration).deployments
    status = next(iter(server_engines(loaded, State(1, deployments), calibration).values()))

    cat = load_catalog()
    gpu, model, fmt = cat.gpu("RTX-4090"), cat.model(NAME), cat.format("bf16")
    truth = EnginePerf(slower(gpu, speed), model, fmt)
    profile = EnginePerf(gpu, model, fmt)
    context, prompt = by_batch["1"]["context"], by_batch["1"]["prompt"]
    return {
        "commands": {
            "estimate": estimate,
            "plan": plan,
            "simulate": sim["perf"]["RTX-4090/bf16"],
            "status": status.figures(),
        },
        "truth": {
            "kv_cache_tokens": int(
                kv_budget(gpu, model, fmt, gpu_memory_utilization=UTILIZATION).kv_tokens * kv
            ),
            "prefill_tok_s": prompt / truth.prefill_time(prompt),
            "decode_tok_s_per_seq_at_batch": {
                b: 1.0 / truth.step_time(int(b), int(b) * context) for b in BATCHES
            },
        },
        "ceiling": {
            "prefill_tok_s": profile.max_prefill_tok_s(prompt),
            "decode_tok_s_per_seq_at_batch": {
                b: 1.0 / profile.min_step_s(int(b), int(b) * context) for b in BATCHES
            },
        },
        "source": by_batch["1"]["source"],
    }


def figures_row(name: str, f: dict[str, Any]) -> str:
    decode = f["decode_tok_s_per_seq_at_batch"]
    cells = [f"{decode[b]:.1f}" for b in BATCHES]
    kv = f.get("kv_cache_tokens")
    return f"| {name} | {' | '.join(cells)} | {f['prefill_tok_s']:,.0f} | {kv or '-'} |"


def report(results: dict[str, dict[str, Any]], took_s: float) -> list[str]:
    lines = header(__file__, took_s)
    for case, r in results.items():
        lines += ["", f"## {case}", "", "| figures from | decode tok/s per seq, batch 1 | 8 | 32"
                  " | prefill tok/s | KV tokens |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, f in r["commands"].items():
            lines.append(figures_row(name, f))
        lines.append(figures_row("the node's truth", r["truth"]))
        lines.append(figures_row("physics ceiling (peak bandwidth, peak FLOPs)", r["ceiling"]))
        est = r["commands"]["estimate"]
        spread = 0.0
        for f in r["commands"].values():
            for b in BATCHES:
                got = f["decode_tok_s_per_seq_at_batch"][b]
                spread = max(spread, abs(got / est["decode_tok_s_per_seq_at_batch"][b] - 1))
            spread = max(spread, abs(f["prefill_tok_s"] / est["prefill_tok_s"] - 1))
        errors = [
            est["decode_tok_s_per_seq_at_batch"][b] / r["truth"]["decode_tok_s_per_seq_at_batch"][b]
            - 1
            for b in BATCHES
        ]
        kv_error = est["kv_cache_tokens"] / r["truth"]["kv_cache_tokens"] - 1
        over = [
            b
            for b in BATCHES
            if est["decode_tok_s_per_seq_at_batch"][b]
            > r["ceiling"]["decode_tok_s_per_seq_at_batch"][b]
        ]
        lines += [
            "",
            f"- largest spread between commands: {spread:.2%}",
            "- estimate against the truth, decode at batch 1/8/32: "
            + ", ".join(f"{e:+.1%}" for e in errors)
            + f"; KV {kv_error:+.1%}",
            f"- past the physics ceiling: {', '.join(over) or 'none'}",
            f"- estimate's source: {json.dumps(r['source'])}",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/out/calibration_consistency")
    args = parser.parse_args()
    out = out_dir(args.out)
    started = time.monotonic()
    results = {}
    for case, (speed, kv, clients, window, traffic) in CASES.items():
        print(f"{case}: calibrating under {clients} clients", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            results[case] = run_case(Path(tmp), speed, kv, clients, window, traffic)
    lines = report(results, time.monotonic() - started)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"machine": machine(), **results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
