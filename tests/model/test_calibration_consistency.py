"""One calibration, one truth: every command prints the same figures for a calibrated class,
they follow a skewed node's truth at batch sizes it was not measured at, and none is faster
than the GPU's peaks (benchmarks/calibration_consistency.py runs the full version).

Real emulators on loopback under live traffic during `fleetctl calibrate`; estimate, plan and
simulate read the calibration through the CLI. status reads it the same way
(fleet/engines.py server_engines: deployment_engine, then Calibrated.figures), checked here without
SSH on the plan's deployments as the state would record them.
"""

from __future__ import annotations

import json

import pytest

from fleetctl.emulator.truth import slower
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import Calibration
from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.planner import plan_fleet
from tests.model.test_calibration import Load
from tests.procs import NAME, Emulator

SPEED, KV = 0.7, 0.85  # the node's truth: 30% slower, 15% less KV cache than its profile
INVENTORY = """\
nodes:
  - name: rtx-1
    host: 127.0.0.1
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    gpu_memory_utilization: 0.92
    workload: {requests_per_s: 1, mean_prompt_tokens: 500, mean_output_tokens: 64}
"""
BATCHES = ("1", "8", "32")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """A 4090 emulator whose truth is SPEED and KV of its profile: (the inventory, a backends
    file naming it, a state folder, the emulator)."""
    tmp = tmp_path_factory.mktemp("skewed")
    emu = Emulator(tmp, "--truth-speed", str(SPEED), "--truth-kv", str(KV))
    try:
        emu.wait_healthy()
        inv = tmp / "fleet.yaml"
        inv.write_text(INVENTORY)
        backends = tmp / "backends.yaml"
        entry = {"url": emu.base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
        backends.write_text(json.dumps({"backends": [entry]}))
        yield inv, backends, tmp / ".fleetctl", emu  # the state folder beside the inventory
    finally:
        emu.stop()


def _calibrate(cli, inv, backends, state, emu) -> None:
    args = ["--backends", backends, "--state-dir", state, "--window", "6", "--interval", "0.25"]
    with Load(emu.port, 10):
        r = cli("calibrate", inv, *args)
    assert r.code == 0, r.out + r.err


def _truth() -> tuple[EnginePerf, int]:
    cat = load_catalog()
    gpu, model, fmt = cat.gpu("RTX-4090"), cat.model("llama-3-8b"), cat.format("bf16")
    truth = EnginePerf(slower(gpu, SPEED), model, fmt)
    kv = int(kv_budget(gpu, model, fmt, gpu_memory_utilization=0.92).kv_tokens * KV)
    return truth, kv


def test_every_command_prints_the_same_figures_and_they_follow_the_truth(cli, skewed):
    inv, backends, state, emu = skewed
    _calibrate(cli, inv, backends, state, emu)
    est = ["estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "bf16"]
    est += ["--gpu-memory-utilization", "0.92", "--state-dir", state, "--json"]
    estimates = {b: json.loads(cli(*est, "--batch", b).out) for b in BATCHES}
    plan = json.loads(cli("plan", inv, "--json").out)
    planned = plan["deployments"][0]["perf"]
    sim = cli(
        "simulate", inv, "--workload", "rate=1,duration=5",
        "--policies", "hardware-aware", "--json",
    )  # fmt: skip
    assert sim.code == 0, sim.err
    simulated = json.loads(sim.out)["perf"]["RTX-4090/bf16"]
    from fleetctl.fleet.engines import server_engines

    loaded = load_inventory(inv, load_catalog())
    deployments = plan_fleet(loaded, None, StateDir(state).load_calibration()).deployments
    status = server_engines(loaded, State(1, deployments), StateDir(state).load_calibration())
    status_figures = next(iter(status.values())).figures()

    truth, truth_kv = _truth()
    for figures in (planned, simulated, status_figures):
        assert figures["source"]["calibrated"] is not None
        assert figures["kv_cache_tokens"] == estimates["1"]["kv_cache_tokens"]
        assert figures["prefill_tok_s"] == pytest.approx(estimates["1"]["prefill_tok_s"], rel=0.01)
        for b in BATCHES:
            got = figures["decode_tok_s_per_seq_at_batch"][b]
            assert got == pytest.approx(estimates[b]["decode_tok_s_per_seq"], rel=0.01), b
    # The node's truth, at batch sizes the windows did not all see: within 15%; KV within 5%.
    for b in BATCHES:
        want = 1.0 / truth.step_time(int(b), int(b) * 1024)
        assert estimates[b]["decode_tok_s_per_seq"] == pytest.approx(want, rel=0.15), b
    assert estimates["1"]["kv_cache_tokens"] == pytest.approx(truth_kv, rel=0.05)
    assert estimates["1"]["source"]["figures"]["kv_cache_tokens"] == "measured"


def test_no_calibrated_figure_beats_the_roofline(cli, tmp_path):
    """The issue's new user: an emulator of its own profile at 3-7 concurrent requests,
    calibrate, then estimate at batch 1: never faster than reading the weights at the GPU's
    peak bandwidth (it printed 112.7 tok/s where the weights alone take 16 ms)."""
    emu = Emulator(tmp_path)
    try:
        emu.wait_healthy()
        inv = tmp_path / "fleet.yaml"
        inv.write_text(INVENTORY)
        backends = tmp_path / "backends.yaml"
        entry = {"url": emu.base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
        backends.write_text(json.dumps({"backends": [entry]}))
        state = tmp_path / "state"
        args = ["--backends", backends, "--state-dir", state, "--window", "5", "--interval", "0.25"]
        with Load(emu.port, 5):
            assert cli("calibrate", inv, *args).code == 0
    finally:
        emu.stop()
    assert StateDir(state).load_calibration() != Calibration()
    est = ["estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "bf16"]
    got = json.loads(cli(*est, "--batch", "1", "--state-dir", state, "--json").out)
    cat = load_catalog()
    perf = EnginePerf(cat.gpu("RTX-4090"), cat.model("llama-3-8b"), cat.format("bf16"))
    ceiling = 1.0 / perf.min_step_s(1, got["context"])
    assert got["decode_tok_s_per_seq"] <= ceiling
    assert got["prefill_tok_s"] <= perf.max_prefill_tok_s(got["prompt"])
    # And it is what the node does: its own profile, within 15%.
    want = perf.decode_tok_s(1, got["context"])
    assert got["decode_tok_s_per_seq"] == pytest.approx(want, rel=0.15)


def test_prefill_beside_the_decodes_is_not_read_as_slow_decoding(cli, tmp_path):
    """A node 0.7x its profile, calibrated under whole 400-700-token prompts beside 48-112-token
    outputs, six requests at a time: about one step in fourteen also computes a prompt, and is
    compute-bound where a decode step reads the weights. Decode at batch 1, 8 and 32 within 15%
    of the node's truth (taking the prompts as slow decoding read it 19% below)."""
    emu = Emulator(tmp_path, "--truth-speed", str(SPEED))
    try:
        emu.wait_healthy()
        inv = tmp_path / "fleet.yaml"
        inv.write_text(INVENTORY)
        backends = tmp_path / "backends.yaml"
        entry = {"url": emu.base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
        backends.write_text(json.dumps({"backends": [entry]}))
        state = tmp_path / "state"
        args = ["--backends", backends, "--state-dir", state, "--window", "6", "--interval", "0.25"]
        with Load(emu.port, 6, prompt_tokens=(400, 700), output_tokens=(48, 112)):
            r = cli("calibrate", inv, *args)
        assert r.code == 0, r.out + r.err
    finally:
        emu.stop()
    truth, _ = _truth()
    est = ["estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "bf16"]
    est += ["--gpu-memory-utilization", "0.92", "--state-dir", state, "--json"]
    for b in BATCHES:
        got = json.loads(cli(*est, "--batch", b).out)
        assert got["source"]["kind"] == "calibrated", got["source"]
        want = 1.0 / truth.step_time(int(b), int(b) * got["context"])
        assert got["decode_tok_s_per_seq"] == pytest.approx(want, rel=0.15), b
