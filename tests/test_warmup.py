"""Warm-up as a cost: vLLM's start-up log read into phases, start-ups kept in the calibration,
the estimate without one, and a plan's disruption by the steps apply really takes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleetctl.calibration import (
    Calibration,
    CalibrationError,
    Entry,
    Key,
    find_startup,
    record_startup,
)
from fleetctl.plan import Deployment
from fleetctl.warmup import (
    DISK_READ_BYTES_S,
    STARTUP_FIXED_S,
    Warmup,
    disruption,
    parse_startup_log,
    warmup_for,
    warmup_seconds,
)
from tests.test_apply_steps import dep

DATA = Path(__file__).parent / "data"
KEY = Key("A100-SXM4-80GB", "llama-3-8b", "bf16", 1)


# --- the log -----------------------------------------------------------------------------------


def test_phases_from_a_real_vllm_startup_log():
    # Captured from a real vLLM 0.32.0 (CPU build) serving tiny-llama: tests/data's README.
    text = (DATA / "vllm-0.32.0-cpu-startup.log").read_text()
    assert parse_startup_log(text) == {
        "model_init_s": 1.304817,
        "weights_s": 0.27,
        "engine_init_s": 0.94,
    }


def test_phases_of_the_gpu_runner_from_vllms_format_strings():
    # Not captured (no GPU here): vLLM's own format strings filled in, with its log prefix.
    # Each rank of a TP group logs its load; the first counts (they load in parallel).
    lines = [
        "(Worker_TP0 pid=7) INFO 12-01 10:00:05 [gpu_model_runner.py:2653] Model loading took "
        "14.99 GiB memory and 5.437712 seconds",
        "(Worker_TP1 pid=8) INFO 12-01 10:00:06 [gpu_model_runner.py:2653] Model loading took "
        "14.99 GiB memory and 6.100000 seconds",
        "(EngineCore_DP0 pid=6) INFO 12-01 10:00:31 [monitor.py:34] torch.compile takes 21.35 s "
        "in total",
        "(EngineCore_DP0 pid=6) INFO 12-01 10:00:52 [gpu_model_runner.py:3480] Graph capturing "
        "finished in 12 secs, took 0.52 GiB",
        "(EngineCore_DP0 pid=6) INFO 12-01 10:00:52 [core.py:210] init engine (profile, create "
        "kv cache, warmup model) took 44.81 seconds",
    ]
    assert parse_startup_log("\n".join(lines)) == {
        "model_load_s": 5.437712,
        "compile_s": 21.35,
        "graphs_s": 12.0,
        "engine_init_s": 44.81,
    }
    assert parse_startup_log("nothing took place\n") == {}


# --- the store ---------------------------------------------------------------------------------


def test_startups_are_kept_beside_the_entries_and_survive_a_refresh(tmp_path):
    cal = Calibration()
    for s in (30.0, 90.0, 32.0):  # the 90 s start read its weights from a cold disk
        cal = record_startup(cal, KEY, s, "2026-12-01T10:00:00+00:00", {"weights_s": 4.5}, "n1")
    (found,) = cal.startups
    assert found.seconds == (30.0, 90.0, 32.0) and found.median_s == 32.0
    assert found.servers == ("n1",) and dict(found.phases) == {"weights_s": 4.5}
    back = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
    assert back == cal
    # A metrics refresh merges entries and keeps the start-ups.
    entry = Entry(KEY, "2026-12-01T11:00:00+00:00")
    assert cal.merged([entry]).startups == cal.startups
    # A file written before start-ups were kept still reads.
    old = {"format": 1, "entries": [entry.to_json()]}
    assert Calibration.from_json(old).startups == ()
    with pytest.raises(CalibrationError, match=r"startups\[0\].seconds"):
        bad = {**cal.to_json()}
        bad["startups"] = [{**bad["startups"][0], "seconds": [-1]}]
        Calibration.from_json(bad)
    assert find_startup(cal, "A100-SXM4-80GB", "llama-3-8b", "bf16", 2) is None


def test_measured_startup_wins_over_the_estimate():
    weights = 16_060_000_000
    est = warmup_for(None, "A100-SXM4-80GB", "llama-3-8b", "bf16", 1, weights)
    assert est.seconds == pytest.approx(weights / DISK_READ_BYTES_S + STARTUP_FIXED_S)
    assert not est.measured and est.source.startswith("estimate: 16.1 GB at 1 GB/s + 60 s")
    cal = record_startup(Calibration(), KEY, 41.5, "2026-12-01T10:00:00+00:00")
    got = warmup_for(cal, "A100-SXM4-80GB", "llama-3-8b", "bf16", 1, weights)
    assert got.measured and got.seconds == 41.5
    assert got.source == "measured by apply over 1 start, 2026-12-01 10:00"
    assert warmup_seconds(cal, "A100-SXM4-80GB", "llama-3-8b", "bf16", 1, weights) == 41.5
    # Another format is another class: estimated.
    assert not warmup_for(cal, "A100-SXM4-80GB", "llama-3-8b", "fp8", 1, weights).measured


# --- a plan's disruption -----------------------------------------------------------------------


def flat(w: float):
    return lambda d: Warmup(w, "test")


def test_nothing_changes_nothing_is_disrupted():
    now = [dep((0,)), dep((1,))]
    got = disruption(now, now, flat(60))
    assert (got.servers_started, got.servers_stopped, got.warmup_s) == (0, 0, 0)
    assert got.line() == ""


def test_a_first_apply_warms_every_server_up_and_misses_nothing():
    got = disruption([dep((0,)), dep((1,))], [], flat(90))
    assert got.to_json() | {"servers": []} == {
        "warmup_server_minutes": 3.0,
        "capacity_missing_server_minutes": 0.0,
        "servers_started": 2,
        "servers_stopped": 0,
        "servers": [],
    }


def test_a_replacement_that_fits_beside_the_old_server_misses_no_capacity():
    # Two servers of 45% fit on one GPU together: apply starts the new one on the surge port,
    # waits for it, then stops the old one (apply/steps.py).
    old, new = dep((0,), util=0.45), dep((0,), util=0.45, max_len=4096)
    got = disruption([new], [old], flat(120))
    assert (got.servers_started, got.servers_stopped) == (1, 1)
    assert got.warmup_server_minutes == 2.0 and got.capacity_missing_s == 0.0
    (s,) = got.started
    assert s.surge and s.kind == "replace" and s.stopped_first == 0
    assert "1 replacement starts beside the old server" in got.line()


def test_a_replacement_that_does_not_fit_leaves_its_slot_empty_while_it_warms_up():
    old, new = dep((0,), util=0.92), dep((0,), util=0.92, max_len=4096)
    got = disruption([new], [old], flat(120))
    assert got.warmup_server_minutes == 2.0 and got.capacity_missing_server_minutes == 2.0
    assert not got.started[0].surge and got.started[0].stopped_first == 1
    # Two TP=1 servers replaced by one TP=2: both are out while it warms up.
    got = disruption([dep((0, 1))], [dep((0,)), dep((1,))], flat(60))
    assert got.servers_started == 1 and got.servers_stopped == 2
    assert got.capacity_missing_server_minutes == 2.0


def test_a_server_moved_to_another_node_is_missing_until_its_replacement_is_up():
    here = dep((0,))
    there = Deployment("n2", "10.0.0.2", (0,), 8000, here.server)
    got = disruption([there], [here], flat(90))
    # n1 has nothing to start: it stops at once, while n2's server warms up for 90 s.
    assert (got.servers_started, got.servers_stopped) == (1, 1)
    assert got.capacity_missing_s == 90.0
    # A model that only shrinks loses what the plan drops, by design: nothing is "missing".
    got = disruption([dep((0,))], [dep((0,)), dep((1,))], flat(90))
    assert (got.servers_started, got.servers_stopped, got.capacity_missing_s) == (0, 1, 0.0)


def test_the_warmup_follows_each_servers_weights():
    big = dep((0,), util=0.92, max_len=4096)
    big = dataclasses.replace(big, server=dataclasses.replace(big.server, weights_bytes=int(40e9)))
    got = disruption(
        [big], [dep((0,))], lambda d: warmup_for(None, "g", "m", "f", 1, d.server.weights_bytes)
    )
    assert got.warmup_s == pytest.approx(40 + STARTUP_FIXED_S)
