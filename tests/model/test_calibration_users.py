"""The calibration's users: what plan, route-serve, simulate and status take from an entry."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from rich.console import Console

from fleetctl.apply.status import ServerStatus
from fleetctl.cli.render import status_table
from fleetctl.daemon.backends import apply_calibration, backends_from_state, load_backends
from fleetctl.fleet.engines import server_engines
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import (
    Calibration,
    Entry,
    Figure,
    Key,
    Sample,
    beside_model,
    beside_model_text,
    entry_for,
    measured,
    speed_factor,
)
from fleetctl.model.perf import EnginePerf, max_sequences
from fleetctl.planner import plan_fleet

KEY = Key("RTX-4090", "llama-3-8b", "bf16", 1, None, 8192)
SERVERS = ["http://a:8000", "http://b:8000", "http://c:8000"]
AT = "2026-12-01T10:20:31+00:00"


@pytest.fixture(scope="module")
def perf(catalog):
    return EnginePerf(
        catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16"), 1
    )


def servers_at(perf: EnginePerf, speed: float, batches=(2, 4, 8, 12)) -> list[Sample]:
    """Windows of servers whose GPU runs at `speed` times the model's, at 512-token contexts."""
    slow = replace(perf, speed=speed)
    return [
        Sample(batch=b, step_s=slow.step_time(b, b * 512), tokens=400, requests=4, context=512)
        for b in batches
    ]


def entry_of(perf: EnginePerf, samples: list[Sample], kv=(20_000,), util=0.9) -> Entry:
    return entry_for(KEY, SERVERS, samples, list(kv), AT, None, perf, 47_024, util)


def test_the_speed_factor_recovers_a_slower_gpu(perf):
    e = entry_of(perf, servers_at(perf, 0.7))
    assert speed_factor(e, perf) == pytest.approx(0.7, rel=0.05)
    assert speed_factor(entry_of(perf, servers_at(perf, 1.0)), perf) == pytest.approx(1, rel=0.02)
    # The factor scales the GPU work only: the model with it predicts the measured step.
    speed = speed_factor(e, perf)
    assert speed is not None
    fitted = replace(perf, speed=speed)
    assert e.step is not None
    assert fitted.step_time(8, 8 * 512) == pytest.approx(e.step.at(8), rel=0.03)


def test_measured_takes_only_trusted_figures_and_says_from_what(perf):
    e = entry_of(perf, servers_at(perf, 0.7))
    m = measured(e, perf, 0.9)
    assert m is not None
    assert m.kv_tokens == 20_000
    assert m.speed == pytest.approx(0.7, rel=0.05)
    assert m.provenance.startswith("calibrated from 3 servers, 2026-12-01 10:20 (KV 20,000")
    flagged = Figure(1.0, 2.0, False, "implausible")
    no_kv = measured(replace(e, kv_tokens=flagged), perf, 0.9)
    assert no_kv is not None and no_kv.kv_tokens is None and no_kv.speed == m.speed
    no_step = measured(replace(e, step_at_batch=flagged), perf, 0.9)
    assert no_step is not None and no_step.speed is None and no_step.kv_tokens == 20_000
    assert measured(replace(e, step_at_batch=flagged, kv_tokens=flagged), perf) is None
    # Too few windows: the fit is not trusted, so no speed.
    few = entry_of(perf, servers_at(perf, 0.7, (2, 6)))
    assert speed_factor(few, perf) is None
    # Eager steps of a fast GPU wait on their kernel launches, not on the GPU (the GPU's work
    # hides behind them): the step passes the 10x check, but there is no speed in it. A slow
    # GPU's work outlasts the launches and shows.
    eager = replace(perf, enforce_eager=True)
    far = entry_of(eager, servers_at(eager, 5.0))
    assert far.step_at_batch is not None and far.step_at_batch.trusted
    assert speed_factor(far, eager) is None
    near = entry_of(eager, servers_at(eager, 0.5))
    assert speed_factor(near, eager) == pytest.approx(0.5, rel=0.05)


def test_measured_kv_moves_with_the_utilization(perf):
    e = entry_of(perf, servers_at(perf, 1.0))
    same, more = measured(e, perf, 0.9), measured(e, perf, 0.95)
    assert same is not None and more is not None
    assert same.kv_tokens == 20_000
    assert more.kv_tokens is not None and more.kv_tokens > 20_000
    assert more.provenance.endswith("; KV moved from gpu_memory_utilization 0.9 to 0.95")


# --- plan ----------------------------------------------------------------------------------------

INVENTORY = """\
nodes:
  - name: rtx-[1:3]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: chat
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    gpu_memory_utilization: 0.9
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 64}
"""


def test_plan_uses_a_matching_entry_and_says_so(tmp_path, catalog, perf):
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(INVENTORY)
    inv = load_inventory(inv_path, catalog)
    base = plan_fleet(inv)
    server = base.deployments[0].server
    assert same_plan(plan_fleet(inv, None, Calibration()), base)
    # Live servers hold half the KV the model gives them, and run at 0.7x its speed.
    half = server.kv_budget_tokens // 2 // 16 * 16
    e = entry_of(perf, servers_at(perf, 0.7), kv=(half,), util=0.9)
    got = plan_fleet(inv, None, Calibration((e,)))
    s = got.deployments[0].server
    assert s.kv_budget_tokens == half
    assert s.max_sequences_at_max_len == max_sequences(half, 8192)
    assert s.max_sequences_at_max_len < server.max_sequences_at_max_len
    assert s.predicted_decode_tok_s < server.predicted_decode_tok_s
    said = [r for r in s.reasons if r.startswith("calibrated from 3 servers, 2026-12-01 10:20")]
    assert len(said) == 1 and "speed 0.7" in said[0]
    assert any("chat bf16 TP=1 on RTX-4090: calibrated from" in w for w in got.warnings)
    # Another GPU's or format's entry does not match.
    other = replace(e, key=replace(KEY, gpu="A100-80GB"))
    assert same_plan(plan_fleet(inv, None, Calibration((other,))), base)


def same_plan(a, b) -> bool:
    return (a.deployments, a.warnings) == (b.deployments, b.warnings)


def test_plan_reads_the_state_folders_calibration_unless_told_not_to(tmp_path, cli, perf):
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(INVENTORY)
    sdir = StateDir(tmp_path / ".fleetctl")
    e = entry_of(perf, servers_at(perf, 0.7), kv=(8192,), util=0.9)
    sdir.root.mkdir()
    sdir.save_calibration(Calibration((e,)))
    r = cli("plan", inv_path, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["deployments"][0]["kv_budget_tokens"] == 8192
    assert any("calibrated from 3 servers" in w for w in json.loads(r.out)["warnings"])
    # In the text, the figures' provenance is a note, not a warning: nothing is wrong.
    text = cli("plan", inv_path).out.splitlines()
    said = [ln for ln in text if "calibrated from 3 servers" in ln]
    assert said and all(ln.startswith("note: ") for ln in said), text
    r = cli("plan", inv_path, "--json", "--no-calibration")
    assert r.code == 0, r.err
    assert json.loads(r.out)["deployments"][0]["kv_budget_tokens"] > 8192


# --- route-serve ---------------------------------------------------------------------------------


def test_route_serve_gives_matching_backends_the_measured_figures(tmp_path, catalog, perf, caplog):
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(INVENTORY)
    inv = load_inventory(inv_path, catalog)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, plan_fleet(inv).deployments))
    model_kv = backends_from_state(inv, sdir)[0].kv_tokens
    e = entry_of(perf, servers_at(perf, 0.7), kv=(20_000,), util=0.9)
    sdir.save_calibration(Calibration((e,)))
    # calibrate itself compares with the model: by default the backends are the model's.
    assert [b.kv_tokens for b in load_backends(inv, catalog, None, sdir)] == [model_kv] * 3
    with caplog.at_level(logging.INFO, logger="fleetctl.router"):
        got = load_backends(inv, catalog, None, sdir, calibrated=True)
    assert [b.kv_tokens for b in got] == [20_000] * 3
    assert all(b.perf is not None and b.perf.speed == pytest.approx(0.7, rel=0.05) for b in got)
    said = [r.getMessage() for r in caplog.records if "calibrated from" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("RTX-4090/llama-3-8b/bf16: calibrated from 3 servers, 2026-12-01")
    # Another format's entry leaves them as the model has them.
    other = replace(e, key=replace(KEY, format="awq"))
    fresh = backends_from_state(inv, sdir)
    assert apply_calibration(fresh, Calibration((other,))) == []
    assert [b.kv_tokens for b in fresh] == [model_kv] * 3
    assert all(b.perf is not None and b.perf.speed == 1.0 for b in fresh)


# --- simulate ------------------------------------------------------------------------------------


def test_simulate_runs_calibrated_servers_and_says_so(tmp_path, cli, perf):
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(INVENTORY)
    args = ["simulate", inv_path, "--workload", "rate=2,duration=30", "--policies", "round-robin"]
    before = cli(*args, "--json")
    assert before.code == 0, before.err
    assert json.loads(before.out)["calibration"] == []
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.root.mkdir()
    sdir.save_calibration(Calibration((entry_of(perf, servers_at(perf, 0.5)),)))
    r = cli(*args, "--json")
    assert r.code == 0, r.err
    slow, fast = json.loads(r.out), json.loads(before.out)
    assert slow["calibration"] == [
        "RTX-4090/bf16 (3 servers): calibrated from 3 servers, 2026-12-01 10:20 "
        "(KV 20,000 tokens, speed 0.50x the model's)"
    ]
    # Half the speed and less KV: less capacity, slower tokens.
    assert slow["capacity_rps"] < fast["capacity_rps"]
    rr_slow, rr_fast = slow["policies"]["round-robin"], fast["policies"]["round-robin"]
    assert rr_slow["tpot_mean_s"] > 1.5 * rr_fast["tpot_mean_s"]
    table = cli(*args)
    assert "calibrated from 3 servers" in table.out
    assert json.loads(cli(*args, "--json", "--no-calibration").out)["calibration"] == []


# --- status --------------------------------------------------------------------------------------


def test_status_shows_the_models_figures_beside_the_measured_ones(tmp_path, catalog, perf):
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(INVENTORY)
    inv = load_inventory(inv_path, catalog)
    state = State(1, plan_fleet(inv).deployments)
    e = entry_of(perf, servers_at(perf, 0.7), kv=(40_000,), util=0.9)
    found = server_engines(inv, state, Calibration((e,)))
    rtx = {("rtx-1", (0,)), ("rtx-2", (0,)), ("rtx-3", (0,))}
    assert {k for k, engine in found.items() if engine.entry is e} == rtx
    # Every server has its engine; the others' (and all of them with no calibration) are the
    # model's own.
    assert all(engine.entry is None for k, engine in found.items() if k not in rtx)
    assert all(
        engine.entry is None and not engine.provenance
        for engine in server_engines(inv, state, Calibration()).values()
    )
    j = beside_model(e)
    assert j["source"] == "calibrated from 3 servers, 2026-12-01 10:20"
    assert j["kv_tokens"] == {"model": 47_024, "measured": 40_000, "trusted": True, "why": ""}
    assert j["decode_step_ms"]["measured"] > j["decode_step_ms"]["model"]
    text = beside_model_text(e)
    assert text.startswith("KV 47,024 tokens modelled, 40,000 measured; step ")
    assert text.endswith("; calibrated from 3 servers, 2026-12-01 10:20")
    flagged = beside_model_text(replace(e, kv_tokens=Figure(400, 47_024, False, "implausible")))
    assert flagged.startswith("KV 47,024 tokens modelled, 400 measured (not trusted); ")
    rows = [
        ServerStatus("rtx-1", "chat", (0,), 8000, "running", ""),
        ServerStatus("rtx-2", "chat", (0,), 8000, "dead", "exited"),
    ]
    texts = {k: beside_model_text(v.entry) for k, v in found.items() if v.entry is not None}
    out = Console(width=400, record=True)
    out.print(status_table(rows, texts))
    shown = out.export_text()
    assert shown.count("40,000 measured") == 2
    assert "exited; KV 47,024 tokens modelled" in shown
