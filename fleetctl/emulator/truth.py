"""A GPU whose truth differs from its profile: slower, or with less memory for the KV cache.

The emulator runs on whatever GPU profile it loads, so a skewed profile is how a node becomes a
4090 that is 30% slower than the bundled profile says, or one with 20% less KV cache: written to
a profiles folder (`fleetctl emulate --profiles DIR`) or applied by `--truth-speed/--truth-kv`.
Pure functions; `write_gpu` is the one file write.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from fleetctl.model.catalog import GpuProfile
from fleetctl.model.perf import KvBudget

MiB = 2**20


def slower(gpu: GpuProfile, speed: float) -> GpuProfile:
    """The GPU with every step taking 1/speed as long: decode_efficiency (the memory-bound
    part) and every tensor throughput (the compute-bound part) scaled by `speed`.

    decode_efficiency cannot exceed 1, so a speed-up past that goes to the bandwidth."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed:g}")
    efficiency = gpu.decode_efficiency * speed
    bandwidth = gpu.memory_bandwidth_gb_s * max(1.0, efficiency)
    tflops = gpu.tflops.model_copy(
        update={k: round(v * speed, 6) for k, v in gpu.tflops.model_dump().items() if v is not None}
    )
    return gpu.model_copy(
        update={
            "decode_efficiency": round(min(1.0, efficiency), 6),
            "memory_bandwidth_gb_s": round(bandwidth, 6),
            "tflops": tflops,
        }
    )


def less_kv(gpu: GpuProfile, share: float, budget: KvBudget, utilization: float) -> GpuProfile:
    """The GPU with memory_mib lowered so that the KV cache left after the same weights and
    reserves is `share` of `budget`'s (which was sized on `gpu` at `utilization`).

    Only the memory left for the KV cache shrinks, as when a neighbour's process holds some of
    it. vLLM's batch defaults depend on memory size (`vllm_batch_defaults`), so a caller that
    wants them unchanged passes max_num_batched_tokens and max_num_seqs explicitly."""
    if not 0 < share <= 1:
        raise ValueError(f"KV share must be in (0, 1], got {share:g}")
    lost = (1.0 - share) * max(0, budget.kv_per_gpu) / utilization
    return gpu.model_copy(update={"memory_mib": math.floor((gpu.memory_bytes - lost) / MiB)})


def describe(speed: float, kv: float) -> str:
    """The provenance line a skewed profile carries in its `sources`."""
    return f"skewed from the bundled profile: speed x{speed:g}, KV cache x{kv:g} (fleetctl)"


def write_gpu(folder: Path, gpu: GpuProfile, note: str = "") -> Path:
    """gpus/<name>.yaml in a profiles folder; it overrides the bundled profile of that name.
    `note` (such as `describe`'s line) is added to its sources."""
    if note:
        gpu = gpu.model_copy(update={"sources": (*gpu.sources, note)})
    path = folder / "gpus" / f"{gpu.name.lower()}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(gpu.model_dump(mode="json"), sort_keys=False))
    return path
