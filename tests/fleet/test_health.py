"""Health checks as pure functions of facts and state, and against real (emulated) servers."""

from __future__ import annotations

import dataclasses

import pytest

from fleetctl.fleet import health as h
from fleetctl.fleet.facts import Facts
from fleetctl.fleet.inventory import load_inventory
from fleetctl.planner import plan_fleet
from tests.conftest import write
from tests.procs import Emulator

INV = """\
nodes:
  - name: rtx-[1:3]
    host: 127.0.0.[1:3]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}
    max_context: 8192
"""


def facts(**nodes):
    return Facts.from_json({"nodes": nodes})


def gpu(index=0, uuid="GPU-a", name="NVIDIA GeForce RTX 4090", **kw):
    return {"index": index, "uuid": uuid, "name": name, **kw}


def test_gpus_gone_or_new_since_the_saved_facts():
    before = facts(
        **{"rtx-1": {"gpus": [gpu(0, "GPU-a"), gpu(1, "GPU-b")]}, "rtx-2": {"gpus": [gpu()]}}
    )
    now = facts(
        **{"rtx-1": {"gpus": [gpu(0, "GPU-a"), gpu(1, "GPU-c")]}, "rtx-2": {"gpus": [gpu()]}}
    )
    (c,) = h.check_changes(before, now)
    assert c.node == "rtx-1" and c.status == "fail" and "GPU-b" in c.detail and "GPU-c" in c.detail
    assert h.check_changes(None, now) == []


def test_foreign_process_on_a_planned_gpu(tmp_path, catalog):
    inv = load_inventory(write(tmp_path, INV), catalog)
    plan = plan_fleet(inv)
    f = facts(
        **{
            "rtx-1": {
                "gpus": [
                    gpu(
                        processes=[
                            {"pid": 42, "process_name": "/usr/bin/miner", "used_memory_mib": 6000}
                        ]
                    )
                ]
            },
            "rtx-2": {
                "gpus": [
                    gpu(
                        processes=[
                            {
                                "pid": 7,
                                "process_name": "python3 -m vllm.entrypoints",
                                "used_memory_mib": 20000,
                            }
                        ]
                    )
                ]
            },
            "rtx-3": {
                "gpus": [
                    gpu(processes=[{"pid": 9, "process_name": "Xorg", "used_memory_mib": 200}])
                ]
            },
        }
    )
    checks = h.check_gpus(f, plan.deployments)
    assert [(c.check, c.node) for c in checks] == [("foreign-process", "rtx-1")]
    assert "pid 42" in checks[0].detail and "llama-3-8b" in checks[0].detail


def test_skew_marks_only_the_odd_node(tmp_path, catalog):
    inv = load_inventory(write(tmp_path, INV), catalog)
    node = {
        "driver_version": "580.65.06",
        "cuda_version": "13.0",
        "vllm": "0.32.0",
        "gpus": [gpu()],
    }
    f = facts(**{"rtx-1": node, "rtx-2": node, "rtx-3": {**node, "vllm": "0.31.1"}})
    checks, equivalent = h.check_skew(inv, f)
    assert equivalent == {"rtx-1": True, "rtx-2": True, "rtx-3": False}
    (bad,) = [c for c in checks if c.status == "fail"]
    assert bad.check == "skew:vllm" and "0.31.1 differs from 0.32.0" in bad.detail


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    e = Emulator(tmp_path_factory.mktemp("health"))
    try:
        e.wait_healthy()
        yield e
    finally:
        e.stop()


def test_servers_against_the_plan(emu, tmp_path, catalog):
    inv = load_inventory(write(tmp_path, INV), catalog)
    d = plan_fleet(inv).deployments[0]
    good = dataclasses.replace(d, host="127.0.0.1", port=emu.port)
    (ok,) = h.check_servers([good])
    assert ok.status == "ok", ok
    # Planned with another max_model_len than the server runs.
    other = dataclasses.replace(good, server=dataclasses.replace(good.server, max_model_len=4096))
    assert any("max_model_len" in c.detail and c.status == "fail" for c in h.check_servers([other]))
    # A server that serves another model, and one that is not there.
    wrong = dataclasses.replace(good, server=dataclasses.replace(good.server, model="mistral-7b"))
    assert "not mistral-7b" in h.check_servers([wrong])[0].detail
    gone = dataclasses.replace(good, port=1)
    assert h.check_servers([gone], timeout=1)[0].status == "fail"


def test_foreign_process_by_pid_when_the_probe_knows_fleetctls_servers(tmp_path, catalog):
    """With `fleetctl_pids` (servers apply started, children included) a python notebook
    on a planned GPU is foreign too; our vLLM engine process is not, whatever its name."""
    inv = load_inventory(write(tmp_path, INV), catalog)
    plan = plan_fleet(inv)
    procs = [
        {"pid": 7, "process_name": "VLLM::EngineCore", "used_memory_mib": 20000},
        {"pid": 55, "process_name": "python3 train.py", "used_memory_mib": 4000},
    ]
    f = facts(**{"rtx-1": {"gpus": [gpu(processes=procs)], "fleetctl_pids": [6, 7]}})
    checks = h.check_gpus(f, plan.deployments)
    assert [(c.check, c.node) for c in checks] == [("foreign-process", "rtx-1")]
    assert "pid 55" in checks[0].detail
