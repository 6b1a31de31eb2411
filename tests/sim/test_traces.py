"""Traces in every format the simulator reads: Azure CSV, Mooncake JSONL, route-serve's request
log (a file or its folder), cut by model and by time window."""

from __future__ import annotations

import json

import pytest

from fleetctl.base.errors import UserError
from fleetctl.sim.command import parse_window
from fleetctl.sim.workload import load_trace
from tests.conftest import DATA


def log_line(ms, prompt, out, model="m", **kw):
    row = {"timestamp": ms, "input_length": prompt, "output_length": out, "hash_ids": [1, 2]}
    return json.dumps({**row, "model": model, **kw}) + "\n"


def test_a_request_log_keeps_sessions_priorities_hints_and_its_block_size(tmp_path):
    p = tmp_path / "requests-2026-12-01.jsonl"
    p.write_text(
        log_line(
            1_764_547_200_000,
            40,
            7,
            session="ab12",
            priority=2,
            precision="int4",
            max_tokens=None,
            block_tokens=16,
        )
        + log_line(1_764_547_200_500, 40, 7, model="other")
        + log_line(1_764_547_201_000, 40, 7, max_tokens=64)
    )
    items = load_trace(p, "m")
    assert [(w.arrival, w.session, w.priority, w.precision, w.max_tokens) for w in items] == [
        (0.0, "ab12", 2, "int4", None),
        (1.0, None, 0, None, 64),
    ]
    assert items[0].blocks is not None and items[0].blocks.block_tokens == 16
    assert [w.id for w in items] == [0, 1]


def test_a_folder_of_logs_reads_as_one_trace_in_time_order(tmp_path):
    (tmp_path / "requests-2026-12-02.jsonl").write_text(log_line(86_400_000, 10, 1))
    (tmp_path / "requests-2026-12-01.jsonl").write_text(log_line(0, 10, 1) + log_line(5, 10, 1))
    (tmp_path / "notes.txt").write_text("not a trace")
    items = load_trace(tmp_path, "m")
    assert [w.arrival for w in items] == [0.0, 0.005, 86_400.0]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no request log"):
        load_trace(empty, "m")


def test_a_window_cuts_and_shifts_the_trace():
    full = load_trace(DATA / "mooncake_conv_slice.jsonl", "m")
    cut = load_trace(DATA / "mooncake_conv_slice.jsonl", "m", window=(30.0, 60.0))
    want = [w for w in full if 30.0 <= w.arrival < 60.0]
    assert len(cut) == len(want) > 10
    assert [w.arrival for w in cut] == pytest.approx([w.arrival - 30.0 for w in want])
    assert [w.prompt for w in cut] == [w.prompt for w in want]
    assert len(load_trace(DATA / "azure_conv_slice.csv", "m", window=(10.0, float("inf")))) < 400


def test_window_syntax():
    assert parse_window("600:1200") == (600.0, 1200.0)
    assert parse_window("600:") == (600.0, float("inf"))
    for bad in ("600", "9:3", "a:b", "-1:5"):
        with pytest.raises(UserError):
            parse_window(bad)


def test_simulate_cuts_a_mooncake_trace_by_window_and_reports_prefix_hits(cli, tmp_path):
    r = cli(
        "simulate",
        "example:mooncake-mixed",
        "--trace",
        DATA / "mooncake_conv_slice.jsonl",
        "--window",
        "0:20",
        "--policies",
        "kv-router,hardware-aware",
        "--json",
    )
    assert r.code == 0, r.err
    data = json.loads(r.out)
    in_window = sum(
        1 for w in load_trace(DATA / "mooncake_conv_slice.jsonl", "m") if w.arrival < 20
    )
    assert data["requests"] == in_window
    for figures in data["policies"].values():
        assert figures["completed"] == in_window
        assert 0 < figures["prefix_hit_rate"] < 1 and figures["prefill_saved_tokens"] > 0
    bad = cli("simulate", "example:mooncake-mixed", "--workload", "rate=1", "--window", "0:5")
    assert bad.code == 2 and "--window cuts a trace" in bad.err


def test_derive_workload_takes_a_peak_of_five_minute_rates():
    from fleetctl.sim.workload import WorkItem, derive_workload

    items = []
    for k in range(20):  # window k holds k + 1 requests
        for j in range(k + 1):
            items.append(WorkItem(0, k * 300.0 + j, 1000 * (j % 3 + 1), 100, "m"))
    items.append(WorkItem(0, 20 * 300.0 + 1, 9000, 100, "m", session="s"))  # a partial window
    d = derive_workload(items, long_tokens=4096)
    assert d is not None and d.requests == len(items)
    assert d.requests_per_s == pytest.approx(20 / 300)  # 95th percentile of 1..20
    assert d.long_share == pytest.approx(1 / len(items))
    assert d.session_share == pytest.approx(1 / len(items))
    assert derive_workload([], 4096) is None
    # With 20 windows the 95th percentile is the busiest one; with 40 (1 to 40 requests) it is
    # the 38th or 39th busiest by the usual definitions: not the busiest (40), nor the 90th
    # (36 or 37), nor anything of 1-minute windows.
    items = [WorkItem(0, k * 300.0 + j, 1000, 100, "m") for k in range(40) for j in range(k + 1)]
    items.append(WorkItem(0, 40 * 300.0 + 1, 1000, 100, "m"))  # ends window 40; 1 s after
    d = derive_workload(items, long_tokens=4096)
    assert d is not None
    assert 38 / 300 <= d.requests_per_s <= 39 / 300, d.requests_per_s * 300


def test_derive_workload_counts_a_burst_in_the_last_partial_window():
    """The Azure code trace's first 1,800 rows end in a 28 s burst (318 requests) after two
    calm windows: leaving the partial window out put the peak below the mean rate."""
    from fleetctl.sim.workload import WorkItem, derive_workload

    calm = [WorkItem(i, i * 3.0, 100, 10, "m") for i in range(200)]  # 600 s at 1/3 req/s
    burst = [WorkItem(200 + i, 600.0 + i * 0.2, 100, 10, "m") for i in range(400)]  # 5 req/s
    d = derive_workload(calm + burst, long_tokens=4096)
    assert d is not None
    assert d.requests_per_s == pytest.approx(400 / 79.8, rel=1e-3)  # the burst's own rate
    short = calm + burst[:50]  # 9.8 s of burst: too short to be a rate of its own
    d = derive_workload(short, long_tokens=4096)
    assert d is not None
    assert d.requests_per_s == pytest.approx(249 / 609.8, rel=1e-3)  # but never below the mean


def test_plan_workload_from_a_request_log_plans_for_the_traffic(cli, tmp_path):
    logs = tmp_path / "requests"
    logs.mkdir()
    day = 1_764_547_200_000
    lines = [log_line(day + i * 100, 6000, 300, model="llama-3.1-8b") for i in range(600)]
    (logs / "requests-2026-12-01.jsonl").write_text("".join(lines))
    r = cli("plan", "example:seed-mixed-8b-16k", "--workload-from", logs, "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    w = data["workloads"]["llama-3.1-8b"]
    assert w["source"] == "log" and w["requests"] == 600
    assert w["requests_per_s"] == pytest.approx(600 / 59.9, rel=1e-3)  # one window: its rate
    assert (w["mean_prompt_tokens"], w["mean_output_tokens"]) == (6000, 300)
    assert w["long_share"] == 1.0 and w["inventory"]["requests_per_s"] == 4
    # The planner sized the model for the traffic, not for the inventory's 4 req/s.
    demand = {m["model"]: m["demand_rps"] for m in data["models"]}
    assert demand["llama-3.1-8b"] == pytest.approx(w["requests_per_s"], rel=1e-3)
    text = cli("plan", "example:seed-mixed-8b-16k", "--workload-from", logs)
    assert (
        text.code == 0 and "Workloads the plan was sized for" in text.out and "(4.00)" in text.out
    )


def test_plan_workload_from_a_trace_without_models_needs_one_model(cli):
    r = cli(
        "plan", "example:seed-multi-model", "--workload-from", DATA / "mooncake_conv_slice.jsonl"
    )
    assert r.code == 2 and "does not say which model" in r.err
