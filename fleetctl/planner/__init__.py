"""Planning: which model, format and TP size runs on which GPUs, explained, and its diff."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping

from fleetctl.base.errors import UserError
from fleetctl.base.limits import SURGE_PORT_OFFSET
from fleetctl.base.names import natural_key
from fleetctl.base.text import plural
from fleetctl.fleet.inventory import Inventory, Model
from fleetctl.fleet.plan import (
    BucketUse,
    Deployment,
    KvEvents,
    ModelSummary,
    Plan,
    Server,
    Unplaced,
)
from fleetctl.fleet.prices import total
from fleetctl.fleet.state import State
from fleetctl.model.calibration import Calibration
from fleetctl.model.perf import GB
from fleetctl.model.startup import replacement_minutes, stay_bonus, warmup_seconds
from fleetctl.planner.candidates import (
    Candidate,
    NodeClass,
    candidates,
    fits,
    node_classes,
    prune_dominated,
    request_shape,
    slo_miss,
    tp_sizes,
    why_not,
)
from fleetctl.planner.diff import diff
from fleetctl.planner.expand import Placement, expand
from fleetctl.planner.optimize import demand, solve

__all__ = ["plan_fleet"]


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
    feasible, rejected = candidates(inv, classes, calibration)
    if objective != "cost":  # length buckets are the cost objective's: the mean shape rules
        rejected += [k for k in feasible if not k.capacity_rps]
        feasible = [k for k in feasible if k.capacity_rps]
    if objective == "cost":  # only GPUs some model can use need a price
        _check_prices(inv, [c for c in classes if any(k.cls is c for k in feasible)])
    warn_below = inv.spec.planner.warn_sequences_below
    running = _current_counts(feasible, classes, state)
    feasible = prune_dominated(feasible, warn_below, {i for i, n in enumerate(running) if n})
    current = _current_counts(feasible, classes, state)
    target = inv.spec.planner.target_utilization
    stay = [
        _stay(k, inv, calibration, objective) if n else 0.0
        for k, n in zip(feasible, current, strict=True)
    ]
    sol = solve(
        classes, feasible, inv.models, target, current, warn_below, objective, headroom, stay
    )
    placements = expand(classes, feasible, sol.counts, sol.shapes, state.deployments)
    serving: dict[str, set[str]] = defaultdict(set)
    for p in placements:
        serving[p.cand.cls.gpu.name].add(p.cand.model.name)
    used = {id(p.cand): p.cand for p in placements}.values()
    mixes = {id(feasible[o]): f for o, f in sol.bucket_shares.items() if sol.counts[o]}
    servers = {
        id(k): _server(k, inv, tuple(_reasons(k, feasible, serving, mixes.get(id(k)))))
        for k in used
    }
    for k in used:  # with length buckets, a server's capacity for the requests it carries
        if id(k) in mixes:
            cap = _mix_capacity(k, mixes[id(k)])
            servers[id(k)] = dataclasses.replace(servers[id(k)], capacity_rps=cap)
    base = inv.spec.planner.port_base
    # A slot keeps the port it runs on: apply may have moved it to its surge port while
    # replacing a server without downtime, and the router already knows it there.
    ports = {
        d.key: d.port
        for d in state.deployments
        if abs(d.port - (base + d.gpu_indices[0])) in (0, SURGE_PORT_OFFSET)
    }
    deployments = sorted(
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
    by_model: dict[str, list[Deployment]] = defaultdict(list)
    for d in deployments:
        by_model[d.model].append(d)
    unplaced = tuple(
        Unplaced(m.name, _why_unplaced(m, classes, feasible, rejected))
        for m in inv.models
        if not by_model[m.name] and m.spec.min_replicas > 0
    ) + tuple(
        Unplaced(m.name, _why_short(m, by_model[m.name]))
        for m in inv.models
        if m.spec.min_context is not None
        and by_model[m.name]
        and all(d.server.max_model_len < m.spec.max_context for d in by_model[m.name])
    )
    summaries = tuple(
        _summary(
            m,
            by_model[m.name],
            target,
            _bucket_uses(m, feasible, sol.bucket_shares, (headroom or {}).get(m.name, 1.0)),
        )
        for m in inv.models
    )
    warnings = _warnings(inv, deployments, summaries, classes, placements, objective)
    # A model with some servers but fewer than min_replicas is served, not unplaced: say so.
    warnings = [
        f"{m.name}: only {len(by_model[m.name])} of its min_replicas {m.spec.min_replicas} "
        "placed: the GPUs that fit it are taken or too few; add GPUs or lower min_replicas"
        for m in inv.models
        if 0 < len(by_model[m.name]) < m.spec.min_replicas
    ] + list(warnings)
    # Say which candidates' figures were measured, not modelled, and from what.
    warnings += sorted(
        {
            f"{k.model.name} {k.variant.format.name} TP={k.tp} on {k.cls.gpu.name}: {k.calibrated}"
            for k in used
            if k.calibrated
        }
    )
    if sol.info.get("optimal") is False:
        warnings.insert(
            0,
            f"the placement solver stopped early ({sol.info['status']}): this plan is valid "
            "but may not be the best one",
        )
    return Plan(
        inventory=str(inv.path),
        deployments=tuple(deployments),
        unplaced=unplaced,
        warnings=tuple(warnings),
        actions=diff(deployments, state.deployments),
        models=summaries,
        state_serial=state.serial,
        solver=sol.info,
        objective=objective,
    )


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
    m: Model, placed: list[Deployment], target: float, buckets: tuple[BucketUse, ...] = ()
) -> ModelSummary:
    """Capacity against workload, and the price of a model's GPUs per output token."""
    capacity = sum(d.capacity_rps for d in placed)
    d = demand(m)
    served = capacity * target if d is None else min(d, capacity * target)
    short = None if d is None else max(0.0, d - capacity * target)
    if buckets:  # a bucket no server carries is short, whatever the others' capacity
        short = sum(max(0.0, b.requests_per_s - sum(r for _, r in b.served_by)) for b in buckets)
        short = 0.0 if short < 1e-6 * (d or 1.0) else short
        served = (d or 0.0) - short
    return ModelSummary(
        m.name,
        len(placed),
        sum(p.tensor_parallel_size for p in placed),
        capacity,
        d,
        short,
        total(p.server.cost_per_hour for p in placed),
        served * request_shape(m)[1],
        buckets,
    )


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
        env=tuple(sorted(model.spec.env.items())),
        max_model_len_reason=k.context_reason,
        kv_events=kv,
        # Every node of a class has the same price, so all of a candidate's servers do.
        cost_per_hour=k.cls.price_of(k.tp),
        perf=k.engine.figures() if k.engine is not None else None,
    )


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def _reasons(
    k: Candidate,
    feasible: list[Candidate],
    serving: dict[str, set[str]],
    mix: tuple[float, ...] | None = None,
) -> list[str]:
    """Why this class, this format and this TP, in numbers; `mix`: the share of each of the
    model's length buckets its servers carry (objective cost with buckets)."""
    m, fmt, gpu = k.model, k.variant.format, k.cls.gpu
    out = []
    w = m.spec.workload
    if mix is not None and w is not None:
        carried = [
            f"{b.mean_prompt_tokens}/{b.mean_output_tokens} {f:.0%}"
            for f, b in zip(mix, w.buckets, strict=True)
            if f > 1e-6
        ]
        out.append(
            "length buckets (mean prompt/output tokens) these servers carry: "
            + (", ".join(carried) or "none (a minimum replica)")
        )
        too_long = [
            f"{b.mean_prompt_tokens}/{b.mean_output_tokens}"
            for b in w.buckets
            if b.max_tokens > k.max_model_len
        ]
        if too_long:
            out.append(
                f"not {', '.join(too_long)}: requests longer than max_model_len {k.max_model_len}"
            )
    if k.tp == 1:
        out.append(
            f"TP=1: {_gb(k.perf.weights)} of weights fit one {gpu.memory_mib / 1024:.0f} GiB "
            f"{gpu.name}"
        )
    else:
        out.append(
            f"TP={k.tp}: {_gb(k.perf.weights)} of weights, {_gb(k.budget.weights)} per GPU "
            f"across {k.tp} {gpu.name} over {gpu.interconnect}"
        )
    out.append(
        f"KV budget {_gb(k.budget.kv_total)} = {k.budget.kv_tokens:,} tokens: "
        f"{k.sequences_at_max_len} sequences at max_model_len {k.max_model_len}"
    )
    if m.spec.min_context is not None:
        out.append(f"max_model_len {k.context_reason}")
    if k.calibrated:
        out.append(k.calibrated)
    if len(m.variants) > 1:
        others = [v.format.name for v in m.variants if v.format.name != fmt.name]
        out.append(
            f"{fmt.name} over {', '.join(others)}: {_gb(k.perf.weights)} of weights, "
            f"kernel efficiency "
            f"{fmt.kernel_efficiency_on(gpu.architecture, k.perf.vllm_version):.2f} "
            f"on {gpu.architecture}"
        )
    if m.spec.slo is not None:
        prompt, output = request_shape(m)
        full = k.perf.capacity_rps(prompt, output, k.budget.kv_tokens, k.max_num_seqs)
        if k.capacity_rps < full:
            out.append(
                f"slo: {k.capacity_rps:.2f} req/s, not {full:.2f} at saturation: the batch is "
                "capped where a decode step stays within half of tpot_p99_ms"
            )
    per_gpu_rps = k.capacity_rps / k.tp
    out.append(
        f"on {gpu.name}: {per_gpu_rps:.2f} req/s per GPU at saturation, "
        f"single-request decode {k.decode_tok_s:.0f} tok/s ({k.perf.bound_regime(1)}-bound)"
    )
    best_elsewhere: dict[str, Candidate] = {}
    for other in feasible:
        if other.model is m and other.cls.gpu.name != gpu.name:
            prev = best_elsewhere.get(other.cls.gpu.name)
            if prev is None or other.capacity_rps / other.tp > prev.capacity_rps / prev.tp:
                best_elsewhere[other.cls.gpu.name] = other
    if not best_elsewhere:
        out.append(f"{gpu.name} is the only GPU type that fits it")
    for name, other in sorted(best_elsewhere.items()):
        there = other.capacity_rps / other.tp
        at_len = "" if other.max_model_len == k.max_model_len else f" {other.max_model_len}"
        text = (
            f"vs {name}: {there:.2f} req/s per GPU there ({other.variant.format.name}, "
            f"TP={other.tp}, {other.sequences_at_max_len} sequences at max_model_len{at_len})"
        )
        busy = sorted(serving.get(name, set()) - {m.name})
        if there > per_gpu_rps and busy:
            text += f"; its GPUs serve {', '.join(busy)}, which gain more there"
        out.append(text)
    return out


def _why_unplaced(
    m: Model, classes: list[NodeClass], feasible: list[Candidate], rejected: list[Candidate]
) -> str:
    """The most useful single reason a model got no GPUs."""
    if any(k.model is m for k in feasible):
        return (
            "every GPU that fits it is taken by models with a better claim: "
            "add GPUs or lower other models' min_replicas"
        )
    mine = [k for k in rejected if k.model is m]
    missed = [(k, slo_miss(k)) for k in mine if k.sequences_at_max_len >= m.spec.min_sequences]
    missed = [(k, why) for k, why in missed if why]
    if missed and len(missed) == len([k for k in mine if k.sequences_at_max_len]):
        k, why = min(missed, key=lambda kw: kw[0].perf.step_time(1, 1024))
        return (
            f"no GPU class meets {m.name}'s slo: on the fastest, {k.cls.label} "
            f"({k.variant.format.name}, TP={k.tp}), {why}; relax the slo or add faster GPUs"
        )
    short = [k for k in mine if fits(k)]  # min_context: they fit, but none reaches max_context
    if short:
        best = max(short, key=lambda k: (k.max_model_len, -k.tp))
        return (
            f"{m.name} must serve max_context {m.spec.max_context} on some server, but no "
            f"GPU class holds {plural(m.spec.min_sequences, 'sequence')} of it: the longest "
            f"is {best.max_model_len} on {best.cls.label} ({best.variant.format.name}, "
            f"TP={best.tp}); lower max_context to {best.max_model_len} or add a "
            f"larger-memory class"
        )
    if not mine:
        blockers = [
            why_not(c, m, v, next(iter(tp_sizes(m, c.gpu_count)), None))
            for c in classes
            for v in m.variants
        ]
        text = "; ".join(sorted({b for b in blockers if b}))
        return f"no node can run it: {text}" if text else "no node can run it"
    best = max(mine, key=lambda k: (k.budget.kv_per_gpu * k.tp, -k.tp))
    fmt = best.variant.format.name
    # With min_context, the shortest length a server may run is what did not fit.
    length, field = (
        (m.spec.max_context, "max_context")
        if m.spec.min_context is None
        else (m.spec.min_context, "min_context")
    )
    need_kv = m.spec.min_sequences * length * best.perf.kv_token_bytes * best.tp
    if best.budget.kv_per_gpu <= 0:
        largest = max(c.gpu_count for c in classes if c.gpu is best.cls.gpu)
        return (
            f"{m.name} {fmt} needs {_gb(best.perf.weights)} of weights plus runtime reserve; "
            f"the best fit, {largest}x {best.cls.gpu.name} at TP={best.tp}, can give weights "
            f"{_gb(best.budget.usable * best.tp - best.budget.reserve * best.tp)}: "
            f"no node has enough GPU memory"
        )
    return (
        f"{m.name} {fmt} fits its weights on {best.cls.label} at TP={best.tp} but leaves "
        f"{_gb(best.budget.kv_total)} of KV cache; "
        f"{plural(m.spec.min_sequences, 'sequence')} of {length} tokens need "
        f"{_gb(need_kv)}: lower {field} or add memory"
    )


def _why_short(m: Model, placed: list[Deployment]) -> str:
    """Why a model with min_context got servers but none at its max_context."""
    longest = max(d.server.max_model_len for d in placed)
    return (
        f"no {m.name} server reaches max_context {m.spec.max_context} (the longest placed "
        f"runs {longest}): the GPUs that hold it are taken by models with a better claim; "
        "add GPUs that hold max_context or lower other models' min_replicas"
    )


def _warnings(
    inv: Inventory,
    deployments: list[Deployment],
    summaries: tuple[ModelSummary, ...],
    classes: list[NodeClass],
    placements: list[Placement],
    objective: str = "throughput",
) -> list[str]:
    out = []
    target = inv.spec.planner.target_utilization
    for s in summaries:
        for b in s.buckets:
            planned = sum(r for _, r in b.served_by)
            if planned < b.requests_per_s * (1 - 1e-6):
                out.append(
                    f"{s.model}: {b.requests_per_s - planned:.2f} of the {b.requests_per_s:.2f} "
                    f"req/s of its requests of about {b.mean_prompt_tokens} prompt and "
                    f"{b.mean_output_tokens} output tokens (up to {b.max_tokens}) have no "
                    "capacity planned: no GPU class carries them within the SLO and "
                    "max_model_len, or the fleet has no more such GPUs"
                )
        if s.buckets:
            continue
        if s.demand_rps and s.replicas and s.capacity_rps * target < s.demand_rps:
            share = s.capacity_rps * target / s.demand_rps
            out.append(
                f"{s.model}: planned capacity {s.capacity_rps * target:.1f} req/s "
                f"(at {target:.0%} utilization) covers {share:.0%} of the "
                f"{s.demand_rps:g} req/s workload; add GPUs or lower the workload"
            )
    low = inv.spec.planner.warn_sequences_below
    groups: dict[tuple[str, str, str, int, int], list[str]] = defaultdict(list)
    for d in deployments:
        srv = d.server
        if srv.max_sequences_at_max_len < low:
            key = (d.model, d.variant, d.gpu_type, srv.max_sequences_at_max_len, srv.max_model_len)
            groups[key].append(d.node)
    for (model, variant, gpu, seqs, max_len), nodes in sorted(groups.items()):
        # A length below max_context (min_context) is already the longest the KV cache holds.
        fix = (
            "lower max_context"
            if max_len >= inv.model(model).spec.max_context
            else "raise min_sequences (a shorter max_model_len, more sequences)"
        )
        out.append(
            f"{model} {variant} on {gpu} ({_node_list(nodes)}): the KV cache holds only "
            f"{plural(seqs, 'sequence')} of {max_len} tokens; the weights fit but long prompts "
            f"will queue or be preempted: {fix} or use a larger-memory class"
        )
    used: dict[int, int] = defaultdict(int)
    for p in placements:
        used[p.cand.cls.index] += p.cand.tp
    for c in classes:
        idle = c.size * c.gpu_count - used[c.index]
        if idle and inv.models:
            met = not any(x.shortfall_rps for x in summaries)
            why = (
                "the workloads are met without them (objective cost)"
                if objective == "cost" and met and all(x.replicas for x in summaries)
                else "no model benefits from them"
            )
            out.append(f"{plural(idle, c.gpu.name + ' GPU')} left idle: {why}")
    out += _kv_event_warnings(inv, deployments)
    return out


def _kv_event_warnings(inv: Inventory, deployments: list[Deployment]) -> list[str]:
    """What KV events expose, and settings that keep route-serve from naming the blocks."""
    pc = inv.spec.router.prefix_cache
    if not pc.kv_events or not deployments:
        return []
    base = inv.spec.planner.port_base
    top = max(n.gpu_count for n in inv.nodes) - 1
    ports = [(pc.events_port_offset, "events")]
    if pc.replay_port_offset is not None:
        ports.append((pc.replay_port_offset, "replay"))

    def span(first: int) -> str:
        return str(first) if not top else f"{first}-{first + top}"

    spans = ", ".join(
        f"{span(base + off)} and {span(base + off + SURGE_PORT_OFFSET)} ({what})"
        for off, what in ports
    )
    out = [
        "KV events: every server publishes its prompts' token ids in cleartext, unauthenticated, "
        f"on TCP ports {spans} of every interface (vLLM binds them on *): let only the "
        "route-serve hosts reach them (firewall), or turn router.prefix_cache.kv_events off"
    ]
    for m in inv.models:
        algo = _flag_value(m.spec.vllm_args, "--prefix-caching-hash-algo") or "sha256"
        if algo != "sha256":
            out.append(
                f"{m.name}: --prefix-caching-hash-algo {algo}: route-serve names prompts' "
                "blocks as sha256 does and will find none of its cached prefixes: keep the "
                "default sha256"
            )
        if "PYTHONHASHSEED" in m.spec.env:
            out.append(
                f"{m.name}: PYTHONHASHSEED in env changes vLLM's block hashes; route-serve "
                "hashes prompts without it and will find no cached prefix: remove it"
            )
    return out


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value `args` give `flag` (as --flag V, --flag=V, or with underscores), the last."""
    found = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name.startswith("--") and "--" + name[2:].replace("_", "-") == flag:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def _node_list(nodes: list[str]) -> str:
    nodes = sorted(nodes, key=natural_key)
    return ", ".join(nodes) if len(nodes) <= 4 else f"{nodes[0]} .. {nodes[-1]}, {len(nodes)} nodes"
