"""Command lines of the servers the benchmarks and tests start: fleetctl's `emulate` and
`route-serve`, and the peer routers (vllm-router, sglang-router) from their own venv."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def emulate_cmd(
    port: int, gpu: str, model: str, source: str, served: str, time_scale: str, *flags: str
) -> list[str]:
    """`fleetctl emulate`: a vLLM-like server for `model` (a profile) on `gpu`; `flags` are
    further vLLM serve flags (a variant, the planner's flags) or the emulator's faults."""
    cmd = [sys.executable, "-m", "fleetctl", "emulate", "--gpu", gpu, "--model", model]
    cmd += [source, "--served-model-name", served, "--port", str(port)]
    return [*cmd, "--time-scale", time_scale, *flags]


def route_serve_cmd(
    inventory: Path, backends: list[dict], port: int, policy: str, work: Path
) -> list[str]:
    """`fleetctl route-serve` on 127.0.0.1:port in front of `backends` (written to
    work/backends.yaml), its state in work/state."""
    bfile = work / "backends.yaml"
    bfile.write_text(json.dumps({"backends": backends}, indent=1))
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inventory)]
    cmd += ["--backends", str(bfile), "--listen", f"127.0.0.1:{port}"]
    return [*cmd, "--policy", policy, "--state-dir", str(work / "state")]


def peer_router_cmd(
    kind: str, peers_venv: Path, urls: list[str], policy: str, port: int, prom: int
) -> list[str]:
    """vllm-router or sglang-router (`kind`) on 127.0.0.1:port in front of `urls`."""
    common = ["--worker-urls", *urls, "--policy", policy]
    common += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(prom)]
    bin_ = peers_venv / "bin"
    if kind == "vllm-router":
        return [str(bin_ / "vllm-router"), *common]
    if kind == "sglang-router":
        return [str(bin_ / "python"), "-m", "sglang_router.launch_router", *common]
    raise ValueError(kind)


def vllm_bench_timed_trace_cmd(
    vllm: Path,
    base_url: str,
    model: str,
    tokenizer: Path,
    trace: Path,
    requests: int,
    chunk_hash_size: int,
    sec_multiplier: float,
    result_dir: Path,
    result_file: str,
) -> list[str]:
    """vLLM's own load generator replaying a timed trace (Mooncake-style JSONL: timestamp,
    input_length, output_length, hash_ids) against `base_url`'s /v1/completions: streamed,
    token-id prompts that share prefixes as the hash_ids say, max_tokens the trace's output
    length, arrivals at timestamp x `sec_multiplier` seconds. Per-request results are saved
    (--save-detailed) to result_dir/result_file."""
    cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", base_url]
    cmd += ["--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer)]
    cmd += ["--dataset-name", "timed_trace", "--dataset-path", str(trace)]
    cmd += ["--timed-trace-chunk-hash-size", str(chunk_hash_size)]
    cmd += ["--timed-trace-sec-multiplier", repr(sec_multiplier)]
    cmd += ["--num-prompts", str(requests), "--ignore-eos", "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99"]
    cmd += ["--save-result", "--save-detailed", "--result-dir", str(result_dir)]
    return [*cmd, "--result-filename", result_file]
