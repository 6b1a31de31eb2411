"""A fleet of simulated vLLM engines behind the router's scheduler and a policy.

Arrivals go through the same `Scheduler` and `Policy` objects the daemon uses; engines come
from a plan's deployments. One event per engine step or run of identical decode steps, so an
hour of traffic on a dozen servers simulates in seconds. Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from fleetctl.fleet.engines import deployment_engine
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.model.calibration import Calibrated, Calibration
from fleetctl.model.lora import LoraPerf
from fleetctl.model.perf import BLOCK_SIZE, EnginePerf
from fleetctl.planner import lora as planner_lora
from fleetctl.planner.disaggregate import Link
from fleetctl.routing.goodput import Slo
from fleetctl.routing.phases import PREFILL
from fleetctl.routing.policy import RoutingConfig
from fleetctl.routing.prefix import PromptBlocks
from fleetctl.routing.registry import make_policy
from fleetctl.routing.scheduler import Aging, Scheduler, first_token, release
from fleetctl.routing.types import (
    ASLEEP,
    AWAKE,
    STARTING,
    WAKING,
    Backend,
    OutputEstimator,
    Request,
)
from fleetctl.sim.controls import DOWN, AwakeSpans, Control, Controller, Observation, check
from fleetctl.sim.engine import Engine, Seq
from fleetctl.sim.kvpool import engine_keys
from fleetctl.sim.workload import WorkItem


@dataclass(frozen=True)
class ServerLora:
    """A server's LoRA as the plan starts it (planner/lora.py): its slots, its CPU cache, the
    adapters loaded at start, whether more load at runtime, and every adapter it may load,
    with its rank."""

    max_loras: int
    max_rank: int
    max_cpu_loras: int
    preloaded: tuple[str, ...]
    runtime: bool
    ranks: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Server:
    """What the simulator needs of one deployment."""

    name: str
    node: str
    gpu_type: str
    model: str
    variant: str
    perf: EnginePerf
    kv_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    calibrated: str = ""  # where its KV and speed were measured, when they were
    block_size: int = BLOCK_SIZE  # KV block tokens (vLLM's CPU backend: 128)
    engine: Calibrated | None = None  # the calibrated engine it was built from, when it was
    role: str = "both"  # or one phase of a disaggregated model: "prefill", "decode"
    link: Link | None = None  # its node's network, for KV transfers (None: unknown)
    lora: ServerLora | None = None  # --enable-lora's settings; None: no adapters
    gpus: tuple[int, ...] = ()  # its GPU indices on its node (a sleeper shares them)


# Events between progress reports: often enough for a smooth bar, rare enough to cost nothing.
PROGRESS_EVERY = 4096


def servers_from_plan(
    deployments: Sequence[Deployment], inv: Inventory, calibration: Calibration | None = None
) -> list[Server]:
    """The simulator's servers for a plan's deployments; with `calibration`, a deployment whose
    class has an entry runs at its servers' measured speed with their measured KV."""
    out = []
    nodes = {n.name: n for n in inv.nodes}
    for d in deployments:
        engine = deployment_engine(d, inv, calibration)
        net = nodes[d.node].network if d.node in nodes else None
        assert engine is not None, f"the inventory does not describe {d.node}'s server"
        s = d.server
        out.append(
            Server(
                f"{d.node}:{d.port}",
                d.node,
                d.gpu_type,
                d.model,
                d.variant,
                engine.perf,
                engine.kv_tokens,
                s.max_num_seqs,
                s.max_num_batched_tokens,
                s.max_model_len,
                engine.provenance,
                engine=engine,
                role=s.role,
                link=None if net is None else Link(net.gbps, net.rdma),
                lora=_server_lora(inv, d.model, d.gpu_type) if s.role == "both" else None,
                gpus=d.gpu_indices,
            )
        )
    return out


def _server_lora(inv: Inventory, model: str, gpu_type: str) -> ServerLora | None:
    """The plan's LoRA for a server of `model` on `gpu_type` (the flags apply starts it with)."""
    m = next((m for m in inv.models if m.name == model), None)
    slots = planner_lora.slots(m, gpu_type) if m is not None and m.adapters else None
    if m is None or slots is None:
        return None
    return ServerLora(
        slots.max_loras,
        slots.max_lora_rank,
        slots.max_cpu_loras,
        tuple(a.name for a in slots.preloaded),
        slots.runtime,
        tuple((a.name, a.spec.rank) for a in planner_lora.eligible(m, gpu_type)),
    )


@dataclass(slots=True)
class Outcome:
    """What happened to one request."""

    item: WorkItem
    backend: str | None = None
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prefilled: float | None = None  # a split request: when its prefill server finished
    preemptions: int = 0
    rejected: str | None = None
    boosted: bool = False

    @property
    def done(self) -> bool:
        """Served to its last token."""
        return self.rejected is None and self.finished is not None and self.first_token is not None

    @property
    def ttft_s(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.item.arrival

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first: (last - first token) / (output - 1);
        None for a single output token."""
        assert self.finished is not None and self.first_token is not None
        if self.item.output <= 1:
            return None
        return (self.finished - self.first_token) / (self.item.output - 1)

    def met(self, slo: Slo | None) -> bool:
        """Served within both objectives (with no SLO: served)."""
        return self.done and (slo is None or slo.met(self.ttft_s, self.tpot_s))


@dataclass
class SimResult:
    policy: str
    outcomes: list[Outcome]
    horizon: float
    boosts: int
    preemptions: int
    reasons: dict[str, int] = field(default_factory=dict)
    prefix_queries: int = 0  # prompt tokens the engines looked up in their prefix caches
    prefix_hits: int = 0  # of those, tokens found cached: prefill saved
    slo: Slo | None = None  # the model's objectives: slo_attainment counts who met both
    # Disaggregated serving: prompt tokens whose KV cache a decode server received from a
    # prefill server instead of computing it.
    transferred_tokens: int = 0
    # When each server held its GPUs, and the fleet's changes (sim/controls.py).
    awake: AwakeSpans | None = None
    # LoRA: adapters copied into a GPU slot, by adapter; how many of all those were read
    # from disk first; and the router's runtime loads (/v1/load_lora_adapter), by adapter.
    slot_loads: dict[str, int] = field(default_factory=dict)
    disk_loads: int = 0
    runtime_loads: dict[str, int] = field(default_factory=dict)

    def adapter_figures(self) -> dict[str, object] | None:
        """Per adapter (and `(base)` for the base model's requests): requests, the share
        served within both objectives, TTFT and TPOT p50/p99, its loads into a GPU slot and
        the router's runtime loads of it; with the totals and loads a minute. None when no
        request named an adapter."""
        if not any(o.item.adapter for o in self.outcomes):
            return None
        groups: dict[str, list[Outcome]] = {}
        for o in self.outcomes:
            groups.setdefault(o.item.adapter or "(base)", []).append(o)
        span = max((o.finished for o in self.outcomes if o.finished), default=0.0) - min(
            (o.item.arrival for o in self.outcomes), default=0.0
        )
        each: dict[str, object] = {}
        for name in sorted(groups):
            outs = groups[name]
            done = [o for o in outs if o.done]
            ttft = sorted(o.ttft_s for o in done)
            tpot = sorted(t for o in done if (t := o.tpot_s) is not None)
            met = sum(1 for o in done if o.met(self.slo))
            each[name] = {
                "requests": len(outs),
                "completed": len(done),
                "slo_attainment": round(met / len(outs), 4) if self.slo is not None else None,
                "ttft_p50_s": _round(percentile(ttft, 50)),
                "ttft_p99_s": _round(percentile(ttft, 99)),
                "tpot_p50_s": _round(percentile(tpot, 50)),
                "tpot_p99_s": _round(percentile(tpot, 99)),
                "slot_loads": self.slot_loads.get(name, 0),
                "runtime_loads": self.runtime_loads.get(name, 0),
            }
        slot = sum(self.slot_loads.values())
        return {
            "slot_loads": slot,
            "disk_loads": self.disk_loads,
            "runtime_loads": sum(self.runtime_loads.values()),
            "slot_loads_per_min": round(slot / span * 60, 3) if span > 0 else 0.0,
            "adapters": each,
        }

    def summary(self) -> dict[str, float | int]:
        """Latency percentiles over the requests served; `slo_attainment` is the share of
        all requests served within both objectives (NaN without an SLO), `goodput_rps` their
        rate."""
        done = [o for o in self.outcomes if o.done]
        ttft = sorted(o.ttft_s for o in done)
        e2e = sorted(o.finished - o.item.arrival for o in done if o.finished is not None)
        tpot = sorted(t for o in done if (t := o.tpot_s) is not None)
        span = max((o.finished for o in done if o.finished), default=0.0) - min(
            (o.item.arrival for o in self.outcomes), default=0.0
        )
        tokens = sum(o.item.output for o in done)
        met = sum(1 for o in done if o.met(self.slo)) if self.slo is not None else 0
        return {
            "requests": len(self.outcomes),
            "completed": len(done),
            "starved": sum(1 for o in self.outcomes if o.finished is None and o.rejected is None),
            "rejected": sum(1 for o in self.outcomes if o.rejected is not None),
            "ttft_mean_s": _mean(ttft),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "tpot_mean_s": _mean(tpot),
            "tpot_p50_s": percentile(tpot, 50),
            "tpot_p90_s": percentile(tpot, 90),
            "tpot_p99_s": percentile(tpot, 99),
            "e2e_mean_s": _mean(e2e),
            "e2e_p99_s": percentile(e2e, 99),
            "slo_attainment": met / len(self.outcomes)
            if self.slo is not None and self.outcomes
            else math.nan,
            "goodput_rps": met / span if self.slo is not None and span > 0 else math.nan,
            "throughput_rps": len(done) / span if span > 0 else 0.0,
            "output_tok_s": tokens / span if span > 0 else 0.0,
            "preemptions": self.preemptions,
            "aging_boosts": self.boosts,
            "prefix_hit_rate": self.prefix_hits / self.prefix_queries
            if self.prefix_queries
            else 0.0,
            "prefill_saved_tokens": self.prefix_hits,
        }


# Why a request was refused, by the start of the router's message (routing/policy.py's
# eligible, the scheduler's decode_for, the simulated vLLM's length check): a bounded name,
# so a table and JSON count them however the lengths in the messages vary.
REJECTIONS = (
    ("prompt (", "context too long for every server"),
    ("prompt + output exceeds max_model_len", "context too long for its server"),
    ("no backend serves", "no server of that precision"),
    ("no healthy backend serves", "no server of the model"),
    ("no awake server serves", "no server of the model"),
    ("no awake decode server", "no decode server"),
    ("no healthy backend of", "adapter loaded nowhere"),
    ("no decode server", "no decode server"),
)


def rejection_kind(message: str) -> str:
    """The bounded name of a rejection's reason; `other` for a message not listed."""
    return next((kind for start, kind in REJECTIONS if message.startswith(start)), "other")


def rejected_reasons(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """How many requests were refused for each reason, most first."""
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.rejected is not None:
            kind = rejection_kind(o.rejected)
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _round(v: float) -> float | None:
    return None if math.isnan(v) else round(v, 4)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile of sorted values; NaN for none."""
    if not values:
        return math.nan
    k = (len(values) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def simulate(
    servers: Sequence[Server],
    items: Sequence[WorkItem],
    policy_name: str,
    *,
    seed: int = 0,
    config: RoutingConfig | None = None,
    aging: Aging | None = None,
    output_estimate: dict[str, int] | None = None,
    drain_s: float | None = None,
    admission: bool | None = None,
    progress: Callable[[float], None] | None = None,
    slo: Slo | None = None,
    controls: Sequence[Control] = (),
    down: Iterable[str] = (),
    controller: Controller | None = None,
    tick_s: float = 60.0,
) -> SimResult:
    """Run `items` through the scheduler and `policy_name` over engines built from `servers`;
    `slo`: the objectives the result's attainment counts (the policy's are in `config`).

    The fleet may change while it runs (sim/controls.py): `controls` at their times, the
    servers named in `down` asleep from the start, and `controller`, called every `tick_s`
    seconds with what it can observe, returning more controls. The result's `awake` holds
    each server's awake spans (GPU-hours) and the actions taken.

    `progress`, if given, hears the share of the arrivals' span simulated so far, now and then.
    """
    engines = [_engine(s) for s in servers]
    # Policies that read prefix caches see the engines' own, as vLLM's KV events tell them.
    caches = _EngineCaches(engines)
    policy = make_policy(policy_name, seed, config, prefix=caches)
    sched = Scheduler(policy, aging or Aging(), admission=admission)
    run = _Run(servers, items, engines, sched, OutputEstimator(output_estimate), drain_s)
    run.caches = caches
    run.control(controls, set(down), controller, tick_s)
    run.run(progress)
    return SimResult(
        policy_name,
        run.outcomes,
        run.horizon,
        sched.boosts,
        sum(e.stats.preemptions for e in engines),
        run.reasons,
        sum(e.stats.prefix_cache_queries for e in engines),
        sum(e.stats.prefix_cache_hits for e in engines),
        slo,
        sum(e.stats.external_tokens for e in engines),
        run.awake,
        _merged(e.stats.lora_loads_by for e in run.engines),
        sum(e.stats.lora_disk_loads for e in run.engines),
        dict(run.runtime_loads),
    )


def _merged(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


class _Run:
    """One simulation: arrivals and engine events in time order, each engine's next event on
    a heap, requests dispatched by the scheduler as they arrive and as room frees."""

    def __init__(
        self,
        servers: Sequence[Server],
        items: Sequence[WorkItem],
        engines: list[Engine],
        sched: Scheduler,
        estimate: OutputEstimator,
        drain_s: float | None,
    ) -> None:
        self.items, self.engines, self.sched = items, engines, sched
        self.servers: list[Server] = list(servers)  # grows as controls start new servers
        self.estimate = estimate
        self.backends = [_backend(s) for s in servers]
        self.caches: _EngineCaches | None = None
        self.index = {b.name: i for i, b in enumerate(self.backends)}
        self.outcomes = [Outcome(w) for w in items]
        self.requests: dict[int, Request] = {}
        self.reasons: dict[str, int] = {}
        self.last = items[-1].arrival if items else 0.0
        self.horizon = self.last + (drain_s if drain_s is not None else max(300.0, 0.5 * self.last))
        self.heap: list[tuple[float, int, int]] = []  # (time, version, engine)
        self.version = [0] * len(engines)
        self.dirty = set(range(len(engines)))
        # Disaggregated requests: which are prefilling (their prefill server's index), which
        # decode after a transfer, those waiting for a decode server with room, the KV
        # transfers in flight (when each lands, on which decode engine), and when each node's
        # NIC is free again (its transfers queue on it).
        self.prefilling: dict[int, int] = {}
        self.remote: set[int] = set()
        self.awaiting: list[tuple[int, int]] = []
        self.transfers: list[tuple[float, int, int]] = []
        self.nic_free: dict[str, float] = {}
        # The fleet's changes: controls due (time, order, control), the controller and its
        # next tick, each server's state, and when each held its GPUs.
        self.controls: list[tuple[float, int, Control]] = []
        self.order = itertools.count()  # ties at one instant go in the order they came
        self.controller: Controller | None = None
        self.tick_s = math.inf
        self.next_tick = math.inf
        self.states = {s.name: "awake" for s in servers}
        self.awake = AwakeSpans.of({s.name: s.perf.tp for s in servers}, self.states)
        self.awake.owners = {s.name: (s.model, s.role) for s in servers}
        self.draining: set[int] = set()  # engines of servers put down, still finishing work
        self.done_since: list[Outcome] = []  # finished since the controller's last tick
        self.arrived = 0
        # LoRA runtime loads, as route-serve makes them (daemon/adapters.py, Loader): those
        # under way (when each lands, which adapter, on which engine), the requests waiting
        # for each, and how many were made per adapter.
        self.loads: list[tuple[float, str, int]] = []
        self.parked: dict[str, list[Request]] = {}
        self.runtime_loads: dict[str, int] = {}

    def control(
        self,
        controls: Sequence[Control],
        down: set[str],
        controller: Controller | None,
        tick_s: float,
    ) -> None:
        """Set up the fleet's changes (see `simulate`)."""
        check(controls, self.index)
        for name in down:
            i = self.index[name]
            self.backends[i].state = ASLEEP  # its wakes are the controller's to ask
            self.states[name] = "asleep"
            self.awake.since.pop(name, None)
            self.awake.mark(name, 0.0, "asleep")
        for c in controls:
            self.push(c)
        self.controller = controller
        if controller is not None:
            self.tick_s = tick_s
            self.next_tick = 0.0

    def push(self, c: Control) -> None:
        heapq.heappush(self.controls, (c.at, next(self.order), c))

    def apply(self, c: Control, now: float, by_router: bool = False) -> None:
        """One control: a server leaves routing, begins to wake or start, or is ready;
        `by_router`: a wake the router asked (counted as a "router wake")."""
        if c.new is not None and c.server not in self.index:
            assert isinstance(c.new, Server), c.new
            self.add(c.new)
        i = self.index[c.server]
        b = self.backends[i]
        if c.action in DOWN:
            # Out of routing as route-serve takes it: asleep (the router's rule keeps
            # requests off it), or stopped (gone: not reachable).
            if c.action == "sleep":
                # In sleep mode the router may wake it itself (route-serve's rule).
                b.state, b.wakeable, b.wake_s = ASLEEP, c.wake_s is not None, c.wake_s
            else:
                b.healthy = False
            self.states[c.server] = "asleep" if c.action == "sleep" else "stopped"
            self.awake.mark(c.server, now, self.states[c.server])
            # It drains: what it runs finishes, and its GPUs count until then.
            if self.engines[i].idle:
                self.awake.down(c.server, now)
            else:
                self.draining.add(i)
            self.awake.count(c.action)
            return
        if self.states[c.server] in ("awake", "waking"):
            return  # already up, or on its way
        self.draining.discard(i)  # woken before its drain ended: its span goes on
        # Waking or starting until ready: the router may hold requests for it (hardware-aware
        # where its awake servers would miss the objective, any policy where none is awake),
        # never send one before.
        b.state = WAKING if self.states[c.server] == "asleep" else STARTING
        b.ready_at, b.healthy = now + c.ready_s, True
        self.states[c.server] = "waking"
        self.awake.mark(c.server, now, "waking")
        self.awake.up(c.server, now)
        self.awake.count("router wake" if by_router else c.action)
        ready = Control(now + c.ready_s, c.server, "ready")
        heapq.heappush(self.controls, (ready.at, next(self.order), ready))

    def add(self, s: Server) -> None:
        """A server the fleet did not have: started by a control, asleep until then."""
        e = _engine(s)
        self.servers.append(s)
        self.engines.append(e)
        self.backends.append(_backend(s))
        self.backends[-1].healthy = False  # stopped: not reachable until it starts
        self.index[s.name] = len(self.backends) - 1
        self.version.append(0)
        self.states[s.name] = "stopped"
        self.awake.gpus[s.name] = s.perf.tp
        self.awake.owners[s.name] = (s.model, s.role)
        if self.caches is not None:
            self.caches.engines[s.name] = e

    def ready(self, c: Control) -> None:
        if self.states[c.server] != "waking":
            return  # put down again while it woke
        i = self.index[c.server]
        self.states[c.server] = "awake"
        self.backends[i].healthy, self.backends[i].state = True, AWAKE
        e = self.engines[i]
        e.clock = max(e.clock, c.at)

    def tick(self, now: float) -> None:
        assert self.controller is not None
        self.refresh()
        queued: dict[str, int] = {}
        for r in self.sched.queue:
            queued[r.model] = queued.get(r.model, 0) + 1
        seen = Observation(
            now,
            self.items[: self.arrived],
            dict(self.states),
            {b.name: b.model for b in self.backends},
            {b.name: b.waiting for b in self.backends},
            queued,
            self.done_since,
        )
        self.done_since = []
        for c in self.controller(seen):
            check([c], self.index)
            self.push(replace(c, at=max(now, c.at)))
        self.next_tick = now + self.tick_s

    def run(self, progress: Callable[[float], None] | None) -> None:
        items, heap, version = self.items, self.heap, self.version
        n = 0
        events = 0
        transfers = self.transfers
        while True:
            t_arr = items[n].arrival if n < len(items) else math.inf
            while heap and heap[0][1] != version[heap[0][2]]:
                heapq.heappop(heap)  # stale: the engine was rescheduled since
            t_eng = heap[0][0] if heap else math.inf
            t_kv = transfers[0][0] if transfers else math.inf
            t_ctl = self.controls[0][0] if self.controls else math.inf
            t_tick = self.next_tick if n < len(items) else math.inf
            t_load = self.loads[0][0] if self.loads else math.inf
            now = min(t_arr, t_eng, t_kv, t_ctl, t_tick, t_load)
            if now == math.inf or now > self.horizon:
                break
            events += 1
            if progress is not None and events % PROGRESS_EVERY == 0:
                progress(min(1.0, now / self.last) if self.last > 0 else 1.0)
            # The fleet's changes come first at an instant: a server ready now serves the
            # arrivals of this instant.
            if t_tick <= now:
                self.arrived = n
                self.tick(now)
                continue
            if t_ctl <= now:
                _, _, c = heapq.heappop(self.controls)
                if c.action == "ready":
                    self.ready(c)
                else:
                    self.apply(c, now)
                self.dispatch(now)
                continue
            if t_load <= now:
                self.loaded(*heapq.heappop(self.loads))
                self.dispatch(now)
                continue
            if t_kv <= t_eng and t_kv <= t_arr:
                self.landed(*heapq.heappop(transfers))
                continue
            if t_eng <= t_arr:
                _, _, i = heapq.heappop(heap)
                finished = self.engines[i].advance(now)
                self.settle(i, finished, now)
                self.reschedule(i)
                if i in self.draining and self.engines[i].idle:
                    self.draining.discard(i)
                    self.awake.down(self.backends[i].name, now)
                if finished and (len(self.sched) or self.awaiting):
                    self.dispatch(now)
                continue
            # Every arrival at this instant, then one dispatch.
            while n < len(items) and items[n].arrival <= now:
                self.arrive(items[n])
                n += 1
            self.dispatch(now)

    def arrive(self, w: WorkItem) -> None:
        req = Request(
            w.id,
            w.model,
            w.prompt,
            w.max_tokens or self.estimate.estimate(w.model),
            w.priority,
            w.session,
            w.precision,
            w.strict,
            w.arrival,
            max_tokens=w.max_tokens,
            blocks=w.blocks,
            adapter=w.adapter or "",
        )
        self.requests[w.id] = req
        if req.adapter and self.load_first(req, w.arrival):
            return
        self.sched.submit(req)

    def load_first(self, req: Request, now: float) -> bool:
        """Whether `req`'s adapter must be loaded before it can be routed: no server of its
        model has it, and one may load it at runtime. The load goes where route-serve's
        Loader puts it (the server with the fewest adapters loaded, then the fewest requests
        in flight) and takes the engine's read from disk; the request waits for it."""
        name = req.adapter
        if name in self.parked:
            self.parked[name].append(req)
            return True
        ours = [b for b in self.backends if b.model == req.model and b.healthy]
        if any(name in b.adapters for b in ours):
            return False
        fit = [
            b
            for b in ours
            if (lora := self.servers[self.index[b.name]].lora) is not None
            and lora.runtime
            and any(a == name for a, _ in lora.ranks)
        ]
        if not fit:
            return False  # the router's 404: eligible names it
        b = min(fit, key=lambda b: (len(b.adapters), b.outstanding, b.name))
        i = self.index[b.name]
        cost = self.engines[i].lora
        assert cost is not None
        heapq.heappush(self.loads, (now + cost.disk_s(self.rank(i, name)), name, i))
        self.parked[name] = [req]
        self.runtime_loads[name] = self.runtime_loads.get(name, 0) + 1
        return True

    def loaded(self, at: float, name: str, i: int) -> None:
        """A runtime load landed: the server lists the adapter, its CPU cache holds it, and
        the requests that waited for it go to the router."""
        b = self.backends[i]
        b.adapters = b.adapters | {name}
        self.engines[i].add_lora(name, self.rank(i, name))
        for req in self.parked.pop(name, []):
            self.sched.submit(req)

    def rank(self, i: int, adapter: str) -> int:
        """The rank of `adapter` as server `i` may load it (its slots' rank if unknown)."""
        lora = self.servers[i].lora
        if lora is None:
            return 0
        return next((r for a, r in lora.ranks if a == adapter), lora.max_rank)

    def reschedule(self, i: int) -> None:
        self.version[i] += 1
        t = self.engines[i].next_event()
        if t is not None:
            heapq.heappush(self.heap, (t, self.version[i], i))
        self.dirty.add(i)

    def settle(self, i: int, finished: list[Seq], now: float) -> None:
        """Engine `i`'s first tokens and finished sequences, told to its backend, the
        scheduler's TTFT window and the output estimator."""
        e, b = self.engines[i], self.backends[i]
        for s in e.first_tokens:
            req = self.requests[s.req]
            if s.req in self.remote:  # a decode server's first token: its client's first
                self.outcomes[s.req].first_token = s.first_token_at
            else:
                first_token(b, req)
            if s.req in self.prefilling:
                continue  # that token is the prefill server's: the decode server samples anew
            at = s.first_token_at or now
            # Aging compares waiting to the backends' TTFT (dispatch to first token), not to
            # TTFT seen by clients: that includes router queueing and grows with the backlog.
            self.sched.observe_ttft(at, at - (self.outcomes[s.req].dispatched or req.arrival))
        e.first_tokens.clear()
        for s in finished:
            if self.prefilling.get(s.req) == i:  # the prompt is done: its KV goes to decode
                del self.prefilling[s.req]
                release(b, self.requests[s.req])
                self.outcomes[s.req].prefilled = s.finished_at
                self.to_decode(s.req, i, now)
                continue
            o = self.outcomes[s.req]
            if s.req not in self.remote:
                o.first_token = s.first_token_at
            o.finished = s.finished_at
            self.done_since.append(o)
            o.preemptions += s.preemptions
            release(b, self.requests[s.req])
            self.estimate.observe(o.item.model, o.item.output)

    def refresh(self) -> None:
        """The backends' snapshots of the engines that changed, as a scrape would read them."""
        for i in self.dirty:
            e, b = self.engines[i], self.backends[i]
            b.running, b.waiting, b.kv_usage = e.num_running, e.num_waiting, e.kv_usage
            b.bandwidth_util, b.compute_util = e.utilization()
            if e.lora is not None:  # vllm:lora_requests_info, as a scrape reads it
                b.lora_running = frozenset(e.lora_running)
                b.lora_waiting = frozenset(s.adapter for s in e.waiting if s.adapter)
        self.dirty.clear()

    def dispatch(self, now: float) -> None:
        self.refresh()
        sent, rejected = self.sched.dispatch(now, self.backends)
        for b in self.sched.take_woken():
            # The router chose a sleeping server (none awake, or every awake one would
            # miss): it asks the wake, as route-serve POSTs /wake_up, and holds the request.
            self.apply(Control(now, b.name, "wake", b.wake_s or 0.0), now, by_router=True)
        for d in rejected:
            o = self.outcomes[d.request.id]  # type: ignore[index]
            o.rejected = d.decision.reason
        for d in sent:
            req = d.request
            i = self.index[d.decision.backend.name]  # type: ignore[union-attr]
            o = self.outcomes[req.id]  # type: ignore[index]
            o.backend, o.dispatched, o.boosted = self.backends[i].name, now, req.boosted
            key = d.decision.label
            self.reasons[key] = self.reasons.get(key, 0) + 1
            item = o.item
            limit = self.servers[i].max_model_len
            if item.prompt + item.output > limit:
                # vLLM refuses it with a 400; the router reports it, the engine never sees it.
                o.rejected = f"prompt + output exceeds max_model_len {limit}"
                release(self.backends[i], req, first_token_seen=False)
                continue
            if d.decision.kind == PREFILL:  # one token there, then the rest elsewhere
                self.prefilling[req.id] = i  # type: ignore[index]
                seq = Seq(req.id, item.prompt, 1, item.blocks)
            else:
                seq = Seq(req.id, item.prompt, item.output, item.blocks)
            if item.adapter:
                seq.adapter, seq.rank = item.adapter, self.rank(i, item.adapter)
            self.settle(i, self.engines[i].add(seq, now), now)
            self.reschedule(i)
        self.retry_decode(now)

    def to_decode(self, rid: int, p: int, now: float) -> None:
        """A prompt prefilled on engine `p`: a decode server takes its KV cache, or it waits
        for one with room."""
        req = self.requests[rid]
        self.refresh()
        decision = self.sched.decode_for(req, self.backends)
        if decision is None:
            self.awaiting.append((rid, p))
            return
        o = self.outcomes[rid]
        if decision.backend is None:
            o.rejected = decision.reason
            return
        j = self.index[decision.backend.name]
        o.backend = decision.backend.name
        self.reasons[decision.label] = self.reasons.get(decision.label, 0) + 1
        # The transfer queues on the prefill node's NIC behind the ones before it.
        src, dst = self.servers[p], self.servers[j]
        link = src.link.between(dst.link) if src.link and dst.link else None
        nbytes = src.perf.kv_token_bytes * src.perf.tp * req.prompt_tokens
        start = max(now, self.nic_free.get(src.node, 0.0))
        end = start + (link.seconds(nbytes) if link is not None and src.node != dst.node else 0.0)
        self.nic_free[src.node] = end
        heapq.heappush(self.transfers, (end, rid, j))

    def landed(self, at: float, rid: int, j: int) -> None:
        """A KV transfer is done: the decode engine takes the request, its prompt computed
        but for the last token (as vLLM's decode server recomputes it)."""
        item = self.outcomes[rid].item
        seq = Seq(rid, item.prompt, item.output, item.blocks)
        seq.external = max(0, item.prompt - 1)
        self.remote.add(rid)
        self.settle(j, self.engines[j].add(seq, at), at)
        self.reschedule(j)

    def retry_decode(self, now: float) -> None:
        """Prefilled requests waiting for a decode server's room, in the order they waited."""
        waiting, self.awaiting = self.awaiting, []
        for rid, p in waiting:
            self.to_decode(rid, p, now)


def _engine(s: Server) -> Engine:
    lora = s.lora
    e = Engine(
        s.perf,
        s.kv_tokens,
        s.max_num_seqs,
        s.max_num_batched_tokens,
        s.max_model_len,
        s.name,
        block_size=s.block_size,
        lora=LoraPerf(s.perf, lora.max_rank, s.perf.fmt.activation_bytes) if lora else None,
        max_loras=lora.max_loras if lora else 1,
        max_cpu_loras=lora.max_cpu_loras if lora else 0,
    )
    if lora is not None:
        ranks = dict(lora.ranks)
        for name in lora.preloaded:
            e.add_lora(name, ranks.get(name, lora.max_rank))
    return e


def _backend(s: Server) -> Backend:
    return Backend(
        s.name,
        s.node,
        s.gpu_type,
        s.model,
        s.variant,
        s.kv_tokens,
        s.max_num_seqs,
        s.perf,
        max_model_len=s.max_model_len,
        max_num_batched_tokens=s.max_num_batched_tokens,
        role=s.role,
        adapters=frozenset(s.lora.preloaded) if s.lora else frozenset(),
        lora_max=s.lora.max_loras if s.lora else 0,
        lora_rank=s.lora.max_rank if s.lora else 0,
        gpus=s.gpus,
    )


class _EngineCaches:
    """The prefix view of a router fed by every engine's KV events: exact, and current."""

    def __init__(self, engines: Sequence[Engine]):
        self.engines = {e.name: e for e in engines}
        # Prompts' keys by (prompt, block size): a policy asks about each queued prompt on
        # every backend, at every dispatch while it waits. The prompt is kept beside its keys
        # so its id is not reused while the entry lives.
        self._keys: dict[tuple[int, int], tuple[PromptBlocks, list[int]]] = {}

    def cached(self, backend: str, blocks: PromptBlocks) -> int:
        e = self.engines[backend]
        memo = (id(blocks), e.block_size)
        found = self._keys.get(memo)
        if found is None:
            if len(self._keys) >= 4096:
                self._keys.clear()
            found = self._keys[memo] = (blocks, engine_keys(blocks, e.block_size))
        return min(blocks.tokens, e.cached_tokens(found[1]))

    def routed(self, backend: str, blocks: PromptBlocks) -> None:
        pass  # the engines' caches change as they compute, not as requests are sent
