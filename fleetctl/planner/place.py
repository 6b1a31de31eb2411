"""Placement: a plan from the inventory, the state and the calibration, through candidates
per node class, the MILP (optimize.py) and expansion onto nodes (expand.py)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from fleetctl.base.errors import UserError
from fleetctl.base.limits import SURGE_PORT_OFFSET
from fleetctl.base.names import natural_key
from fleetctl.fleet.inventory import Inventory, Model
from fleetctl.fleet.plan import (
    BucketUse,
    Deployment,
    Disaggregation,
    KvEvents,
    ModelSummary,
    Plan,
    Server,
    Unplaced,
)
from fleetctl.fleet.prices import total
from fleetctl.fleet.slo import Slo
from fleetctl.fleet.state import State
from fleetctl.model.calibration import Calibration
from fleetctl.model.startup import replacement_minutes, stay_bonus, warmup_seconds
from fleetctl.planner import adapters, explain, lora
from fleetctl.planner.candidates import (
    Candidate,
    NodeClass,
    candidates,
    model_goodput,
    node_classes,
    prune_dominated,
    request_shape,
)
from fleetctl.planner.diff import diff
from fleetctl.planner.expand import Placement, expand
from fleetctl.planner.optimize import Solution, demand, solve
from fleetctl.planner.queueing import traffic_of
from fleetctl.planner.roles import assign_roles


def plan_fleet(
    inv: Inventory,
    state: State | None = None,
    calibration: Calibration | None = None,
    objective: str | None = None,
    headroom: Mapping[str, float] | None = None,
) -> Plan:
    """The plan for `inv`, keeping what `state` runs where it is still a good answer; with
    `calibration`, live servers' measured KV and speed replace the model's where they match.
    `objective` ("throughput" or "cost", default the inventory's planner.objective): share
    spare GPUs out, or use the cheapest GPUs that meet every workload (times the model's
    `headroom`, where the simulator found its SLO missed: fleetctl/whatif/slo_check.py)."""
    state = state or State()
    objective = objective or inv.spec.planner.objective
    classes = node_classes(inv)
    feasible, rejected = _feasible(inv, classes, state, calibration, objective)
    current = _current_counts(feasible, classes, state)
    target = inv.spec.planner.target_utilization
    stay = [
        _stay(k, inv, calibration, objective) if n else 0.0
        for k, n in zip(feasible, current, strict=True)
    ]
    warn_below = inv.spec.planner.warn_sequences_below
    for _ in range(POOL_ROUNDS):
        sol = solve(
            classes, feasible, inv.models, target, current, warn_below, objective, headroom, stay
        )
        placements = expand(classes, feasible, sol.counts, sol.shapes, state.deployments)
        if objective != "cost":  # every GPU in use: the pooled figure only reports
            break
        scaled = _pooled(inv, feasible, placements)
        if scaled is None:
            break
        feasible = scaled
    used = list({id(p.cand): p.cand for p in placements}.values())
    servers = _servers(inv, feasible, placements, sol)
    deployments = _deployments(inv, state, placements, servers)
    # Prefill and decode pools where they serve more within the SLO (planner/disaggregate.py).
    prefilling = (d.key for d in state.deployments if d.server.role == "prefill")
    candidate_of = {id(servers[id(k)]): k for k in used}
    deployments, split = assign_roles(inv, deployments, candidate_of, prefilling)
    by_model: dict[str, list[Deployment]] = defaultdict(list)
    for d in deployments:
        by_model[d.model].append(d)
    counts: dict[int, int] = defaultdict(int)
    for p in placements:
        counts[id(p.cand)] += 1
    # A model with a derived SLO keeps the one its slowest candidate gives (planner/
    # candidates.py's planned_slo), printed and recorded as planned by, not re-derived from
    # the servers placed: placing again by that tighter SLO would leave out the slower
    # classes and tighten it again.
    planned_by = {k.model.name: k.slo for k in (*rejected, *feasible) if k.slo is not None}
    summaries = tuple(
        _summary(
            m,
            by_model[m.name],
            target,
            _bucket_uses(m, feasible, sol.bucket_shares, (headroom or {}).get(m.name, 1.0)),
            split.get(m.name),
            [(k, counts[id(k)]) for k in used if k.model is m],
            planned_by.get(m.name) or Slo.of(m.spec.slo),
        )
        for m in inv.models
    )
    warnings = explain.warnings(inv, deployments, summaries, classes, placements, objective)
    return Plan(
        inventory=str(inv.path),
        deployments=tuple(deployments),
        unplaced=_unplaced(inv, classes, feasible, rejected, by_model),
        warnings=tuple(_more_warnings(inv, by_model, used, sol.info, list(warnings))),
        actions=diff(deployments, state.deployments),
        models=summaries,
        state_serial=state.serial,
        solver=sol.info,
        objective=objective,
    )


# A candidate's capacity is its share of the goodput of as many such servers as its class
# holds; fewer pool less well. The cost objective, which runs few, solves again with each
# model's candidates scaled to what the servers it chose serve together, at most this often.
POOL_ROUNDS = 3


def _pooled(
    inv: Inventory, feasible: list[Candidate], placements: list[Placement]
) -> list[Candidate] | None:
    """The candidates with each model's capacity scaled to its placed servers' goodput over
    the sum of their per-server figures, where that falls short by over 1%; None if none."""
    counts: dict[int, int] = defaultdict(int)
    for p in placements:
        counts[id(p.cand)] += 1
    scale: dict[str, float] = {}
    for m in inv.models:
        placed = [(k, counts[id(k)]) for k in feasible if k.model is m and counts[id(k)]]
        pooled = model_goodput(m, placed)
        believed = sum(k.capacity_rps * n for k, n in placed)
        if pooled is not None and believed > 0 and pooled < 0.99 * believed:
            scale[m.name] = max(pooled, 0.01 * believed) / believed
    if not scale:
        return None
    return [
        dataclasses.replace(k, capacity_rps=k.capacity_rps * scale[k.model.name])
        if k.model.name in scale
        else k
        for k in feasible
    ]


def _feasible(
    inv: Inventory,
    classes: list[NodeClass],
    state: State,
    calibration: Calibration | None,
    objective: str,
) -> tuple[list[Candidate], list[Candidate]]:
    """The candidates the solver may choose from, and those rejected (for the explanation)."""
    feasible, rejected = candidates(inv, classes, calibration)
    if objective != "cost":  # length buckets are the cost objective's: the mean shape rules
        rejected += [k for k in feasible if not k.capacity_rps]
        feasible = [k for k in feasible if k.capacity_rps]
    if objective == "cost":  # only GPUs some model can use need a price
        _check_prices(inv, [c for c in classes if any(k.cls is c for k in feasible)])
    warn_below = inv.spec.planner.warn_sequences_below
    running = _current_counts(feasible, classes, state)
    feasible = prune_dominated(feasible, warn_below, {i for i, n in enumerate(running) if n})
    return feasible, rejected


def _servers(
    inv: Inventory, feasible: list[Candidate], placements: list[Placement], sol: Solution
) -> dict[int, Server]:
    """The servers of each candidate placed (by its id), with why they are there; with
    length buckets, each one's capacity for the requests it carries."""
    serving: dict[str, set[str]] = defaultdict(set)
    for p in placements:
        serving[p.cand.cls.gpu.name].add(p.cand.model.name)
    used = {id(p.cand): p.cand for p in placements}.values()
    mixes = {id(feasible[o]): f for o, f in sol.bucket_shares.items() if sol.counts[o]}
    servers = {
        id(k): _server(k, inv, tuple(explain.reasons(k, feasible, serving, mixes.get(id(k)))))
        for k in used
    }
    for k in used:  # with length buckets, a server's capacity for the requests it carries
        if id(k) in mixes:
            cap = _mix_capacity(k, mixes[id(k)])
            servers[id(k)] = dataclasses.replace(servers[id(k)], capacity_rps=cap)
    return servers


def _deployments(
    inv: Inventory, state: State, placements: list[Placement], servers: dict[int, Server]
) -> list[Deployment]:
    """Each placement on its node and port, in node order."""
    base = inv.spec.planner.port_base
    # A slot keeps the port it runs on: apply may have moved it to its surge port while
    # replacing a server without downtime, and the router already knows it there.
    ports = {
        d.key: d.port
        for d in state.deployments
        if abs(d.port - (base + d.gpu_indices[0])) in (0, SURGE_PORT_OFFSET)
    }
    return sorted(
        (
            Deployment(
                node.name,
                node.host,
                p.gpus,
                ports.get((node.name, p.gpus), base + p.gpus[0]),
                servers[id(p.cand)],
            )
            for p in placements
            for node in (p.cand.cls.nodes[p.node_index],)
        ),
        key=lambda d: (natural_key(d.node), d.gpu_indices),
    )


def _unplaced(
    inv: Inventory,
    classes: list[NodeClass],
    feasible: list[Candidate],
    rejected: list[Candidate],
    by_model: dict[str, list[Deployment]],
) -> tuple[Unplaced, ...]:
    """Models with no server though they need one, and models whose servers all run short
    of their max_context though a min_context was set: each with why."""
    return tuple(
        Unplaced(m.name, explain.why_unplaced(m, classes, feasible, rejected))
        for m in inv.models
        if not by_model[m.name] and m.spec.min_replicas > 0
    ) + tuple(
        Unplaced(m.name, explain.why_short(m, by_model[m.name]))
        for m in inv.models
        if m.spec.min_context is not None
        and by_model[m.name]
        and all(d.server.max_model_len < m.spec.max_context for d in by_model[m.name])
    )


def _more_warnings(
    inv: Inventory,
    by_model: dict[str, list[Deployment]],
    used: list[Candidate],
    solver: dict[str, Any],
    warnings: list[str],
) -> list[str]:
    """The explanation's warnings, after a model short of its min_replicas (served, not
    unplaced) and before which candidates' figures were measured; a solver that stopped
    early first of all."""
    warnings = [
        f"{m.name}: only {len(by_model[m.name])} of its min_replicas {m.spec.min_replicas} "
        "placed: the GPUs that fit it are taken or too few; add GPUs or lower min_replicas"
        for m in inv.models
        if 0 < len(by_model[m.name]) < m.spec.min_replicas
    ] + warnings
    # Say which candidates' figures were measured, not modelled, and from what.
    warnings += sorted(
        {
            f"{k.model.name} {k.variant.format.name} TP={k.tp} on {k.cls.gpu.name}: {k.calibrated}"
            for k in used
            if k.calibrated
        }
    )
    if solver.get("optimal") is False:
        warnings.insert(
            0,
            f"the placement solver stopped early ({solver['status']}): this plan is valid "
            "but may not be the best one",
        )
    return warnings


def _mix_capacity(k: Candidate, shares: tuple[float, ...]) -> float:
    """Requests/s one server of `k` carries at saturation of the mix of length buckets the
    planner gave it (`shares` of each bucket): those requests over the time they take, each
    bucket at its own capacity. Its mean-shape capacity where it carries none."""
    w = k.model.spec.workload
    if w is None or not k.bucket_capacity:
        return k.capacity_rps
    rates = [f * b.share for f, b in zip(shares, w.buckets, strict=True)]
    busy = sum(r / c for r, c in zip(rates, k.bucket_capacity, strict=True) if r > 0 and c > 0)
    return sum(rates) / busy if busy > 0 else k.capacity_rps


def _bucket_uses(
    m: Model, feasible: list[Candidate], shares: dict[int, tuple[float, ...]], headroom: float
) -> tuple[BucketUse, ...]:
    """Each length bucket of `m`'s workload, and the requests/s of it each GPU type, format
    and TP size was sized for (the workload's times `headroom`, what the solver was asked)."""
    w = m.spec.workload
    if w is None or not w.buckets or not any(feasible[o].model is m for o in shares):
        return ()
    out = []
    for b, bucket in enumerate(w.buckets):
        rate = bucket.share * w.requests_per_s
        by: dict[str, float] = defaultdict(float)
        for o, f in shares.items():
            k = feasible[o]
            if k.model is m and f[b] > 1e-6:
                by[f"{k.cls.gpu.name} {k.variant.format.name} TP={k.tp}"] += f[b] * rate * headroom
        out.append(
            BucketUse(
                bucket.mean_prompt_tokens,
                bucket.mean_output_tokens,
                bucket.max_tokens,
                rate,
                tuple(sorted(by.items(), key=lambda kv: -kv[1])),
            )
        )
    return tuple(out)


def _summary(
    m: Model,
    placed: list[Deployment],
    target: float,
    buckets: tuple[BucketUse, ...] = (),
    split: Disaggregation | None = None,
    cands: Sequence[tuple[Candidate, int]] = (),
    slo: Slo | None = None,
) -> ModelSummary:
    """Capacity against workload (with an SLO the goodput of the placed `cands`, candidate and
    count; without, saturation's; a split model's its pools' together), the price of its GPUs
    per output token, and its LoRA adapters (planner/adapters.py)."""
    capacity = sum(d.capacity_rps for d in placed)
    # Saturation only where no SLO is known: none stated, and no server to derive one from.
    basis = "saturation" if m.spec.slo is None else "goodput"
    if (within_slo := model_goodput(m, cands)) is not None:
        capacity, basis = within_slo, "goodput"
    if split is not None and split.chosen and split.split_rps is not None:
        capacity, basis = split.split_rps, "split"
    d = demand(m)
    served = capacity * target if d is None else min(d, capacity * target)
    short = None if d is None else max(0.0, d - capacity * target)
    if buckets:  # a bucket no server carries is short, whatever the others' capacity
        short = sum(max(0.0, b.requests_per_s - sum(r for _, r in b.served_by)) for b in buckets)
        short = 0.0 if short < 1e-6 * (d or 1.0) else short
        served = (d or 0.0) - short
    summary = ModelSummary(
        m.name,
        len(placed),
        sum(p.tensor_parallel_size for p in placed),
        capacity,
        d,
        short,
        total(p.server.cost_per_hour for p in placed),
        served * request_shape(m)[1],
        buckets,
        split,
        basis,
        traffic_of(m, request_shape(m)).assumed,
        slo,
    )
    return adapters.with_adapters(summary, m, cands)


def _stay(k: Candidate, inv: Inventory, calibration: Calibration | None, objective: str) -> float:
    """What keeping one replica of `k` where it runs is worth: the disruption its replacement
    would cause (its warm-up, measured or estimated, doubled where the old server stops
    first), in log-capacity units at planner.change_threshold per server-minute, or for the
    cost objective in price per hour, its GPU-hours paid back over planner.payback_hours."""
    spec = inv.spec.planner
    warmup = warmup_seconds(
        calibration,
        k.cls.gpu.name,
        k.model.profile.name,
        k.variant.format.name,
        k.tp,
        k.perf.weights,
        inv.spec.apply.vllm_version,
    )
    minutes = replacement_minutes(warmup, k.gpu_memory_utilization)
    if objective == "cost":
        price = k.cls.price_of(k.tp) or 0.0
        return price * minutes / 60 / spec.payback_hours
    return stay_bonus(warmup, k.gpu_memory_utilization, spec.change_threshold)


def _check_prices(inv: Inventory, classes: list[NodeClass]) -> None:
    """The cost objective needs every node's price: name the first node without one."""
    for c in classes:
        if c.cost_per_hour is None:
            node = c.nodes[0]
            where = None
            if inv.source is not None and node.line is not None:
                index = next(
                    (
                        i
                        for i, n in enumerate(inv.spec.nodes)
                        if inv.source.line_of(("nodes", i)) == node.line
                    ),
                    None,
                )
                if index is not None:
                    where = inv.source.at(("nodes", index))
            raise UserError(
                f"objective 'cost' needs a price for every node, and {node.name} "
                f"({c.gpu.name}) has none",
                where,
                "set cost_per_hour on its nodes entry, or a cost_per_hour default in the "
                f"{c.gpu.name} GPU profile (--profiles)",
            )


def _current_counts(feasible: list[Candidate], classes: list[NodeClass], state: State) -> list[int]:
    class_of = {node.name: c.index for c in classes for node in c.nodes}
    have: dict[tuple[int, str, str, int], int] = defaultdict(int)
    for d in state.deployments:
        if d.node in class_of:
            have[(class_of[d.node], d.model, d.variant, d.tensor_parallel_size)] += 1
    return [have.get((k.cls.index, *k.option), 0) for k in feasible]


def _server(k: Candidate, inv: Inventory, reasons: tuple[str, ...]) -> Server:
    """Everything about a candidate's servers that does not depend on the node."""
    model, variant, fmt = k.model, k.variant, k.variant.format
    pc = inv.spec.router.prefix_cache
    kv = KvEvents(pc.events_port_offset, pc.replay_port_offset, pc.topic) if pc.kv_events else None
    if kv is not None:
        replay = f", replay on +{kv.replay_offset}" if kv.replay_offset is not None else ""
        reasons = (
            *reasons,
            f"KV events on its port +{kv.events_offset}{replay} (topic '{kv.topic}'): "
            "route-serve's prefix index learns what it caches",
        )
    tail = [
        "--tensor-parallel-size",
        str(k.tp),
        "--max-model-len",
        str(k.max_model_len),
        "--gpu-memory-utilization",
        f"{k.gpu_memory_utilization:g}",
        "--dtype",
        fmt.vllm.dtype,
        "--kv-cache-dtype",
        model.spec.kv_cache_dtype,
        "--max-num-batched-tokens",
        str(k.max_num_batched_tokens),
        "--max-num-seqs",
        str(k.max_num_seqs),
    ]
    # Prefix caching is on by default in vLLM V1: the flag is pinned only where it matters
    # (off, or KV events that need it), so that upgrading fleetctl restarts no server.
    if not pc.enabled:
        tail.append("--no-enable-prefix-caching")
    elif pc.kv_events:
        tail.append("--enable-prefix-caching")
    quant = fmt.quantization_flag(k.cls.gpu, inv.spec.apply.vllm_version)
    if quant:
        tail += ["--quantization", quant]
    if variant.revision:
        tail += ["--revision", variant.revision]
    if inv.spec.planner.enforce_eager:
        tail.append("--enforce-eager")
    env = dict(model.spec.env)
    if inv.spec.planner.sleep_mode:
        tail.append("--enable-sleep-mode")
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM serves /sleep and /wake_up only in dev mode
        reasons = (
            *reasons,
            "sleep mode: the autopilot may sleep and wake it; its dev endpoints (/sleep, "
            "/wake_up, /collective_rpc) answer on its port, for route-serve and the autopilot "
            "alone",
        )
    tail, reasons = lora.server(model, k.cls.gpu.name, k.budget.lora, k.perf, tail, env, reasons)
    tail += model.spec.vllm_args
    return Server(
        model=model.name,
        variant=fmt.name,
        source=variant.source,
        gpu_type=k.cls.gpu.name,
        tensor_parallel_size=k.tp,
        max_model_len=k.max_model_len,
        gpu_memory_utilization=k.gpu_memory_utilization,
        kv_cache_dtype=model.spec.kv_cache_dtype,
        max_num_batched_tokens=k.max_num_batched_tokens,
        max_num_seqs=k.max_num_seqs,
        kv_budget_bytes=k.budget.kv_total,
        kv_budget_tokens=k.budget.kv_tokens,
        max_sequences_at_max_len=k.sequences_at_max_len,
        weights_bytes=k.perf.weights,
        predicted_decode_tok_s=k.decode_tok_s,
        capacity_rps=k.capacity_rps,
        reasons=reasons,
        args_head=("serve", variant.source, "--served-model-name", model.name),
        args_tail=tuple(tail),
        env=tuple(sorted(env.items())),
        max_model_len_reason=k.context_reason,
        kv_events=kv,
        # Every node of a class has the same price, so all of a candidate's servers do.
        cost_per_hour=k.cls.price_of(k.tp),
        perf=k.engine.figures() if k.engine is not None else None,
    )
