"""README claims about `fleetctl apply` and `status`, each pinned by a test that fails if it
breaks: apply's pure step decisions, and `status` over real SSH to the test hosts of
tests/apply/test_apply.py (sshd in network namespaces, `vllm` a shim running `fleetctl emulate`).
tests/README.md maps each claim to its test."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from fleetctl.apply.steps import node_steps
from tests.apply.test_apply import NAMES, get, squat, wait_until
from tests.apply.test_apply import fleet as fleet  # a fixture, re-exported
from tests.apply.test_apply import hosts as hosts  # a fixture, re-exported
from tests.apply.test_apply_steps import dep, live

# --- start before stop only when the shares sum to at most 1 --------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "first"),
    [
        (0.5, 0.5, "start"),  # exactly 1: both fit
        (0.3, 0.7, "start"),
        (0.5, 0.51, "stop"),  # just over 1
        (0.92, 0.05, "start"),  # a big old server beside a small new one
        (0.6, 0.45, "stop"),
    ],
)
def test_start_before_stop_only_when_shares_sum_to_at_most_1(old, new, first):
    """README "Applying a plan": a replacement starts the new server before stopping the old
    one when their gpu_memory_utilization shares sum to at most 1, on the slot's other port
    (port_base + GPU + 1000); otherwise the old server stops first, on the same port."""
    was = dep((0,), util=old)
    now = dep((0,), util=new, max_len=4096)
    [step] = node_steps("n1", [now], [live(was)], recorded=[was])
    assert step.kind == "replace"
    if first == "start":
        assert (step.stop_first, step.deployment.port) == (False, 9000)
        assert step.note.startswith("start before stop")
    else:
        assert (step.stop_first, step.deployment.port) == (True, 8000)
        assert step.note.startswith("stop then start")


# --- status: every condition ----------------------------------------------------------------------


def test_status_names_every_condition(cli, fleet):
    """README "Commands": `status` checks each recorded server live: running, unhealthy, dead,
    missing, restarted by hand, port taken, unrecorded; exit 1 unless every server runs and
    every node was reached. One apply, then one server made each way over real SSH hosts."""
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    assert cli("status", *fleet.args(fleet.inv)).code == 0
    # a100-1 GPU 0 stopped (alive, silent): unhealthy. a100-1 GPU 1 dropped from the state:
    # unrecorded. rtx-1 killed and its folder removed: missing. rtx-2 killed and its port
    # squatted by another program: port taken.
    stopped = fleet.pid("a100-1", 8000)
    os.kill(stopped, signal.SIGSTOP)
    squatter = None
    try:
        path = fleet.tmp / ".fleetctl" / "state.json"
        state = json.loads(path.read_text())
        state["deployments"] = [
            d for d in state["deployments"] if not (d["node"] == "a100-1" and d["port"] == 8001)
        ]
        path.write_text(json.dumps(state))
        rtx1 = fleet.pid("rtx-1", 8000)
        os.kill(rtx1, signal.SIGKILL)
        wait_until(lambda: get(fleet.url("rtx-1", 8000) + "/health")[0] == 0)
        servers = fleet.home("rtx-1") / ".fleetctl" / "servers"
        subprocess.run(["rm", "-rf", *map(str, servers.glob("8000-*"))], check=True)
        os.kill(fleet.pid("rtx-2", 8000), signal.SIGKILL)
        wait_until(lambda: get(fleet.url("rtx-2", 8000) + "/health")[0] == 0)
        squatter = squat(fleet.hosts[NAMES.index("rtx-2")], 8000)

        r = cli("status", *fleet.args(fleet.inv, "--json"))
        assert r.code == 1
        cond = {(s["node"], s["port"]): s for s in json.loads(r.out)["servers"]}
        assert {k: v["condition"] for k, v in cond.items()} == {
            ("a100-1", 8000): "unhealthy",
            ("a100-1", 8001): "unrecorded",
            ("rtx-1", 8000): "missing",
            ("rtx-2", 8000): "port-taken",
        }, r.out
        assert "http.server" in cond[("rtx-2", 8000)]["detail"]

        # A node that cannot be reached: its servers are unreachable, exit 1.
        i = NAMES.index("rtx-2")
        fleet.hosts.stop(i)
        try:
            r = cli("status", *fleet.args(fleet.inv, "--json"))
        finally:
            fleet.hosts.start(i)
        assert r.code == 1
        out = json.loads(r.out)
        cond = {(s["node"], s["port"]): s["condition"] for s in out["servers"]}
        assert cond[("rtx-2", 8000)] == "unreachable"
        assert [u["node"] for u in out["unreachable"]] == ["rtx-2"]
    finally:
        os.kill(stopped, signal.SIGCONT)
        if squatter is not None:
            squatter.kill()
            squatter.wait()
    # destroy stops what the state holds; the unrecorded server is stopped by an apply.
    assert cli("apply", *fleet.args(fleet.inv, "--yes")).code == 0
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


def test_a_new_server_must_list_its_model(cli, fleet):
    """README "Applying a plan": every new server must answer /health and list its model in
    /v1/models within health_timeout_s; one that does not is reported with the tail of its
    log, stopped, and left out of the state while the other nodes go on; exit 1. rtx-2's
    server answers /health but serves another name."""
    from tests.apply.test_apply import GPU, outcomes, servers_running, shim

    i = NAMES.index("rtx-2")
    fleet.hosts.install(i, "vllm", shim(GPU["rtx"][0], "--served-model-name other-model"))
    text = fleet.inv.read_text().replace("health_timeout_s: 60", "health_timeout_s: 5")
    fleet.inv.write_text(text)
    r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
    assert r.code == 1, r.out + r.err
    by = {(o["node"], o["gpus"][0]): o for o in outcomes(r)}
    bad = by[("rtx-2", 0)]
    assert bad["status"] == "failed"
    assert "other-model" in bad["detail"] and "llama-3-8b" in bad["detail"], bad
    assert all(o["status"] == "ok" for k, o in by.items() if k != ("rtx-2", 0))
    assert [d["node"] for d in fleet.state()["deployments"]].count("rtx-2") == 0
    rtx2 = fleet.hosts[i]
    assert not [p for p in servers_running(fleet.hosts) if p in fleet.hosts._namespace_pids([rtx2])]
    assert cli("destroy", *fleet.args(fleet.inv, "--yes")).code == 0


# --- the planner: min and max replicas -----------------------------------------------------------------

SCARCE = """\
nodes:
  - name: r-[1:4]
    gpus: {{type: RTX-4090, count: 1}}
models:
  - name: small
    profile: llama-3-8b
    variants: {{bf16: {{source: x}}}}
    max_context: 4096
    min_replicas: {min_small}
    workload: {{requests_per_s: 0.1, mean_prompt_tokens: 200, mean_output_tokens: 50}}
  - name: busy
    profile: llama-3-8b
    variants: {{bf16: {{source: y}}}}
    max_context: 4096
    workload: {{requests_per_s: 100, mean_prompt_tokens: 1000, mean_output_tokens: 300}}
"""


@pytest.mark.parametrize("min_small", [1, 3])
def test_min_replicas_hold_against_a_busier_model(tmp_path, catalog, min_small):
    """README "How the planner decides": the program places first minimum replicas, then
    covers each workload. Four GPUs, a busy model short of capacity and an idle one: the idle
    model gets exactly its min_replicas (1, or 3), the busy one the rest."""
    from tests.planner.test_planner import plan_text

    plan = plan_text(tmp_path, catalog, SCARCE.format(min_small=min_small))
    count = {m: sum(d.model == m for d in plan.deployments) for m in ("small", "busy")}
    assert count == {"small": min_small, "busy": 4 - min_small}


# --- the planner: context length per class -------------------------------------------------------------

CLASSES = """\
nodes:
  - {{name: n-1, gpus: {{type: RTX-4090, count: 1}}}}
  - {{name: n-2, gpus: {{type: L40S, count: 1}}}}
  - {{name: n-3, gpus: {{type: A10G, count: 1}}}}
  - {{name: n-4, gpus: {{type: RTX-3090, count: 1}}}}
  - {{name: n-5, gpus: {{type: L4, count: 1}}}}
  - {{name: n-6, gpus: {{type: A100-SXM4-80GB, count: 1}}}}
models:
  - name: m
    profile: {profile}
    variants: {{bf16: {{source: x}}}}
    max_context: {top}
    min_context: 2048
    min_sequences: {seqs}
"""


@pytest.mark.parametrize(
    ("profile", "top", "seqs"), [("llama-3.1-8b", 131072, 1), ("qwen2.5-7b", 32768, 4)]
)
def test_per_class_length_is_the_longest_multiple_of_1024_it_holds(
    tmp_path, catalog, profile, top, seqs
):
    """README "Context length per class": a class whose KV cache cannot hold min_sequences of
    max_context runs the longest length it can hold them of, rounded down to a multiple of
    1024. Each shorter server's length is a multiple of 1024, its KV holds min_sequences of it,
    and not of 1024 more."""
    from tests.planner.test_planner import plan_text

    plan = plan_text(tmp_path, catalog, CLASSES.format(profile=profile, top=top, seqs=seqs))
    shorter = [d for d in plan.deployments if d.server.max_model_len < top]
    assert shorter, "every class held max_context: the rule is not exercised"
    for d in shorter:
        length, kv = d.server.max_model_len, d.server.kv_budget_tokens
        assert length % 1024 == 0, (d.gpu_type, length)
        assert seqs * length <= kv < seqs * (length + 1024), (d.gpu_type, length, kv)


def test_mooncake_mixed_runs_131072_on_a100s_and_47104_on_4090s(catalog):
    """README: for Llama-3.1 8B BF16 (`example:mooncake-mixed`): 131072 on the A100s, 47104
    on the 4090s."""
    from fleetctl.base.resources import examples
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.planner import plan_fleet

    plan = plan_fleet(load_inventory(examples()["mooncake-mixed"], catalog), None)
    lengths = {(d.gpu_type, d.server.max_model_len) for d in plan.deployments}
    assert {length for gpu, length in lengths if "A100" in gpu} == {131072}
    assert {length for gpu, length in lengths if "4090" in gpu} == {47104}
