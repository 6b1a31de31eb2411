"""Rich renderables for plans and profiles; commands print them, nothing here prints.

Kept whole because the tables share their column rules and widths, so the commands' output reads
alike.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.text import Text

from fleetctl.base.names import natural_key
from fleetctl.base.tables import Cell, Col, Records
from fleetctl.base.text import plural, rate
from fleetctl.fleet.plan import Action, Deployment, Plan

if TYPE_CHECKING:
    from fleetctl.apply.status import ServerStatus
    from fleetctl.fleet.facts import Facts
    from fleetctl.fleet.health import Check
    from fleetctl.model.calibration import Figure, ServerReading
    from fleetctl.model.catalog import Catalog
    from fleetctl.model.estimate import Estimate, Fit

OP_STYLE = {"create": "green", "replace": "yellow", "delete": "red", "keep": "dim"}
OP_MARK = {"create": "+", "replace": "~", "delete": "-", "keep": " "}
_NUMBERED = re.compile(r"(.*?)(\d+)(\D*)")


def compress_names(names: Iterable[str]) -> str:
    """rtx-1 .. rtx-8 -> `rtx-[1:8]`: the inventory's own range syntax, runs kept apart."""
    by_prefix: dict[tuple[str, str], list[int]] = defaultdict(list)
    plain: list[str] = []
    for name in names:
        m = _NUMBERED.fullmatch(name)
        if m and not m.group(2).startswith("0"):
            by_prefix[(m.group(1), m.group(3))].append(int(m.group(2)))
        else:
            plain.append(name)
    parts: list[tuple[tuple[object, ...], str]] = [(natural_key(p), p) for p in plain]
    for (pre, post), nums in by_prefix.items():
        nums.sort()
        start = prev = nums[0]
        for n in [*nums[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            text = f"{pre}{start}{post}" if start == prev else f"{pre}[{start}:{prev}]{post}"
            parts.append((natural_key(f"{pre}{start}{post}"), text))
            if n is not None:
                start = prev = n
    return ", ".join(text for _, text in sorted(parts))


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def plan_table(plan: Plan) -> Records:
    """One row per group of nodes that get the same deployment and action."""
    ops = {(a.node, a.gpu_indices): a.op for a in plan.actions}
    # Replicas of one planned server share its Server object. Group nodes by (action, GPUs,
    # server), then merge groups whose nodes are the same: "rtx-[1:8] GPUs 0-7" is one row.
    by_slot: dict[tuple[str, tuple[int, ...], int], tuple[Deployment, list[str]]] = {}
    for d in plan.deployments:
        slot = (ops[d.key], d.gpu_indices, id(d.server))
        by_slot.setdefault(slot, (d, []))[1].append(d.node)
    rows_by: dict[tuple[str, int, tuple[str, ...]], tuple[Deployment, list[tuple[int, ...]]]] = {}
    for (kind, gpus, server), (d, names) in by_slot.items():
        rows_by.setdefault((kind, server, tuple(names)), (d, []))[1].append(gpus)
    deletes: dict[tuple[tuple[int, ...], str, str], list[str]] = defaultdict(list)
    for a in plan.actions:
        if a.op == "delete":
            deletes[(a.gpu_indices, a.model, a.variant)].append(a.node)

    rows: list[list[Cell]] = []
    # A role column only where some model is split into prefill and decode servers.
    split = any(d.server.role != "both" for d in plan.deployments)
    ordered = sorted(rows_by.items(), key=lambda r: (natural_key(r[0][2][0]), r[1][1][0]))
    for (kind, _, node_names), (d, slots) in ordered:
        style = OP_STYLE[kind]
        rows.append(
            [
                Text(f"{OP_MARK[kind]} {compress_names(node_names)}", style=style),
                f"{_slots(slots)} {d.gpu_type}",
                d.model,
                d.variant,
                *([d.server.role] if split else []),
                str(d.tensor_parallel_size),
                str(d.server.max_model_len),
                f"{d.server.kv_budget_tokens:,}",
                str(d.server.max_sequences_at_max_len),
                f"{d.server.predicted_decode_tok_s:.0f}",
                f"{d.capacity_rps:.2f}",
            ]
        )
    for (gpus, model, variant), nodes in sorted(deletes.items(), key=lambda kv: str(kv[0])):
        rows.append(
            [
                Text(f"- {compress_names(nodes)}", style="red"),
                ",".join(map(str, gpus)),
                str(model),
                str(variant),
                *[""] * (7 if split else 6),
            ]
        )
    columns = [*PLAN_COLUMNS[:4], Col("role", head=True), *PLAN_COLUMNS[4:]]
    return Records("Plan", columns if split else PLAN_COLUMNS, rows)


PLAN_COLUMNS = [
    Col("  node", head=True),  # the action's mark, then the nodes
    Col("GPUs"),
    Col("model", head=True),
    Col("format", head=True),
    Col("TP", numeric=True),
    Col("max\nlen", numeric=True),
    Col("KV\ntokens", numeric=True),
    Col("seqs\n@max", numeric=True),
    Col("tok/s", numeric=True),
    Col("req/s", numeric=True),
]


def _slots(slots: list[tuple[int, ...]]) -> str:
    """GPU slots of one row: `0-7` for eight 1-GPU servers, `0,1 2,3` for two TP=2 ones."""
    slots = sorted(slots)
    if all(len(s) == 1 for s in slots) and len(slots) > 1:
        first, last = slots[0][0], slots[-1][0]
        if last - first + 1 == len(slots):
            return f"{first}-{last}"
    return " ".join(",".join(map(str, s)) for s in slots)


def model_table(plan: Plan, replayed: Mapping[str, float] | None = None) -> Records:
    """Capacity against workload per model; with prices, what its GPUs cost per hour and per
    million output tokens (fleetctl/fleet/prices.py), and a total row. `replayed`: each
    model's goodput rate as the simulator found it on the traffic (sim/capacity.py), shown
    as its capacity beside the planner's analytic figure."""
    replayed = replayed or {}
    cols = [
        Col("model", head=True),
        Col("replicas", numeric=True),
        Col("GPUs", numeric=True),
        Col("capacity\nreq/s", numeric=True),
        *([Col("analytic\nreq/s", numeric=True)] if replayed else []),
        Col("workload\nreq/s", numeric=True),
    ]
    short = any(s.shortfall_rps for s in plan.models)
    priced = any(s.cost_per_hour is not None for s in plan.models if s.replicas)
    if short:
        cols.append(Col("short\nreq/s", numeric=True))
    if priced:
        cols += [Col("cost\n/hour", numeric=True), Col("cost /M\nout tok", numeric=True)]
    rows: list[list[Cell]] = []
    for s in plan.models:
        row: list[Cell] = [
            s.model,
            str(s.replicas),
            str(s.gpus),
            *(
                [_replayed(replayed.get(s.model)), f"{s.capacity_rps:.2f}"]
                if replayed
                else [f"{s.capacity_rps:.2f}"]
            ),
            rate(s.demand_rps) if s.demand_rps else "-",
        ]
        if short:
            row.append(f"{s.shortfall_rps:.2f}" if s.shortfall_rps else "-")
        if priced:
            row += [_money(s.cost_per_hour), _money(s.cost_per_million_output_tokens)]
        rows.append(row)
    if priced and len(plan.models) > 1:
        row = ["total", str(sum(s.replicas for s in plan.models))]
        row += [str(sum(s.gpus for s in plan.models)), "", ""] + [""] * (short + bool(replayed))
        row += [_money(plan.cost_per_hour), _money(plan.cost_per_million_output_tokens)]
        rows.append(row)
    return Records("Capacity", cols, rows, caption=_capacity_basis(plan))


def _capacity_basis(plan: Plan) -> str | None:
    """What the capacity column is, per kind of figure in it (planner/queueing.py)."""
    said = {
        "goodput": "goodput: the rate at which 99% of requests meet the SLO, on the "
        "workload's lengths and bursts",
        "saturation": "saturation: the mean request's throughput (no SLO)",
        "split": "prefill and decode pools' rate within the SLO",
    }
    parts = []
    for basis in ("goodput", "saturation", "split"):
        names = [s.model for s in plan.models if s.capacity_basis == basis and s.replicas]
        if names:
            assumed = sorted({a for s in plan.models if s.model in names for a in s.assumed})
            note = f" (assumed: {', '.join(assumed)})" if assumed and basis == "goodput" else ""
            parts.append(f"{said[basis]}{note}: {', '.join(names)}")
    return "; ".join(parts) or None


def _replayed(goodput: float | None) -> str:
    return "-" if goodput is None else f"{goodput:.2f}"


def _money(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x >= 0.1 else f"{x:.4f}"


def summary_line(actions: Iterable[Action]) -> Text:
    counts = dict.fromkeys(("create", "replace", "delete", "keep"), 0)
    for a in actions:
        counts[a.op] += 1
    return Text.assemble(
        ("Plan: ", "bold"),
        (f"{counts['create']} to create", "green"),
        ", ",
        (f"{counts['replace']} to replace", "yellow"),
        ", ",
        (f"{counts['delete']} to delete", "red"),
        f", {counts['keep']} unchanged.",
    )


def context_lines(plan: Plan) -> list[str]:
    """Why each length, for models whose servers run lengths below max_context (min_context):
    one line per model, GPU type, format and TP size."""
    shortened = {
        d.model
        for d in plan.deployments
        if d.server.max_model_len_reason and not _at_max(d.server.max_model_len_reason)
    }
    out: dict[tuple[object, ...], str] = {}
    for d in plan.deployments:
        if d.model in shortened:
            key = (d.model, d.gpu_type, d.variant, d.tensor_parallel_size)
            out.setdefault(
                key,
                f"{d.model} on {d.gpu_type} ({d.variant}, TP={d.tensor_parallel_size}): "
                f"max_model_len {d.server.max_model_len_reason}",
            )
    return [out[k] for k in sorted(out, key=str)]


def adapter_lines(plan: Plan) -> list[str]:
    """Each LoRA adapter: where it loads at start, its demand and its capacity at its SLO."""
    out = []
    for m in plan.models:
        for a in m.adapters:
            pinned = f", pinned to {', '.join(a.gpu_types)}" if a.gpu_types else ""
            demand = f", {a.demand_rps:g} req/s asked" if a.demand_rps is not None else ""
            cap = (
                f"; {a.capacity_rps:.2f} req/s within its SLO ({a.capacity_basis})"
                if a.capacity_rps is not None
                else ""
            )
            out.append(
                f"adapter {a.name} of {m.model} (rank {a.rank}{pinned}): loaded at start on "
                f"{plural(a.servers, 'server')}{demand}{cap}"
            )
    return out


def _at_max(reason: str) -> bool:
    return reason.endswith("= max_context")


def render_plan(
    plan: Plan, explain: bool = False, replayed: Mapping[str, float] | None = None
) -> RenderableType:
    parts: list[RenderableType] = [plan_table(plan), model_table(plan, replayed)]
    if not explain:  # --explain lists the same among each deployment's reasons
        parts.extend(Text(line) for line in context_lines(plan))
    parts.extend(Text(line) for line in split_lines(plan, explain))
    if explain:
        seen = set()
        for d in plan.deployments:
            key = (d.gpu_type, d.model, d.variant, d.tensor_parallel_size, d.server.role)
            if key in seen:
                continue
            seen.add(key)
            role = "" if d.server.role == "both" else f" ({d.server.role})"
            parts.append(
                Text(
                    f"{d.model} {d.variant} TP={d.tensor_parallel_size} on {d.gpu_type}{role}:",
                    style="bold",
                )
            )
            parts.extend(Text(f"  - {r}") for r in d.server.reasons)
        parts.extend(Text(line) for line in adapter_lines(plan))
    replaced: dict[tuple[str, str], list[str]] = defaultdict(list)
    for a in plan.actions:
        if a.op == "replace":
            replaced[(a.model, a.detail)].append(a.node)
    for (model, detail), nodes in sorted(replaced.items()):
        parts.append(Text(f"~ {model} on {compress_names(nodes)}: {detail}", style="yellow"))
    for u in plan.unplaced:
        parts.append(Text(f"unplaced: {u.model}: {u.reason}", style="red"))
    for w in plan.warnings:
        if _is_calibration_note(w):  # measured figures used: worth knowing, nothing wrong
            parts.append(Text(f"note: {w}"))
        else:
            parts.append(Text(f"warning: {w}", style="yellow"))
    line = cost_line(plan)
    if line:
        parts.append(Text(line))
    parts.append(summary_line(plan.actions))
    return Group(*parts)


def _is_calibration_note(warning: str) -> bool:
    """The plan's line saying whose figures were measured (fleetctl/planner/place.py:
    `MODEL FORMAT TP=N on GPU: calibrated from ...`), which JSON keeps among its warnings."""
    return ": calibrated from " in warning


def split_lines(plan: Plan, explain: bool) -> list[str]:
    """Per model whose servers the planner weighed splitting: what it chose and the figures
    of both ways (with --explain, also where it kept them colocated)."""
    out = []
    for s in plan.models:
        g = s.disaggregation
        if g is None or not (g.chosen or explain):
            continue
        colocated = (
            f"colocated {g.colocated_rps:.2f} req/s within the SLO, first token "
            f"{g.colocated_ttft_s:.2f} s, decode token {g.colocated_tpot_ms:.0f} ms"
        )
        if g.split_rps is None:
            out.append(f"{s.model}: colocated ({g.reason})")
            continue
        split = (
            f"split {g.split_rps:.2f} req/s, first token {g.split_ttft_s:.2f} s with "
            f"{(g.transfer_s or 0) * 1000:.0f} ms of KV transfer, decode token "
            f"{g.split_tpot_ms:.0f} ms"
        )
        if g.chosen:
            head = f"{s.model}: {g.prefill_servers} prefill + {g.decode_servers} decode servers"
        else:
            head = f"{s.model}: colocated"
        out.append(f"{head} ({g.reason}): {split}; {colocated}")
    return out


def cost_line(plan: Plan) -> str | None:
    """The plan's price in one line, or None where no GPU it uses has a price."""
    if not any(d.server.cost_per_hour is not None for d in plan.deployments):
        return None
    total = plan.cost_per_hour
    if total is None:
        missing = sorted({d.gpu_type for d in plan.deployments if d.server.cost_per_hour is None})
        return (
            f"Cost: unknown: {', '.join(missing)} GPUs have no price (set cost_per_hour on "
            "their nodes, or in the GPU profile)"
        )
    per_m = plan.cost_per_million_output_tokens
    tail = (
        f", ${_money(per_m)} per million output tokens at the planned rate"
        if per_m is not None
        else ""
    )
    return f"Cost: ${_money(total)}/h (objective {plan.objective}){tail}."


def profiles_table(cat: Catalog) -> RenderableType:
    gpus = Records(
        "GPUs",
        [
            Col("name", head=True),
            Col("arch", head=True),
            Col("memory\nGiB", numeric=True),
            Col("GB/s", numeric=True),
            Col("bf16\nTFLOPS", numeric=True),
            Col("fp8\nTFLOPS", numeric=True),
            Col("link"),
        ],
        [
            [
                g.name,
                g.architecture,
                f"{g.memory_mib / 1024:.1f}",
                f"{g.memory_bandwidth_gb_s:g}",
                f"{g.tflops.bf16 or g.tflops.fp16:g}",
                f"{g.tflops.fp8:g}" if g.tflops.fp8 else "-",
                g.interconnect,
            ]
            for g in sorted(cat.gpus.values(), key=lambda g: g.name)
        ],
    )
    models = Records(
        "Models",
        [
            Col("name", head=True),
            Col("params", numeric=True),
            Col("active", numeric=True),
            Col("layers", numeric=True),
            Col("KV\nheads", numeric=True),
            Col("max\ncontext", numeric=True),
            Col("KV KiB\n/token", numeric=True),
        ],
        [
            [
                m.name,
                f"{m.params_total / 1e9:.1f}B",
                f"{m.params_active / 1e9:.1f}B",
                str(m.num_layers),
                str(m.num_kv_heads),
                str(m.max_context),
                f"{2 * m.num_layers * m.num_kv_heads * m.head_dim * 2 / 1024:g}",
            ]
            for m in sorted(cat.models.values(), key=lambda m: m.name)
        ],
    )
    formats = Records(
        "Formats",
        [
            Col("name", head=True),
            Col("bytes\n/param", numeric=True),
            Col("architectures"),
            Col("--quantization"),
        ],
        [
            [
                f.name,
                f"{f.weight_bytes_per_param:g}",
                ", ".join(f.architectures),
                f.vllm.quantization or "-",
            ]
            for f in sorted(cat.formats.values(), key=lambda f: f.name)
        ],
    )
    return Group(gpus, models, formats)


FACTS_COLUMNS = [
    Col("node", head=True),
    Col("status", head=True),
    Col("GPUs"),
    # Versions are numbers to an operator comparing nodes: never folded.
    Col("driver", numeric=True, left=True),
    Col("CUDA", numeric=True, left=True),
    Col("vLLM", numeric=True, left=True),
    Col("link"),
    Col("hostname"),
]


def examples_table(descriptions: Mapping[str, str]) -> RenderableType:
    """`example:NAME` beside its description; the description wraps at word breaks to the
    console's width (never cut), the name never wraps."""
    from rich.table import Table

    t = Table.grid(padding=(0, 0, 0, 2))
    t.add_column(no_wrap=True)
    t.add_column(overflow="fold")
    for name, text in descriptions.items():
        t.add_row(Text(f"example:{name}"), Text(text))  # Text: a `[...]` is not markup
    return t


def facts_table(facts: Facts) -> Records:
    """One row per probed node: reachability, GPUs, driver, CUDA, vLLM, interconnect."""
    rows: list[list[Cell]] = []
    for name in sorted(facts.nodes, key=natural_key):
        f = facts.nodes[name]
        if f.error is not None:
            # The node's one line (what happened, what to do) follows the table, unwrapped.
            rows.append([name, Text(f.error.kind, style="red"), *[""] * 6])
            continue
        kinds: dict[str, int] = defaultdict(int)
        for g in f.gpus:
            kinds[str(g.name)] += 1
        gpu_text = ", ".join(f"{n}x {k}" for k, n in kinds.items()) or "none"
        status = (
            Text("gpu: " + f.gpu_error.kind, style="yellow")
            if f.gpu_error
            else Text("ok", style="green")
        )
        rows.append(
            [
                name,
                status,
                gpu_text,
                f.driver_version or "-",
                f.cuda_version or "-",
                f.vllm or "-",
                f.interconnect or "-",
                f.hostname or "-",
            ]
        )
    return Records("Facts", FACTS_COLUMNS, rows)


_STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "red"}


def health_table(checks: Iterable[Check]) -> Records:
    """One row per health check: what was checked, on which node, and what it found."""
    cols = [Col("check", head=True), Col("node", head=True), Col("status", head=True)]
    rows: list[list[Cell]] = [
        [c.check, c.node, Text(c.status, style=_STATUS_STYLE[c.status]), c.detail] for c in checks
    ]
    return Records("Health", [*cols, Col("detail")], rows)


def status_table(
    rows: Iterable[ServerStatus],
    calibrated: Mapping[tuple[str, tuple[int, ...]], str] | None = None,
) -> Records:
    """One row per recorded server, as its node and its HTTP endpoints see it now; `calibrated`
    (by node and GPUs): the model's figures beside the measured ones, added to the detail."""
    cols = [
        Col("node", head=True),
        Col("model", head=True),
        Col("GPUs", numeric=True, left=True),
        Col("port", numeric=True),
        Col("condition", head=True),
        Col("detail"),
    ]
    out: list[list[Cell]] = []
    for r in rows:
        style = "green" if r.condition == "running" else "red"
        # An unreachable node's one line follows the table, once per node, not per server.
        detail = "node not checked: see below" if r.condition == "unreachable" else r.detail
        measured = (calibrated or {}).get((r.node, tuple(r.gpus)))
        if measured:
            detail = f"{detail}; {measured}" if detail else measured
        out.append(
            [
                r.node,
                r.model,
                ",".join(map(str, r.gpus)),
                str(r.port),
                Text(r.condition, style=style),
                detail,
            ]
        )
    return Records("Servers", cols, out)


def estimate_table(e: Estimate, instead: Sequence[Fit] = ()) -> RenderableType:
    """One estimate: where each GPU's memory goes, what the KV cache holds, and the speeds;
    for one that does not fit, no speeds (it would not start) and what fits instead."""
    j = e.to_json()
    parts = j["reserved_parts_gib_per_gpu"]
    tp = j["tensor_parallel_size"]
    rows = [
        ["weights per GPU", f"{j['weights_gib_per_gpu']:.2f} GiB"],
        [
            "reserved per GPU",
            f"{j['reserved_gib_per_gpu']:.2f} GiB (activations {parts['activation_peak']:.2f}, "
            f"non-torch {parts['non_torch']:.2f}, CUDA graphs {parts['cuda_graphs']:.2f})",
        ],
        *(_estimate_figures(j) if e.fits else _estimate_short(e)),
    ]
    title = f"{j['model']} {j['format']} on {tp}x {j['gpu']}" + (
        f", vLLM {j['vllm_version']}" if j["vllm_version"] else ""
    )
    verdict = (
        "fits"
        if j["fits"]
        else f"does not fit: not one sequence of {j['settings']['max_model_len']:,}"
        + _fits_with(e, instead)
    )
    return Records(
        title,
        [Col("figure", head=True), Col("value", numeric=True, left=True)],
        rows,
        caption=f"{verdict}; source: {j['source']['detail']}",
    )


def _estimate_figures(j: dict[str, Any]) -> list[list[str]]:
    """The KV cache and the speeds of an estimate that fits."""
    return [
        ["KV cache per GPU", f"{j['kv_cache_gib_per_gpu']:.2f} GiB"],
        ["KV cache", f"{j['kv_cache_tokens']:,} tokens"],
        [
            f"sequences of {j['settings']['max_model_len']:,}",
            f"{j['max_concurrency_at_max_len']:.2f}x",
        ],
        [
            f"decode, {plural(j['batch'], 'sequence')} at {j['context']:,}",
            f"{j['decode_tok_s_per_seq']:,.1f} tok/s each, {j['decode_tok_s_total']:,.1f} in all "
            f"({j['step_time_ms']:.2f} ms a step)",
        ],
        [f"prefill, {j['prompt']:,} tokens alone", f"{j['prefill_tok_s']:,.0f} tok/s"],
    ]


def _estimate_short(e: Estimate) -> list[list[str]]:
    """Where it does not fit: what the memory vLLM may use leaves for the KV cache, and no
    speeds (a server that never starts has none)."""
    from fleetctl.model.perf import GiB

    b = e.budget
    if b.kv_per_gpu <= 0:
        taken = (b.weights + b.reserve) / GiB
        kv = f"none: weights and reserve take {taken:.2f} of the {b.usable / GiB:.2f} GiB usable"
    else:
        kv = f"{b.kv_per_gpu / GiB:.2f} GiB, short of one sequence of {e.max_model_len:,}"
    return [["KV cache per GPU", kv], ["decode and prefill", "n/a: vLLM would not start"]]


def _fits_with(e: Estimate, instead: Sequence[Fit]) -> str:
    """`; fits with --tp 2 (13,456 KV tokens), or with --format fp8 (...)`: the flag that
    changes, figured by the same model; or that no larger TP nor lighter format fits."""
    if not instead:
        return "; no larger --tp (up to 8) nor lighter --format fits either"
    ways = []
    for f in instead:
        flag = (
            f"--format {f.format}" if f.format != e.fmt.name else f"--tp {f.tensor_parallel_size}"
        )
        ways.append(f"{flag} ({f.kv_cache_tokens:,} KV tokens)")
    return "; fits with " + ", or with ".join(ways)


def calibration_table(readings: Iterable[ServerReading]) -> Records:
    """Per server: the model's figure beside the measured one; a figure not trusted is red and
    the note says why."""
    cols = [
        Col("node", head=True),
        Col("model", head=True),
        Col("KV tokens\nmodel", numeric=True),
        Col("KV tokens\nmeasured", numeric=True),
        Col("step ms\nmodel", numeric=True),
        Col("step ms\nmeasured", numeric=True),
        Col("batch", numeric=True),
        Col("prefill tok/s\nmodel", numeric=True),
        Col("prefill tok/s\nmeasured", numeric=True),
        Col("TTFT ms", numeric=True),
        Col("samples", numeric=True),
        Col("note"),
    ]
    rows: list[list[Cell]] = []
    for r in readings:
        if r.error is not None or r.key is None:
            rows.append([r.node, "", *[""] * 9, Text("unreadable: see below", style="red")])
            continue
        f = r.figures
        step = f.step
        batch = f"{step.batch_lo:.1f}-{step.batch_hi:.1f}" if step else ""
        notes = [
            x.why
            for x in (f.kv_tokens, f.step_at_batch, f.prefill_tok_s)
            if x is not None and x.why
        ]
        rows.append(
            [
                r.node,
                f"{r.key.model} {r.key.format}",
                _model_of(f.kv_tokens, "{:,.0f}"),
                _measured(f.kv_tokens, "{:,.0f}"),
                _model_of(f.step_at_batch, "{:.2f}", 1e3),
                _measured(f.step_at_batch, "{:.2f}", 1e3),
                batch,
                _model_of(f.prefill_tok_s, "{:,.0f}"),
                _measured(f.prefill_tok_s, "{:,.0f}"),
                _measured(f.ttft_s, "{:.1f}", 1e3),
                str(len(r.samples)),
                "; ".join(notes),
            ]
        )
    return Records(
        "Calibration",
        cols,
        rows,
        caption="step: one decode step at the batch measured (sequences running); "
        "red: not trusted, not used",
    )


def _model_of(f: Figure | None, fmt: str, scale: float = 1.0) -> str:
    return "" if f is None or f.model is None else fmt.format(f.model * scale)


def _measured(f: Figure | None, fmt: str, scale: float = 1.0) -> Cell:
    if f is None:
        return "-"
    text = fmt.format(f.value * scale)
    return text if f.trusted else Text(text, style="red")


def render_workloads(shown: dict[str, dict[str, Any]]) -> RenderableType:
    """The workloads the plan was made for, derived beside the inventory's."""
    rows = []
    for name, w in shown.items():
        inv = w.get("inventory") or {}

        def pair(key: str, fmt: str, w: dict[str, Any] = w, inv: dict[str, Any] = inv) -> str:
            got = w.get(key)
            text = "-" if got is None else format(got, fmt)
            if key in inv:
                text += f" ({format(inv[key], fmt)})"
            return text

        share = w.get("long_share")
        sessions = w.get("session_share")
        rows.append(
            [
                name,
                w["source"],
                pair("requests_per_s", ".2f"),
                pair("mean_prompt_tokens", ","),
                pair("mean_output_tokens", ","),
                "-" if w.get("p95_prompt_tokens") is None else f"{w['p95_prompt_tokens']:,}",
                "-" if share is None else f"{share:.0%}",
                "-" if sessions is None else f"{sessions:.0%}",
            ]
        )
    return Records(
        "Workloads the plan was sized for",
        [
            Col("model", head=True),
            Col("from"),
            Col("peak req/s", numeric=True),
            Col("prompt mean", numeric=True),
            Col("output mean", numeric=True),
            Col("prompt p95", numeric=True),
            Col("long", numeric=True),
            Col("sessions", numeric=True),
        ],
        rows,
        caption="in parentheses: the inventory's figure; peak = 95th percentile of 5-minute rates",
    )
