"""Simulate a planned fleet under a workload with several policies, side by side."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Plan
from fleetctl.model.calibration import Calibration
from fleetctl.model.lora import LoraMix
from fleetctl.model.perf import EnginePerf
from fleetctl.routing.goodput import Slo
from fleetctl.routing.policy import RoutingConfig
from fleetctl.routing.registry import compared_policies
from fleetctl.routing.scheduler import Aging
from fleetctl.sim.fleet import (
    Server,
    SimResult,
    rejected_reasons,
    servers_from_plan,
    simulate,
)
from fleetctl.sim.workload import WorkItem, scale_time

DEFAULT_POLICIES = compared_policies()


@dataclass
class Comparison:
    model: str
    servers: list[Server]
    items: list[WorkItem]
    capacity_rps: float  # the fleet's saturation throughput for this workload's mean request
    offered_rps: float
    results: dict[str, SimResult]

    @property
    def slo(self) -> Slo | None:
        return next((r.slo for r in self.results.values()), None)

    def goodput_winner(self) -> str | None:
        """The policy that served the most requests within both objectives (the first named
        on a tie); None without an SLO."""
        if self.slo is None or not self.results:
            return None
        return max(self.results, key=lambda n: self.results[n].summary()["slo_attainment"])

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "servers": len(self.servers),
            "requests": len(self.items),
            "duration_s": round(self.items[-1].arrival, 3) if self.items else 0.0,
            "capacity_rps": round(self.capacity_rps, 3),
            "offered_rps": round(self.offered_rps, 3),
            "load": round(self.offered_rps / self.capacity_rps, 3) if self.capacity_rps else None,
            "slo": None if self.slo is None else self.slo.to_json(),
            "goodput_winner": self.goodput_winner(),
            "policies": {
                name: {
                    **{k: _clean(v) for k, v in r.summary().items()},
                    "rejected_reasons": rejected_reasons(r.outcomes),
                    **({"lora": lora} if (lora := r.adapter_figures()) is not None else {}),
                }
                for name, r in self.results.items()
            },
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 6)


def _clean(v: float | int) -> float | int | None:
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 4)
    return v


def mean_shape(items: Sequence[WorkItem]) -> tuple[int, int]:
    if not items:
        return 1, 1
    return (
        round(sum(w.prompt for w in items) / len(items)),
        round(sum(w.output for w in items) / len(items)),
    )


def adapter_asks(items: Sequence[WorkItem]) -> Counter[str | None]:
    """How many of `items` name each LoRA adapter (None: the base model)."""
    return Counter(w.adapter for w in items)


def fleet_capacity(
    servers: Sequence[Server],
    prompt: int,
    output: int,
    asks: Mapping[str | None, int] | None = None,
) -> float:
    """Requests/s the servers sustain at saturation for a mean request (the planner's number);
    with `asks` (requests per adapter, adapter_asks), a LoRA-enabled server's steps count the
    kernels of the adapters it may serve, at their shares of the requests it may serve."""
    return sum(
        lora_perf(s, asks).capacity_rps(
            prompt, output, s.kv_tokens, s.max_num_seqs, s.max_num_batched_tokens
        )
        for s in servers
    )


def lora_perf(s: Server, asks: Mapping[str | None, int] | None) -> EnginePerf:
    """`s`'s engine with the adapters of `asks` it may serve (model/lora.py's LoraMix); as it
    is without LoRA or without requests for its adapters."""
    if s.lora is None or not asks:
        return s.perf
    mine = [asks.get(name, 0) for name, _ in s.lora.ranks]
    served = asks.get(None, 0) + sum(mine)
    if not served:
        return s.perf
    mix = LoraMix.of(
        (n / served for n in mine), s.lora.max_loras, s.lora.max_rank, s.perf.fmt.activation_bytes
    )
    return s.perf if mix is None else replace(s.perf, lora_mix=mix)


def at_load(items: list[WorkItem], load: float, capacity: float) -> list[WorkItem]:
    """Time-scale arrivals so the offered rate is `load` x `capacity`."""
    return at_rate(items, load * capacity)


def at_rate(items: list[WorkItem], rate: float) -> list[WorkItem]:
    """Time-scale arrivals so the offered rate is `rate` requests per second."""
    if len(items) < 2 or items[-1].arrival <= 0:
        return items
    return scale_time(items, rate / (len(items) / items[-1].arrival))


def compare(
    inv: Inventory,
    plan: Plan,
    model: str,
    items: list[WorkItem],
    policies: Sequence[str] = DEFAULT_POLICIES,
    *,
    load: float | None = None,
    rate: float | None = None,
    seed: int = 0,
    aging: Aging | None = None,
    progress: Callable[[float, str], None] | None = None,
    calibration: Calibration | None = None,
    slo: Slo | None = None,
) -> Comparison:
    """Run every policy over the same servers and the same requests.

    `load` scales the arrivals to that share of the fleet's capacity, `rate` to that many
    requests per second. `slo`: the model's objectives for this run, in place of the
    inventory's (hardware-aware routes by them; every result counts who met them).
    `progress(done, what)` hears how many policies are done, fractions included (of
    `len(policies)`), and which one runs. `calibration`: measured KV and speed for the servers
    of the classes it has.
    """
    found = servers_from_plan(plan.deployments, inv, calibration)
    servers = [s for s in found if s.model == model]
    prompt, output = mean_shape(items)
    capacity = fleet_capacity(servers, prompt, output, adapter_asks(items))
    if load is not None:
        items = at_load(items, load, capacity)
    elif rate is not None:
        items = at_rate(items, rate)
    items = [replace(w, model=model) if w.model != model else w for w in items]
    offered = len(items) / items[-1].arrival if len(items) > 1 and items[-1].arrival > 0 else 0.0
    spec = inv.spec.router
    # Without a stated SLO, the default is derived from these servers and this traffic's
    # lengths, as `plan --workload-from` derives it from the same trace.
    engines = [(s.model, s.perf, s.max_model_len) for s in found]
    config = RoutingConfig.of(inv, engines, {model: (prompt, output)})
    if slo is not None:
        config.slo[model] = slo
    slo = config.slo.get(model)
    if aging is None:
        aging = Aging(spec.aging.factor, spec.aging.window_s, spec.aging.enabled)
    workload = inv.model(model).spec.workload
    estimate = {model: workload.mean_output_tokens if workload else output}
    results = {}
    for k, name in enumerate(policies):
        hook = None
        if progress is not None:
            hook = _policy_progress(progress, k, f"simulating {name} ({k + 1}/{len(policies)})")

        results[name] = simulate(
            servers,
            items,
            name,
            seed=seed,
            config=config,
            aging=aging,
            output_estimate=estimate,
            progress=hook,
            slo=slo,
        )
    if progress is not None:
        progress(len(policies), "simulated")
    return Comparison(model, servers, items, capacity, offered, results)


def _policy_progress(
    report: Callable[[float, str], None], k: int, what: str
) -> Callable[[float], None]:
    """The k-th policy's share done, as progress over all of them."""
    report(k, what)
    return lambda share: report(k + share, what)
