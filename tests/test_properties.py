"""Property-based tests: invariants of the planner, the scheduler, the simulator and
the routing policies over generated inputs, not hand-picked examples.

Each property was shown failing once on a one-line bug planted in a throwaway worktree (the
commit that added this file names them). Runs derandomized: the same examples every run.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import Catalog, load_catalog
from fleetctl.model.perf import EnginePerf, kv_budget
from fleetctl.planner import plan_fleet
from fleetctl.routing.policy import HardwareAware, Policy
from fleetctl.routing.registry import make_policy, policy_names
from fleetctl.routing.scheduler import Aging, Scheduler, account, release
from fleetctl.routing.types import Backend, Request, precision_matches
from fleetctl.sim.fleet import Server, simulate
from fleetctl.sim.workload import WorkItem

CATALOG: Catalog = load_catalog()


def fast(examples: int) -> settings:
    """Deterministic (the same examples every run), no deadline, sized for a 2-core machine."""
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------------------------------------
# The planner never oversubscribes a GPU and honours every min and max.

GPU_TYPES = sorted(g.name for g in CATALOG.gpus.values())
# (profile, its max_context): small and large models, so TP groups of 1, 2, 4 and 8 all occur.
MODEL_PROFILES = {
    "llama-3-8b": 8192,
    "mistral-7b": 8192,
    "qwen2.5-7b": 8192,
    "llama-2-13b": 4096,
    "llama-3-70b": 8192,
    "qwen2.5-72b": 32768,
}


@st.composite
def inventories(draw: st.DrawFn) -> tuple[str, str]:
    lines = ["nodes:"]
    for i in range(draw(st.integers(1, 4))):
        gpu = draw(st.sampled_from(GPU_TYPES))
        count = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
        copies = draw(st.integers(1, 2))
        name = f"n{i}-[1:{copies}]" if copies > 1 else f"n{i}"
        lines += [f"  - name: {name}", f"    gpus: {{type: {gpu}, count: {count}}}"]
        if draw(st.booleans()):
            lines.append(f"    cost_per_hour: {draw(st.sampled_from([0.3, 1.0, 2.5, 6.0]))}")
    lines.append("models:")
    profiles = draw(st.lists(st.sampled_from(sorted(MODEL_PROFILES)), min_size=1, max_size=3))
    for j, profile in enumerate(profiles):
        lo = draw(st.integers(0, 3))
        hi = draw(st.one_of(st.none(), st.integers(max(lo, 1), 4)))
        ctx = draw(st.sampled_from([2048, 4096, MODEL_PROFILES[profile]]))
        rps = draw(st.sampled_from([0.5, 4, 40]))
        lines += [
            f"  - name: m{j}",
            f"    profile: {profile}",
            "    variants: {bf16: {source: s}}"
            if draw(st.booleans())
            else "    variants: {bf16: {source: s}, fp8: {source: t}}",
            f"    max_context: {min(ctx, MODEL_PROFILES[profile])}",
            f"    min_replicas: {lo}",
            *([f"    max_replicas: {hi}"] if hi is not None else []),
            f"    workload: {{requests_per_s: {rps}, mean_prompt_tokens: 1000, "
            "mean_output_tokens: 200}",
        ]
    return "\n".join(lines) + "\n", draw(st.sampled_from(["throughput", "cost"]))


@fast(300)
@given(inventories())
def test_the_planner_never_oversubscribes_a_gpu_and_honours_min_and_max(case):
    text, objective = case
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "inventory.yaml"
        path.write_text(text)
        inv = load_inventory(path, CATALOG)
        plan = plan_fleet(inv, objective=objective)
    nodes = {n.name: n for n in inv.nodes}
    used: Counter[tuple[str, int]] = Counter()
    for dep in plan.deployments:
        node = nodes[dep.node]  # a TP group names one node: it cannot span two
        assert dep.gpu_type == node.gpu.name, (dep, text)
        assert len(dep.gpu_indices) == dep.tensor_parallel_size, (dep, text)
        assert len(set(dep.gpu_indices)) == len(dep.gpu_indices), (dep, text)
        assert all(0 <= g < node.gpu_count for g in dep.gpu_indices), (dep, text)
        used.update((dep.node, g) for g in dep.gpu_indices)
    assert not used or max(used.values()) == 1, (used.most_common(3), text)
    per_model = Counter(dep.model for dep in plan.deployments)
    unplaced = {u.model for u in plan.unplaced}
    for m in inv.models:
        spec = m.spec
        if spec.max_replicas is not None:
            assert per_model[m.name] <= spec.max_replicas, (m.name, per_model, text)
        # A model short of min_replicas with no server at all is listed as unplaced, with why.
        # (One short with some servers is not reported: the xfail example below.)
        if per_model[m.name] == 0 and spec.min_replicas > 0:
            assert m.name in unplaced, (m.name, per_model, plan.unplaced, text)
            assert all(u.reason for u in plan.unplaced), plan.unplaced


SHORT_OF_MIN = """\
nodes:
  - name: n0
    gpus: {type: A100-PCIE-80GB, count: 1}
models:
  - name: m0
    profile: llama-2-13b
    variants: {bf16: {source: s}}
    max_context: 2048
    min_replicas: 2
    workload: {requests_per_s: 0.5, mean_prompt_tokens: 1000, mean_output_tokens: 200}
"""


# Found by the property above: a model short of min_replicas but not unplaced went unsaid.
@pytest.mark.parametrize("objective", ["throughput", "cost"])
def test_a_model_short_of_min_replicas_is_reported(tmp_path, objective):
    path = tmp_path / "inventory.yaml"
    path.write_text(SHORT_OF_MIN)
    plan = plan_fleet(load_inventory(path, CATALOG), objective=objective)
    assert len(plan.deployments) == 1  # one GPU: one replica of the two asked for
    said = any(u.model == "m0" for u in plan.unplaced) or any("m0" in w for w in plan.warnings)
    assert said, (plan.unplaced, plan.warnings)


# ---------------------------------------------------------------------------------------------
# The scheduler never starves an aged request.

TTFT_S = 1.0  # every backend TTFT the scheduler hears
AGING = Aging(factor=2.0, window_s=1e9)  # threshold: factor x median TTFT = 2 s
THRESHOLD = AGING.factor * TTFT_S


def slots_backend(slots: int) -> Backend:
    g, m, f = CATALOG.gpu("A100-SXM4-80GB"), CATALOG.model("llama-3-8b"), CATALOG.format("bf16")
    return Backend("b", "n", g.name, m.name, f.name, 1_000_000, slots, EnginePerf(g, m, f))


arrivals = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]),  # gap since the previous arrival, s
        st.integers(0, 3),  # priority
        st.sampled_from([0.2, 0.5, 0.8, 1.0]),  # service time, s
    ),
    min_size=1,
    max_size=40,
)


@fast(400)
@given(seq=arrivals, slots=st.integers(1, 3))
def test_the_scheduler_never_starves_an_aged_request(seq, slots):
    """One backend that runs `slots` requests at a time, more work than it can do, strict
    priority classes: once a request has waited past the aging threshold, no later arrival
    goes before it, so it is dispatched within threshold + one service in flight + the
    service of every request that arrived before it."""
    sched = Scheduler(HardwareAware(), Aging(AGING.factor, AGING.window_s))
    sched.observe_ttft(0.0, TTFT_S)
    b = slots_backend(slots)
    reqs, service, t = [], {}, 0.0
    for i, (gap, prio, svc) in enumerate(seq):
        t += gap
        reqs.append(Request(i, "llama-3-8b", 10, 10, priority=prio, arrival=t))
        service[i] = svc
    dispatched: dict[int, float] = {}
    running: list[tuple[float, Request]] = []  # (finishes at, request)
    n = 0
    while n < len(reqs) or len(sched) or running:
        now = min(
            reqs[n].arrival if n < len(reqs) else float("inf"),
            min((f for f, _ in running), default=float("inf")),
        )
        for done in [x for x in running if x[0] <= now]:
            release(b, done[1])
            running.remove(done)
        while n < len(reqs) and reqs[n].arrival <= now:
            sched.submit(reqs[n])
            n += 1
        # Requests already past the threshold and still queued before this dispatch.
        aged = [r for r in sched.queue if now - r.arrival > THRESHOLD]
        sent, rejected = sched.dispatch(now, [b])
        assert not rejected
        for d in sent:
            rid = d.request.id
            assert isinstance(rid, int)
            # Nobody who arrived after an aged request still waiting overtakes it.
            overtaken = [r.id for r in aged if r.arrival < d.request.arrival]
            assert not overtaken, (rid, overtaken, now, slots, seq)
            aged = [r for r in aged if r is not d.request]
            dispatched[rid] = now
            running.append((now + service[rid], d.request))
        assert len(running) <= slots
        # And every request still waiting past the threshold now waits in the top class.
        late = [
            r.id
            for r in sched.queue
            if now - r.arrival > THRESHOLD and r.priority > 0 and not r.boosted
        ]
        assert not late, (late, now, slots, seq)
    assert sorted(dispatched) == list(range(len(reqs)))  # every request ran
    longest = max(service.values())
    for i, r in enumerate(reqs):
        ahead = sum(service[j] for j, q in enumerate(reqs) if q.arrival <= r.arrival and j != i)
        bound = THRESHOLD + longest + ahead + 1e-9
        assert dispatched[i] - r.arrival <= bound, (i, dispatched[i], bound, seq)


# ---------------------------------------------------------------------------------------------
# The simulator conserves requests; a policy never picks an ineligible backend.

SIM_GPUS = ["A100-SXM4-80GB", "RTX-4090", "L40S", "H100-SXM-80GB"]
SIM_MODELS = ["llama-3-8b", "qwen2.5-7b"]
VARIANTS = ["bf16", "fp8", "gptq-int4"]
HINTS = [None, "bf16", "fp8", "int4", "16bit", "fp16"]


@st.composite
def sim_servers(draw: st.DrawFn) -> list[Server]:
    out = []
    for i in range(draw(st.integers(1, 4))):
        gpu = CATALOG.gpu(draw(st.sampled_from(SIM_GPUS)))
        model = CATALOG.model(draw(st.sampled_from(SIM_MODELS[:1] * 2 + SIM_MODELS[1:])))
        fmt = CATALOG.format(draw(st.sampled_from(VARIANTS)))
        kv = kv_budget(gpu, model, fmt).kv_tokens
        max_len = draw(st.sampled_from([2048, 8192, 32768]))
        seqs = draw(st.sampled_from([2, 16, 256]))
        out.append(
            Server(
                f"s{i}",
                f"node{i % 2}",
                gpu.name,
                model.name,
                fmt.name,
                EnginePerf(gpu, model, fmt),
                kv,
                seqs,
                2048,
                max_len,
            )
        )
    return out


@st.composite
def work(draw: st.DrawFn) -> list[WorkItem]:
    items, t = [], 0.0
    for i in range(draw(st.integers(1, 25))):
        t += draw(st.sampled_from([0.0, 0.05, 0.5, 2.0]))
        hint = draw(st.sampled_from(HINTS))
        items.append(
            WorkItem(
                i,
                t,
                draw(st.sampled_from([16, 500, 1900, 3000, 7000, 9000, 30_000])),
                draw(st.sampled_from([1, 50, 300, 1500])),
                draw(st.sampled_from([*SIM_MODELS * 4, "mistral-7b"])),  # one nobody serves
                priority=draw(st.integers(0, 2)),
                session=draw(st.sampled_from([None, "a", "b"])),
                precision=hint,
                strict=hint is not None and draw(st.sampled_from([False, False, True])),
                max_tokens=draw(st.sampled_from([None, 64, 2000])),
            )
        )
    return items


@pytest.mark.parametrize("policy", policy_names())
@fast(60)
@given(servers=sim_servers(), items=work())
def test_the_simulator_conserves_requests(policy, servers, items):
    """Every request submitted ends exactly once, finished or rejected: none lost in a queue,
    none dispatched twice, none both run and refused."""
    result = simulate(servers, items, policy, drain_s=3600.0)
    assert [o.item.id for o in result.outcomes] == [w.id for w in items]
    for o in result.outcomes:
        ended = (o.finished is not None) + (o.rejected is not None)
        assert ended == 1, (o, [(s.name, s.model, s.variant, s.max_model_len) for s in servers])
        if o.finished is not None:
            assert o.dispatched is not None and o.backend is not None, o
            assert o.item.arrival <= o.dispatched <= o.finished, o
            assert o.first_token is not None and o.first_token <= o.finished, o
    # Each dispatch is counted once under its decision's label: no request went out twice.
    assert sum(result.reasons.values()) == sum(o.dispatched is not None for o in result.outcomes)


@st.composite
def backend_sets(draw: st.DrawFn) -> list[Backend]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        gpu = CATALOG.gpu(draw(st.sampled_from(SIM_GPUS)))
        model = CATALOG.model(draw(st.sampled_from(SIM_MODELS)))
        fmt = CATALOG.format(draw(st.sampled_from(VARIANTS)))
        out.append(
            Backend(
                f"b{i}",
                f"node{i % 3}",
                gpu.name,
                model.name,
                fmt.name,
                kv_budget(gpu, model, fmt).kv_tokens,
                256,
                EnginePerf(gpu, model, fmt),
                max_model_len=draw(st.sampled_from([0, 2048, 8192])),
                healthy=draw(st.booleans()),
                outstanding=draw(st.integers(0, 8)),
                kv_usage=draw(st.sampled_from([0.0, 0.5, 0.97])),
                pending_prefill=draw(st.sampled_from([0, 20_000])),
            )
        )
    return out


def base_eligible(req: Request, b: Backend) -> bool:
    """The base rule (Policy.eligible), restated: healthy, of the request's model, and a
    max_model_len (when known) that takes prompt + max_tokens."""
    need = req.prompt_tokens + (req.max_tokens or 1)
    return b.healthy and b.model == req.model and (not b.max_model_len or b.max_model_len >= need)


@pytest.mark.parametrize("policy", policy_names())
@fast(100)
@given(backends=backend_sets(), items=work(), flips=st.lists(st.integers(0, 5), max_size=25))
def test_a_policy_never_picks_an_ineligible_backend(policy, backends, items, flips):
    """Over a stream of requests (sessions, precision hints, lengths) on backends whose health
    changes between requests, every pick passes the base eligibility rule and, for a strict
    precision hint under the seed's policy, serves the hinted format; a request with an
    eligible backend and no strict hint is never refused."""
    p: Policy = make_policy(policy, seed=0)
    for n, w in enumerate(items):
        if n < len(flips) and flips[n] < len(backends):  # a backend goes down or comes back
            b = backends[flips[n]]
            b.healthy = not b.healthy
        req = Request(
            w.id,
            w.model,
            w.prompt,
            w.max_tokens or w.output,
            w.priority,
            w.session,
            w.precision,
            w.strict,
            w.arrival,
            max_tokens=w.max_tokens,
        )
        pool, why = p.eligible(req, backends)
        ok = [b for b in backends if base_eligible(req, b)]
        if not pool:
            assert why, (policy, req)
            assert not ok or req.strict, (policy, req, [b.name for b in ok], why)
            continue
        d = p.choose(req, pool)
        assert d.backend is not None, (policy, req, d)
        assert base_eligible(req, d.backend), (policy, req, d.backend)
        if req.strict and req.precision and isinstance(p, HardwareAware):
            assert precision_matches(req.precision, d.backend.variant), (req, d.backend)
        p.placed(req, d.backend)
        account(d.backend, req, 0.0)
