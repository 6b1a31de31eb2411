"""Each LoRA adapter in a plan: the servers that load it, and its capacity at its own SLO."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fleetctl.fleet.inventory import Model
from fleetctl.fleet.plan import AdapterUse, LoraUse, ModelSummary
from fleetctl.fleet.slo import Slo
from fleetctl.model.lora import LoraMix
from fleetctl.model.perf import EnginePerf
from fleetctl.planner.candidates import Candidate, tpot_rates
from fleetctl.planner.lora import NONE, slots, use
from fleetctl.planner.queueing import Group, goodput, traffic_of


def with_adapters(
    summary: ModelSummary, model: Model, placed: Sequence[tuple[Candidate, int]]
) -> ModelSummary:
    """`summary` with its model's LoRA and adapters; as it was for a model without them."""
    lora, uses = lora_summary(model, placed)
    return dataclasses.replace(summary, lora=lora, adapters=uses) if uses else summary


def lora_summary(
    model: Model, placed: Sequence[tuple[Candidate, int]]
) -> tuple[tuple[LoraUse, ...], tuple[AdapterUse, ...]]:
    """LoRA per GPU type the model's placed servers (candidate, count) run on, and each
    adapter's use: ((), ()) for a model without adapters."""
    if not model.adapters:
        return (), ()
    uses: dict[str, LoraUse] = {}
    groups = []
    for k, n in placed:
        gpu = k.cls.gpu.name
        if slots(model, gpu) is not None and gpu not in uses:
            uses[gpu] = use(model, gpu, k.variant.format, k.tp, k.perf.kv_token_bytes)
        group = Group(
            n,
            k.perf,
            k.budget.kv_tokens,
            k.max_num_seqs,
            k.max_model_len,
            max_num_batched_tokens=k.max_num_batched_tokens,
        )
        groups.append(Placed(gpu, group))
    return tuple(uses.values()), adapter_uses(model, groups)


def alone(perf: EnginePerf) -> EnginePerf:
    """`perf` running one adapter in every step (its kernels on all its tokens)."""
    mix = perf.lora_mix
    if mix is None:
        return perf
    assert isinstance(mix, LoraMix), mix
    return dataclasses.replace(perf, lora_mix=dataclasses.replace(mix, shares=(1.0,)))


@dataclass(frozen=True)
class Placed:
    """Servers of one kind placed for the model: GPU type, how many, and their engine."""

    gpu_type: str
    group: Group


def adapter_uses(model: Model, placed: Sequence[Placed]) -> tuple[AdapterUse, ...]:
    """Each adapter: the servers that load it at start, and where it has a workload and an
    SLO of its own, the goodput those servers give its traffic (planner/queueing.py's, the
    figure the model's own capacity is)."""
    out = []
    for a in model.adapters:
        mine = [p for p in placed if not a.gpu_types or p.gpu_type in a.gpu_types]
        loading = [p for p in mine if a in (slots(model, p.gpu_type) or NONE).preloaded]
        servers = sum(p.group.servers for p in loading)
        capacity, basis = None, "none: no workload or SLO of its own"
        slo = Slo.of(a.spec.slo)
        if a.spec.workload is not None and slo is not None and mine:
            own = dataclasses.replace(
                model, spec=model.spec.model_copy(update={"workload": a.spec.workload})
            )
            shape = (a.spec.workload.mean_prompt_tokens, a.spec.workload.mean_output_tokens)
            groups = [
                dataclasses.replace(
                    g,
                    perf=perf,
                    tpot_rates=tpot_rates(perf, slo, *shape, g.kv_tokens, g.max_num_seqs),
                )
                for g, perf in ((p.group, alone(p.group.perf)) for p in mine)
            ]
            capacity = goodput(groups, traffic_of(own, shape), slo.ttft_s, slo.tpot_s, slo.share)
            basis = (
                "goodput at its SLO on its own lengths, its servers serving it alone "
                "(its kernels in every step)"
            )
        out.append(
            AdapterUse(
                a.name,
                a.spec.rank,
                a.gpu_types,
                servers,
                a.spec.workload.requests_per_s if a.spec.workload else None,
                capacity,
                basis,
            )
        )
    return tuple(out)
