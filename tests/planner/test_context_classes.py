"""Per-class context lengths (min_context): each node class runs the longest max_model_len its
KV cache holds, the fleet serves max_context somewhere, and no request reaches a server whose
length is below prompt + max_tokens (router and simulator)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from fleetctl.base.resources import examples
from fleetctl.daemon.backends import backends_from_state, load_backends_file
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.perf import max_sequences
from fleetctl.planner import plan_fleet
from fleetctl.planner.candidates import CONTEXT_STEP
from fleetctl.routing.policy import HardwareAware
from fleetctl.routing.scheduler import Scheduler
from fleetctl.routing.types import Backend, Request
from fleetctl.sim.fleet import servers_from_plan, simulate
from fleetctl.sim.workload import WorkItem
from tests.conftest import write

A100, RTX = "A100-SXM4-80GB", "RTX-4090"

MIXED = """\
nodes:
  - name: a100-[1:2]
    host: 10.0.1.[11:12]
    gpus: {type: A100-SXM4-80GB, count: 1}
  - name: rtx-[1:4]
    host: 10.0.2.[21:24]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3.1-8b
    profile: llama-3.1-8b
    variants:
      bf16: {source: meta-llama/Llama-3.1-8B-Instruct}
    max_context: 131072
    min_context: 16384
    workload: {requests_per_s: 2, mean_prompt_tokens: 8000, mean_output_tokens: 300}
"""


def plan_of(tmp_path, catalog, text):
    inv = load_inventory(write(tmp_path, text), catalog)
    return inv, plan_fleet(inv)


def lengths(plan):
    """GPU type -> the set of max_model_len its servers run."""
    out: dict[str, set[int]] = {}
    for d in plan.deployments:
        out.setdefault(d.gpu_type, set()).add(d.server.max_model_len)
    return out


def flag(d, name="--max-model-len"):
    args = list(d.vllm_args)
    return int(args[args.index(name) + 1])


# --- planning ----------------------------------------------------------------------------------


def test_each_class_runs_the_longest_length_its_kv_cache_holds(tmp_path, catalog):
    _, plan = plan_of(tmp_path, catalog, MIXED)
    assert not plan.unplaced
    got = lengths(plan)
    assert got[A100] == {131072}
    [rtx] = got[RTX]
    assert 16384 <= rtx < 131072 and rtx % CONTEXT_STEP == 0
    for d in plan.deployments:
        s = d.server
        assert flag(d) == s.max_model_len  # what vLLM is started with
        # The KV rule (min_sequences, here 1) holds at the length, and not one step longer.
        assert max_sequences(s.kv_budget_tokens, s.max_model_len) >= 1
        assert s.max_sequences_at_max_len == max_sequences(s.kv_budget_tokens, s.max_model_len)
        if s.max_model_len < 131072:
            assert max_sequences(s.kv_budget_tokens, s.max_model_len + CONTEXT_STEP) == 0
    # The plan says why, in numbers: JSON, --explain reasons, and the table's footnote.
    by_gpu = {d.gpu_type: d.to_json() for d in plan.deployments}
    assert by_gpu[A100]["max_model_len_reason"] == "131072 = max_context"
    why = by_gpu[RTX]["max_model_len_reason"]
    assert why.startswith(f"{rtx}: the KV budget of ")
    assert "holds 1 sequence of" in why and "min_context 16384" in why
    assert f"max_model_len {why}" in by_gpu[RTX]["reasons"]


def test_plan_output_shows_each_length_and_why(cli, tmp_path):
    path = write(tmp_path, MIXED)
    r = cli("plan", path)
    assert r.code == 0, r.out + r.err
    lines = [line for line in r.out.splitlines() if "max_model_len" in line]
    assert any(line.startswith("llama-3.1-8b on A100-SXM4-80GB") for line in lines), r.out
    assert any("on RTX-4090" in line and "KV budget" in line for line in lines), r.out
    deployments = json.loads(cli("plan", path, "--json").out)["deployments"]
    assert {d["max_model_len"] for d in deployments if d["gpu_type"] == A100} == {131072}
    assert all(d["max_model_len_reason"] for d in deployments)


def test_without_min_context_every_server_takes_max_context(tmp_path, catalog):
    text = MIXED.replace("    min_context: 16384\n", "").replace("131072", "32768")
    _, plan = plan_of(tmp_path, catalog, text)
    assert lengths(plan) == {A100: {32768}, RTX: {32768}}
    for d in plan.deployments:
        assert flag(d) == 32768
        assert not any(r.startswith("max_model_len") for r in d.server.reasons)
    # Without min_context a 4090 cannot take 131072: the model is placed on the A100s only.
    _, plan = plan_of(tmp_path, catalog, MIXED.replace("    min_context: 16384\n", ""))
    assert lengths(plan) == {A100: {131072}}


def test_min_context_that_every_class_reaches_changes_nothing(tmp_path, catalog):
    text = MIXED.replace("131072", "16384")
    _, with_min = plan_of(tmp_path, catalog, text)
    _, without = plan_of(tmp_path, catalog, text.replace("    min_context: 16384\n", ""))
    assert [d.args_hash for d in with_min.deployments] == [d.args_hash for d in without.deployments]
    assert lengths(with_min) == {A100: {16384}, RTX: {16384}}


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("200000", ["min_context 200000 exceeds max_context 131072", "lower min_context"]),
        ("0", ["min_context"]),
    ],
)
def test_a_bad_min_context_is_one_line_with_its_place(cli, tmp_path, value, words):
    path = write(tmp_path, MIXED.replace("min_context: 16384", f"min_context: {value}"))
    r = cli("validate", path)
    assert r.code == 2
    err = r.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert f"{path}:14: models[0].min_context" in err, err
    for w in words:
        assert w in err, err


def test_a_fleet_that_serves_max_context_nowhere_is_an_incomplete_plan(cli, tmp_path, catalog):
    only_rtx = MIXED.replace(
        "  - name: a100-[1:2]\n    host: 10.0.1.[11:12]\n"
        "    gpus: {type: A100-SXM4-80GB, count: 1}\n",
        "",
    )
    _, plan = plan_of(tmp_path, catalog, only_rtx)
    assert not plan.deployments  # no 4090 is spent on a model the plan cannot complete
    [u] = plan.unplaced
    assert "must serve max_context 131072" in u.reason
    assert "the longest is " in u.reason and "on 1x RTX-4090" in u.reason
    assert "lower max_context to " in u.reason
    r = cli("plan", write(tmp_path, only_rtx))
    assert r.code == 3, r.out + r.err
    assert "must serve max_context 131072" in r.out
    # Not even min_context fits: the usual reason, about min_context.
    _, plan = plan_of(tmp_path, catalog, only_rtx.replace("16384", "65536"))
    [u] = plan.unplaced
    assert "65536 tokens need" in u.reason and "lower min_context" in u.reason


def test_the_optimizer_keeps_one_server_at_max_context(tmp_path, catalog):
    # A second model wants every A100 (it runs nowhere else, with a large workload); the
    # 8B's workload alone would be met on the 4090s. One A100 still goes to the 8B, at its
    # max_context, since the fleet must serve 131072 somewhere.
    text = MIXED + (
        "  - name: big\n"
        "    profile: llama-3.1-8b\n"
        "    variants: {bf16: {source: meta-llama/Llama-3.1-8B-Instruct}}\n"
        "    max_context: 8192\n"
        "    placement: {gpu_types: [A100-SXM4-80GB]}\n"
        "    workload: {requests_per_s: 500, mean_prompt_tokens: 2000, mean_output_tokens: 300}\n"
    )
    text = text.replace("requests_per_s: 2,", "requests_per_s: 0.2,")
    _, plan = plan_of(tmp_path, catalog, text)
    assert not plan.unplaced
    placed = Counter((d.model, d.gpu_type, d.server.max_model_len) for d in plan.deployments)
    assert placed[("llama-3.1-8b", A100, 131072)] == 1, placed
    assert placed[("big", A100, 8192)] == 1, placed


# --- routing -----------------------------------------------------------------------------------


def backend(name, gpu, max_len, kv):
    return Backend(name, name, gpu, "m", "bf16", kv, 256, None, max_model_len=max_len)


def test_a_request_goes_only_where_its_length_fits():
    long_ = backend("a100", A100, 131072, 469_840)
    short = backend("rtx", RTX, 32768, 47_712)
    policy = HardwareAware()
    sched = Scheduler(policy)
    for i in range(6):  # 40K of context: only the A100 takes it, however busy it is
        sched.submit(Request(f"r{i}", "m", 40_000, 500, arrival=i, max_tokens=500))
    sched.submit(Request("small", "m", 2000, 100, arrival=7, max_tokens=100))
    sched.submit(Request("huge", "m", 140_000, 100, arrival=8, max_tokens=100))
    sent, rejected = sched.dispatch(10.0, [long_, short])
    where = {d.request.id: d.decision.backend.name for d in sent}  # type: ignore[union-attr]
    assert {where[f"r{i}"] for i in range(6) if f"r{i}" in where} == {"a100"}
    assert all(
        d.decision.backend.max_model_len >= d.request.context_needed  # type: ignore[union-attr]
        for d in sent
    )
    [r] = rejected
    assert r.request.id == "huge"
    assert "140100" in r.decision.reason and "the longest m serves is 131072" in r.decision.reason
    # What the policy itself says of the pool.
    pool, why = policy.eligible(Request("x", "m", 40_000, 1, max_tokens=1), [long_, short])
    assert [b.name for b in pool] == ["a100"] and why == ""


def test_route_serve_backends_from_state_carry_the_planned_length(tmp_path, catalog):
    # Before, every backend the daemon built from state.json had max_model_len 0 (unknown),
    # so its length filter never acted and vLLM answered the 400 itself.
    inv = load_inventory(examples()["seed-mixed-8b-16k"], catalog)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, plan_fleet(inv).deployments))
    found = backends_from_state(inv, sdir)
    assert found and {b.max_model_len for b in found} == {16384}
    pool, why = HardwareAware().eligible(
        Request("x", "llama-3.1-8b", 16_000, 1000, max_tokens=1000), found
    )
    assert pool == [] and "the longest llama-3.1-8b serves is 16384" in why


def test_route_serve_backends_carry_each_servers_length(tmp_path, catalog):
    inv, plan = plan_of(tmp_path, catalog, MIXED)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, plan.deployments))
    found = backends_from_state(inv, sdir)
    want = {d.url(): d.server.max_model_len for d in plan.deployments}
    assert {b.name: b.max_model_len for b in found} == want
    assert {b.max_model_len for b in found if b.gpu_type == A100} == {131072}
    # A backends file may say it too; without it the length does not filter (0).
    path = write(
        tmp_path,
        "backends:\n"
        "  - {url: 'http://10.0.2.21:8000', gpu_type: RTX-4090, model: llama-3.1-8b,\n"
        "     max_model_len: 32768}\n"
        "  - {url: 'http://10.0.2.22:8000', gpu_type: RTX-4090, model: llama-3.1-8b}\n",
        "backends.yaml",
    )
    assert [b.max_model_len for b in load_backends_file(path, inv, catalog)] == [32768, 0]


# --- simulation --------------------------------------------------------------------------------


def mooncake_like(n: int, seed: int = 1) -> list[WorkItem]:
    """Requests shaped like the Mooncake conversation trace: lognormal prompts (median ~7K,
    a tail past 100K), about 300 output tokens, arrivals at about 3.3 req/s."""
    rng = random.Random(seed)
    items, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(3.3)
        prompt = min(126_000, max(64, int(rng.lognormvariate(8.85, 1.1))))
        output = max(1, min(2000, int(rng.expovariate(1 / 340))))
        items.append(WorkItem(i, t, prompt, output, "llama-3.1-8b", max_tokens=output))
    return items


@pytest.mark.parametrize("policy", ["hardware-aware", "least-outstanding"])
def test_no_simulated_request_lands_on_a_server_too_short_for_it(catalog, policy):
    inv = load_inventory(examples()["mooncake-mixed"], catalog)
    plan = plan_fleet(inv)
    assert not plan.unplaced
    servers = servers_from_plan(plan.deployments, inv)
    length = {s.name: s.max_model_len for s in servers}
    assert {s.max_model_len for s in servers if s.gpu_type == A100} == {131072}
    short = {s.max_model_len for s in servers if s.gpu_type == RTX}
    assert len(short) == 1 and 32768 <= min(short) < 131072
    items = mooncake_like(900)
    assert sum(w.prompt + w.output > min(short) for w in items) >= 10  # some need an A100
    result = simulate(servers, items, policy, seed=3, drain_s=3600)
    landed = [o for o in result.outcomes if o.backend is not None]
    assert len(landed) == len(items)
    assert not [o for o in result.outcomes if o.rejected], Counter(
        o.rejected for o in result.outcomes if o.rejected
    )
    for o in landed:
        assert length[o.backend] >= o.item.prompt + (o.item.max_tokens or 1), o
    gpu = {s.name: s.gpu_type for s in servers}
    assert {gpu[o.backend] for o in landed if o.item.prompt + o.item.output > min(short)} == {A100}
    assert {gpu[o.backend] for o in landed} == {A100, RTX}
