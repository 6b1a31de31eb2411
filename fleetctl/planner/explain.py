"""The planner's explanation text: why each server is where it is, why a model is not
placed or runs short of its max_context, and the warnings a plan carries."""

from __future__ import annotations

from collections import defaultdict

from fleetctl.base.limits import SURGE_PORT_OFFSET
from fleetctl.base.names import natural_key
from fleetctl.base.text import plural, rate
from fleetctl.fleet.inventory import Inventory, Model
from fleetctl.fleet.plan import (
    Deployment,
    ModelSummary,
)
from fleetctl.model.perf import GB
from fleetctl.planner.candidates import (
    Candidate,
    NodeClass,
    fits,
    request_shape,
    slo_miss,
    tp_sizes,
    why_not,
)
from fleetctl.planner.expand import Placement
from fleetctl.planner.queueing import traffic_of


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def reasons(
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
    if k.budget_reason:
        out.append(f"max_num_batched_tokens {k.budget_reason}")
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
    basis = "at saturation"
    if k.slo is not None:
        prompt, output = request_shape(m)
        full = k.perf.capacity_rps(
            prompt, output, k.budget.kv_tokens, k.max_num_seqs, k.max_num_batched_tokens
        )
        traffic = traffic_of(m, (prompt, output))
        on = (
            "the workload's length quantiles" if not traffic.assumed else "; ".join(traffic.assumed)
        )
        out.append(
            f"slo: {k.capacity_rps:.2f} req/s a server within it ({k.slo.share * 100:.4g}% "
            f"of requests within both objectives, {k.slo.text()} ({k.slo.source}); {on}; "
            f"burstiness {traffic.burstiness:.3g}), not {full:.2f} at saturation"
        )
        basis = "within the SLO"
    per_gpu_rps = k.capacity_rps / k.tp
    out.append(
        f"on {gpu.name}: {per_gpu_rps:.2f} req/s per GPU {basis}, "
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


def why_unplaced(
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


def why_short(m: Model, placed: list[Deployment]) -> str:
    """Why a model with min_context got servers but none at its max_context."""
    longest = max(d.server.max_model_len for d in placed)
    return (
        f"no {m.name} server reaches max_context {m.spec.max_context} (the longest placed "
        f"runs {longest}): the GPUs that hold it are taken by models with a better claim; "
        "add GPUs that hold max_context or lower other models' min_replicas"
    )


def warnings(
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
                f"{rate(s.demand_rps)} req/s workload; add GPUs or lower the workload"
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
    out += _kv_transfer_warnings(deployments)
    return out


def _kv_transfer_warnings(deployments: list[Deployment]) -> list[str]:
    """What a split model's KV transfer exposes on the network or the disk."""
    moved = [d.server.kv_transfer for d in deployments if d.server.kv_transfer is not None]
    if not moved:
        return []
    kv = moved[0]
    if kv.side_channel_offset is not None:
        return [
            f"KV transfer: each prefill and decode server's NIXL side channel listens on its "
            f"node's address at its port + {kv.side_channel_offset}, and KV caches cross the "
            "network over UCX: neither is authenticated or encrypted, so a peer that reaches "
            "them can read prompts' KV caches; keep those nodes on a trusted network and "
            "firewall the ports from everyone else"
        ]
    return [
        f"KV transfer: {kv.connector} keeps every prompt's KV cache as plain files in "
        f"{kv.shared_storage_path or '/tmp'}, readable by whoever reads that folder, and never "
        "deletes them: give it a private folder with room, and clean it"
    ]


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
