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

A server started with `--enable-sleep-mode` can instead sleep and wake (`wake_seconds`): at
level 1 its weights wait in host memory and come back over the GPU's PCIe link; at level 2
they were dropped and are read again, from the page cache when the host kept them. The
published figures these constants reproduce are vLLM's (blog "Zero-reload model switching",
2025-10-26, one A100: level 1 0.26 s for Qwen3-0.6B and 0.82 s for Phi-3-vision, level 2
0.85 s and 2.58 s; vllm#48310: Qwen3-8B on one H100, 0.59 s from wake to first token).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetctl.model.calibration import Calibration, find_startup
from fleetctl.model.catalog import GpuProfile
from fleetctl.model.perf import PCIE_GB_S

DISK_READ_BYTES_S = 1.0e9  # weights read at 1 GB/s (a local NVMe SSD; safetensors, page cache cold)
STARTUP_FIXED_S = 60.0  # process, imports, profiling, KV cache, torch.compile, CUDA graphs
# A wake's fixed part: remapping the KV cache and CUDA graphs, resuming the scheduler (the
# 0.6B model's 0.26 s level-1 wake is almost all of it).
WAKE_FIXED_S = 0.2
# Host-to-GPU copies from pinned memory reach about 80% of the link's nominal rate.
PINNED_COPY_EFFICIENCY = 0.8
# Level 2 re-reads the weights; a host that slept them recently serves them from its page
# cache (Phi-3-vision's 8.4 GB in 2.58 s less the fixed part: about 3.5 GB/s).
RELOAD_BYTES_S = 3.5e9
SLEEP_LEVELS = (1, 2)


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


def wake_seconds(gpu: GpuProfile, weights_bytes: int, tp: int, level: int) -> float:
    """Seconds a sleeping server of this class takes to serve again: its GPUs' share of the
    weights back over PCIe (level 1, from host memory) or re-read (level 2), plus
    WAKE_FIXED_S. Each GPU of a tensor-parallel group copies its own share at once."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level {level} is not one of {SLEEP_LEVELS}")
    share = max(0, weights_bytes) / max(1, tp)
    if level == 1:
        rate = PCIE_GB_S.get(gpu.pcie_gen, 25.0) * 1e9 * PINNED_COPY_EFFICIENCY
    else:
        rate = RELOAD_BYTES_S
    return share / rate + WAKE_FIXED_S


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
