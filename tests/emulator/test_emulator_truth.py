"""An emulator whose truth differs from the bundled profiles (`--profiles DIR`, `--truth-*`).

Three real emulators side by side: the bundled RTX 4090, one reading a skewed profiles folder
(30% slower, 20% less KV cache) and one skewed by the `--truth-speed/--truth-kv` knobs. Speeds
are compared as ratios of emulated seconds from each server's own /metrics, so the machine's
load does not enter them; KV capacity is what `vllm:cache_config_info` reports.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetctl.emulator.args import parse_args
from fleetctl.emulator.config import resolve
from fleetctl.emulator.truth import describe, less_kv, slower, write_gpu
from fleetctl.model.catalog import GpuProfile
from fleetctl.model.perf import EnginePerf
from tests.conftest import REPO
from tests.procs import NAME, Emulator

SPEED, KV = 0.7, 0.8


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """The bundled 4090, a skewed profiles folder's and the knobs', started in parallel."""
    folder = tmp_path_factory.mktemp("truth-profiles")
    bundled = resolve(parse_args(["--gpu", "RTX-4090", "--model", NAME])[0])
    truth = less_kv(slower(bundled.gpu, SPEED), KV, bundled.budget, bundled.gpu_memory_utilization)
    write_gpu(folder, truth, describe(SPEED, KV))
    logs = tmp_path_factory.mktemp("truth-emulators")
    specs = {
        "bundled": (),
        "folder": ("--profiles", str(folder)),
        "knobs": ("--truth-speed", str(SPEED), "--truth-kv", str(KV)),
    }
    started: dict[str, Emulator] = {}
    try:
        for key, args in specs.items():
            started[key] = Emulator(logs, *args)
        for emu in started.values():
            emu.wait_healthy()
        yield started
    finally:
        for emu in started.values():
            emu.stop()


def _hist_mean_delta(emu: Emulator, body: dict, name: str) -> float:
    """Mean of histogram `name` over the one request `body`, in emulated seconds."""

    def sum_count() -> tuple[float, float]:
        fam = emu.metrics()[name]
        total = next(s.value for s in fam.samples if s.name == f"{name}_sum")
        count = next(s.value for s in fam.samples if s.name == f"{name}_count")
        return total, count

    s0, c0 = sum_count()
    assert emu.request("POST", "/v1/completions", body, timeout=30)[0] == 200
    s1, c1 = sum_count()
    assert c1 > c0, name
    return (s1 - s0) / (c1 - c0)


def _blocks(emu: Emulator) -> int:
    fam = emu.metrics()["vllm:cache_config_info"]
    return int(next(s for s in fam.samples).labels["num_gpu_blocks"])


def test_skewed_emulator_is_slower_per_token_and_holds_less_kv(trio):
    decode = {"model": NAME, "prompt": "hi", "max_tokens": 40}
    prefill = {"model": NAME, "prompt": "word " * 1600, "max_tokens": 1}  # 2000 tokens
    itl = {
        k: _hist_mean_delta(e, decode, "vllm:inter_token_latency_seconds") for k, e in trio.items()
    }
    ttft = {
        k: _hist_mean_delta(e, prefill, "vllm:time_to_first_token_seconds") for k, e in trio.items()
    }
    blocks = {k: _blocks(e) for k, e in trio.items()}
    for key in ("folder", "knobs"):
        # Every step takes 1/0.7 as long, decode (memory-bound) and prefill (compute-bound) alike.
        assert itl[key] / itl["bundled"] == pytest.approx(1 / SPEED, rel=0.1), itl
        assert ttft[key] / ttft["bundled"] == pytest.approx(1 / SPEED, rel=0.15), ttft
        # 20% less KV cache, to within a block's rounding and a MiB of memory.
        assert blocks[key] / blocks["bundled"] == pytest.approx(KV, abs=0.005), blocks
    # The folder and the knobs are one skew, two spellings.
    assert blocks["folder"] == blocks["knobs"], blocks


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--truth-kv", "1.5", "--truth-kv must be in (0, 1]"), ("--truth-speed", "0", "positive")],
)
def test_bad_truth_knob_is_one_line_exit_2(flag, value, says):
    cmd = [sys.executable, "-m", "fleetctl", "emulate", "--gpu", "RTX-4090", "--model", NAME]
    r = subprocess.run([*cmd, flag, value], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_faster_truth_stays_a_valid_profile(catalog):
    # decode_efficiency cannot pass 1: the rest of a speed-up goes to the bandwidth, so the
    # written profile loads and every step's GPU work is still 1/speed as long (the fixed cost
    # per step is the host's: scheduling and launches do not scale with the GPU).
    gpu = catalog.gpu("RTX-4090")
    fast = slower(gpu, 1.6)
    assert fast.decode_efficiency == 1.0
    assert GpuProfile.model_validate(fast.model_dump()) == fast
    model, fmt = catalog.model(NAME), catalog.format("bf16")
    before, after = EnginePerf(gpu, model, fmt), EnginePerf(fast, model, fmt)
    for tokens, kv in ((1, 500), (2000, 0)):
        gpu_work = before.step_time(tokens, kv) - before.step_overhead
        assert gpu_work / (after.step_time(tokens, kv) - after.step_overhead) == pytest.approx(1.6)
