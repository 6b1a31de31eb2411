"""Servers' start-up times, apply's measured median or an estimate from the weights, and what
the planner weighs a change of placement by (fleetctl/apply/warmup.py: a plan's disruption).

Start-up time is what apply times from the start command to a healthy /health and
/v1/models (fleetctl/apply/execute.py); vLLM's start-up log names some of its phases, which
`parse_startup_log` reads. The lines were checked against a real vLLM 0.32.0 CPU server's log
(tests/data/vllm-0.32.0-cpu-startup.log: "Initializing model took", "Loading weights took",
"init engine (profile, create kv cache, warmup model) took"); the GPU runner's lines ("Model
loading took X GiB [memory] and Y seconds", "torch.compile takes X s in total", "Graph
capturing finished in X secs") are vLLM's format strings, read from its source, not captured
here.

Without a measurement the start-up is an estimate: the weights read from local disk at
DISK_READ_BYTES_S plus STARTUP_FIXED_S for the rest (the Python process and its imports,
profiling, KV cache, torch.compile and CUDA graphs). Both are round numbers, not measured on
this fleet: a network filesystem or a first download is slower, a warm compile cache faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetctl.model.calibration import Calibration, find_startup

DISK_READ_BYTES_S = 1.0e9  # weights read at 1 GB/s (a local NVMe SSD; safetensors, page cache cold)
STARTUP_FIXED_S = 60.0  # process, imports, profiling, KV cache, torch.compile, CUDA graphs


@dataclass(frozen=True)
class Warmup:
    """One server's expected start-up seconds and where the figure comes from."""

    seconds: float
    source: str
    measured: bool = False


def estimate_startup_s(weights_bytes: int) -> float:
    """The default estimate: weights from disk at DISK_READ_BYTES_S, plus STARTUP_FIXED_S."""
    return max(0, weights_bytes) / DISK_READ_BYTES_S + STARTUP_FIXED_S


def warmup_for(
    calibration: Calibration | None,
    gpu: str,
    model: str,
    fmt: str,
    tp: int = 1,
    weights_bytes: int | None = None,
    vllm_version: str | None = None,
) -> Warmup:
    """The start-up of a server of this class: apply's measured median where the calibration
    has one (`model` is the profile's name, as calibration keys are), else the estimate."""
    found = (
        None
        if calibration is None
        else find_startup(calibration, gpu, model, fmt, tp, vllm_version)
    )
    if found is not None:
        return Warmup(found.median_s, found.describe(), True)
    if weights_bytes is None:
        return Warmup(STARTUP_FIXED_S, f"estimate: {STARTUP_FIXED_S:g} s, weights unknown")
    s = estimate_startup_s(weights_bytes)
    return Warmup(
        s,
        f"estimate: {weights_bytes / 1e9:.1f} GB at {DISK_READ_BYTES_S / 1e9:g} GB/s "
        f"+ {STARTUP_FIXED_S:g} s",
    )


def warmup_seconds(
    calibration: Calibration | None,
    gpu: str,
    model: str,
    fmt: str,
    tp: int = 1,
    weights_bytes: int | None = None,
    vllm_version: str | None = None,
) -> float:
    """`warmup_for(...).seconds`: what the planner weighs a server start by."""
    return warmup_for(calibration, gpu, model, fmt, tp, weights_bytes, vllm_version).seconds


# --- what the planner weighs: a replica that stays spares its replacement's disruption -------

# A change of placement must raise the throughput objective (a sum over models of
# log(capacity / workload)) by at least this much per server-minute of disruption it causes:
# 0.02 is a 2% capacity gain for one model per server-minute. Minimum replicas (1e3) and
# workload shortfall (20 per unit) weigh far more, so staying never leaves a workload short.
CHANGE_THRESHOLD = 0.02
# The cost objective: a change must pay its disruption back (GPU-hours of warm-up and of
# capacity missing, at the GPUs' price) within this many hours of running.
PAYBACK_HOURS = 24.0


def replacement_minutes(warmup_s: float, gpu_memory_utilization: float) -> float:
    """Server-minutes of disruption one replacement of a running server costs, as apply
    carries it out: its warm-up, and as long again of capacity missing unless the new server
    fits beside the old one (their memory shares sum to at most 1: start before stop)."""
    surge = 2 * gpu_memory_utilization <= 1.0
    return warmup_s / 60 * (1 if surge else 2)


def stay_bonus(
    warmup_s: float, gpu_memory_utilization: float, threshold: float = CHANGE_THRESHOLD
) -> float:
    """The throughput objective's bonus for a replica that stays where it runs: the gain a
    change must beat."""
    return threshold * replacement_minutes(warmup_s, gpu_memory_utilization)
