"""Routing policies: a request and backend snapshots in, a backend and a Decision out.

Deterministic: no clock, no network; randomness only from the policy's own seeded generator.
The daemon and the simulator call the same code. `hardware-aware` is the seed's scheduler;
the other policies, baselines and peers, are a module each in routing/policies/.

Kept whole because every policy's eligibility (health, length, the servers' warm-up states)
is the base class's, and hardware-aware's filters and warm-up weighing build on it step by step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.slo import DEFAULT_OUTPUT, objectives
from fleetctl.model.perf import EnginePerf
from fleetctl.routing.goodput import (
    Effect,
    Slo,
    adapter_wait_s,
    cost,
    deciding_term,
    effect,
    lora_step_s,
    queued_prefill_s,
)
from fleetctl.routing.prefix import NoPrefix, PrefixView
from fleetctl.routing.sessions import Pin, SessionTable
from fleetctl.routing.types import (
    ASLEEP,
    AWAKE,
    DECODE,
    PREFILL,
    Backend,
    Decision,
    Request,
    can_serve,
    gpus_held,
    held_gpus,
    precision_matches,
    warmup_s,
)


@dataclass
class RoutingConfig:
    long_context_tokens: int = 4096
    bandwidth_saturation: float = 0.85
    compute_saturation: float = 0.85
    # A backend class is "large-KV" when its KV capacity is at least this share of the largest.
    large_kv_share: float = 0.5
    # How much sooner a small-KV backend must promise a long request's first token to get it,
    # among servers of one max_model_len. Where their lengths differ (a model's min_context),
    # the lengths are the length classes: the penalty on top left the Mooncake trace's long
    # requests queueing for the A100s (p99 TTFT 97 s against 21.5 s at 70% load,
    # benchmarks/results/prefix_routing.md).
    long_small_kv_penalty: float = 4.0
    # Stay on the session's node (warm prefix cache) unless another is this much faster.
    affinity_slack_s: float = 0.25
    # Placements the share of each class's work that only it can do is averaged over.
    exclusive_window: int = 1000
    # Each model's objectives (its inventory `slo`, else the derived default): hardware-aware
    # weighs each phase's seconds against them (routing/goodput.py).
    slo: dict[str, Slo] = field(default_factory=dict)
    # Each model's mean output tokens: what a request in flight has to decode, against which
    # the seconds a placement adds to those requests are weighed (routing/goodput.py).
    mean_output: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        inv: Inventory,
        engines: Iterable[tuple[str, EnginePerf | None, int]] = (),
        shapes: Mapping[str, tuple[int, int]] | None = None,
    ) -> RoutingConfig:
        """The inventory's router settings and its models' SLOs: each model's stated one,
        else the default derived from `engines` (model, perf, max_model_len) that serve it,
        for `shapes`' mean prompt and output where given (fleetctl/fleet/slo.py)."""
        spec = inv.spec.router
        served: dict[str, list[tuple[EnginePerf, int]]] = {}
        for model, perf, max_len in engines:
            if perf is not None:
                served.setdefault(model, []).append((perf, max_len))
        slos = {}
        outputs = {}
        for m in inv.models:
            prompt, output = (shapes or {}).get(m.name, (None, None))
            if (slo := objectives(m, served.get(m.name, ()), prompt, output)) is not None:
                slos[m.name] = slo
            w = m.spec.workload
            outputs[m.name] = output or (w.mean_output_tokens if w else DEFAULT_OUTPUT)
        return cls(
            spec.long_context_tokens, spec.bandwidth_saturation, slo=slos, mean_output=outputs
        )


def is_split(backends: Sequence[Backend]) -> bool:
    """Whether these servers (a request's eligible ones) serve it in two phases
    (routing/phases.py)."""
    return any(b.role == PREFILL for b in backends) and any(b.role == DECODE for b in backends)


class Pool(list[Backend]):
    """The backends a request may go to, in order, and whether only some of its model's
    classes could take it at all (the others' max_model_len is too short): the work it brings
    is then work only they can do. `eligible` gives one; the scheduler narrows it and passes
    it to `choose`, so a policy never carries one request's state over to the next call."""

    def __init__(
        self, backends: Iterable[Backend] = (), exclusive: bool = False, now: float | None = None
    ) -> None:
        super().__init__(backends)
        self.exclusive = exclusive
        # The caller's clock (the scheduler sets it): what is left of a wake under way.
        self.now = now

    def narrowed(self, backends: Iterable[Backend]) -> Pool:
        """Fewer backends, the same verdict."""
        return Pool(backends, self.exclusive, self.now)


class Policy:
    """Base: which backends may serve a request at all, and which one to pick."""

    name = "base"
    admission = False  # whether the scheduler queues requests router-side (KV-derived caps)
    # What each backend has cached of a prompt (prefix-aware policies read it; the daemon
    # and the simulator set it); `routed` tells it where a prompt went.
    prefix: PrefixView = NoPrefix()
    reads_prefix = False  # whether it reads `prefix` (the daemon then hashes prompts)
    own_index = False  # whether it keeps an index of its own instead, as its peer does
    # Whether `choose` weighs a warm-up's seconds against the awake servers' (hardware-aware
    # does): then `eligible` offers the servers that are waking, starting or asleep beside
    # the awake ones; otherwise only the awake ones while there are any.
    weighs_warmup = False

    def __init__(self, prefix: PrefixView | None = None) -> None:
        if prefix is not None:
            self.prefix = prefix

    def eligible(self, req: Request, backends: Sequence[Backend]) -> tuple[Pool, str]:
        """Backends that could ever serve `req`: healthy, of its model, serving or able to
        (never a draining one, nor an asleep one without sleep mode), and with a
        max_model_len that takes prompt + max_tokens; an empty pool comes with the reason.
        The pool says whether that length left out some of the model's classes.

        Warm-ups: while any of them is awake, only the awake ones, unless the policy weighs
        a warm-up's seconds itself (`weighs_warmup`); with none awake, those waking or
        starting, else the asleep ones (the router then wakes the one chosen). This is the
        one place the rule lives, for every policy and the simulator alike."""
        found = [b for b in backends if b.model == req.model and b.healthy and can_serve(b)]
        # A sleeper whose GPUs another server holds cannot wake (out of memory) until it goes.
        if any(b.state == ASLEEP for b in found):
            held = held_gpus(backends)
            found = [b for b in found if b.state != ASLEEP or not gpus_held(b, held)]
        if req.adapter:
            found = [b for b in found if req.adapter in b.adapters]
        if not found and req.adapter:
            return Pool(), f"no healthy backend of {req.model} has adapter {req.adapter} loaded"
        if not found:
            if any(b.model == req.model and b.healthy for b in backends):
                return Pool(), (
                    f"no awake server serves {req.model}, and none can wake (draining, asleep "
                    f"without sleep mode, or on GPUs another server holds)"
                )
            return Pool(), f"no healthy backend serves {req.model}"
        need = req.context_needed
        fits = [b for b in found if not b.max_model_len or b.max_model_len >= need]
        if not fits:
            longest = max(b.max_model_len for b in found)
            return Pool(), (
                f"prompt ({req.prompt_tokens} tokens) + max_tokens needs a context of {need}; "
                f"the longest {req.model} serves is {longest}"
            )
        classes = {b.node_class for b in found}
        return Pool(
            warm_pool(fits, self.weighs_warmup), len({b.node_class for b in fits}) < len(classes)
        ), ""

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        raise NotImplementedError

    def decoding(self, req: Request, backend: Backend) -> None:
        """Told which server decodes a request a prefill server prefilled (for sessions)."""

    def placed(self, req: Request, backend: Backend, decision: Decision | None = None) -> None:
        """Told where a request went (for sessions and the prefix index), with the decision
        that sent it there: it expects the prefix it finds cached there, which its pending
        prefill leaves out (the decision's look-up when it was for this backend)."""
        if req.blocks is not None:
            if decision is not None and decision.backend is backend and decision.looked_up:
                req.cached_tokens = decision.cached_tokens
            else:
                req.cached_tokens = self.prefix.cached(backend.name, req.blocks)
            self.prefix.routed(backend.name, req.blocks)


def warm_pool(fits: list[Backend], weighs: bool) -> list[Backend]:
    """Of a request's servers, the ones a policy may pick by their state (Policy.eligible),
    role by role: a split model's prefill servers all asleep leave its decode servers split,
    not the only servers left."""
    if weighs:
        return fits
    out: list[Backend] = []
    for role in dict.fromkeys(b.role for b in fits):
        mine = [b for b in fits if b.role == role]
        awake = [b for b in mine if b.state == AWAKE]
        coming = [b for b in mine if b.state != ASLEEP]  # waking or starting: no second wake
        out += awake or coming or mine
    return out


@dataclass(slots=True)
class Placement:
    """One request's way through hardware-aware, as one value: the backends the filters
    kept and the notes they made, then each backend's cached prompt tokens, predicted effect
    and cost, then the pick."""

    request: Request
    pool: list[Backend]
    exclusive: bool  # only some of the model's classes could take it
    pin: Pin | None
    slo: Slo | None
    others_output: int | None = None  # the model's mean output (RoutingConfig.mean_output)
    notes: list[str] = field(default_factory=list)
    long: bool = False  # prompt + output past long_context_tokens
    small: set[str] = field(default_factory=set)  # the small-KV backends of the pool
    hits: dict[str, int] = field(default_factory=dict)
    effects: dict[str, Effect] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)


class HardwareAware(Policy):
    """The seed's scheduler: precision, session affinity to a node class, length class, and
    the predicted effect of each placement on time to first token and time per output token,
    the request's own and that of the requests already decoding there (routing/goodput.py):
    the seconds of latency the fleet's requests gain, each phase weighed against the model's
    SLO where it has one. `choose` filters, scores and picks, one `Placement` passing through."""

    name = "hardware-aware"
    admission = True
    reads_prefix = True
    weighs_warmup = True

    def __init__(
        self,
        config: RoutingConfig | None = None,
        sessions: SessionTable | None = None,
        prefix: PrefixView | None = None,
    ):
        super().__init__(prefix)
        self.config = config or RoutingConfig()
        self.sessions = sessions if sessions is not None else SessionTable()
        self._work: dict[str, tuple[float, float]] = {}  # class -> (exclusive, all) prefill
        self._now: float | None = None  # the clock of the pool being placed (Pool.now)

    def eligible(self, req: Request, backends: Sequence[Backend]) -> tuple[Pool, str]:
        """Healthy backends of the model; only the hinted format when strict; only the
        session's class while any of it is healthy (so a later turn waits for room there
        rather than switching model variants mid-conversation)."""
        found, why = super().eligible(req, backends)
        if not found:
            return found, why
        if req.precision:
            match = [b for b in found if precision_matches(req.precision, b.variant)]
            if req.strict and not match:
                formats = ", ".join(sorted({b.variant for b in found}))
                return (
                    Pool(),
                    f"no backend serves {req.model} in {req.precision} (it runs {formats})",
                )
            if req.strict:
                found = found.narrowed(match)
        pin = self.sessions.get(req.session) if req.session else None
        if pin is not None and is_split(found):
            # A split model's session keeps the class that decodes its turns (its answers
            # come from there), and every prefill server: it stays split.
            keep = [b for b in found if b.role != DECODE or b.node_class == pin.node_class]
            if any(b.role == DECODE for b in keep):
                found = found.narrowed(keep)
        elif pin is not None:
            same = [b for b in found if b.node_class == pin.node_class]
            # A session's class that is all asleep does not wake while another is awake.
            if any(b.state == AWAKE for b in same) or not any(b.state == AWAKE for b in found):
                found = found.narrowed(same or found)
        return found, ""

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        self._now = backends.now if isinstance(backends, Pool) else None
        # Warm-ups first: a session's class or a preferred format found only on sleepers
        # must not wake one while an awake server meets the objective.
        p = self._placement(req, backends)
        self._awake_first(p)
        self._filter(p)
        self._score(p)
        return self._pick(p)

    def _awake_first(self, p: Placement) -> None:
        """Only the awake servers while one of them is predicted to meet the model's TTFT
        objective (any awake one, without an objective); else the waking, starting and
        asleep ones compete too, each with its warm-up's seconds in its first token."""
        awake = [b for b in p.pool if b.state == AWAKE]
        if not awake or len(awake) == len(p.pool):
            return
        limit = p.slo.ttft_s if p.slo is not None else None
        if limit is None or any(self.estimate(b, p.request) <= limit for b in awake):
            p.pool = awake
        else:
            p.notes.append("awake:miss")

    def _placement(self, req: Request, backends: Sequence[Backend]) -> Placement:
        exclusive = isinstance(backends, Pool) and backends.exclusive
        pin = self.sessions.get(req.session) if req.session else None
        cfg = self.config
        return Placement(
            req,
            list(backends),
            exclusive,
            pin,
            cfg.slo.get(req.model),
            cfg.mean_output.get(req.model),
        )

    def _filter(self, p: Placement) -> None:
        """The backends this request prefers among those it may go to: the hinted format
        (not strict: when one runs it), the session's class (while one of it is left)."""
        req, pin = p.request, p.pin
        if req.precision and not req.strict:
            match = [b for b in p.pool if precision_matches(req.precision, b.variant)]
            p.notes.append("precision:prefer" if match else "precision:unavailable")
            p.pool = match or p.pool
        elif req.precision:
            p.notes.append("precision:strict")
        if pin is not None:
            same = [b for b in p.pool if b.node_class == pin.node_class]
            if same:
                p.pool = same
                p.notes.append("affinity:class")
            else:
                p.notes.append("affinity:class-gone")

    def _score(self, p: Placement) -> None:
        """Each backend's cached prompt tokens, the effect of placing the request there as
        the length rules weigh it, and its cost."""
        cfg, req = self.config, p.request
        long = req.total_tokens > cfg.long_context_tokens
        top = max(b.kv_tokens for b in p.pool)
        small = {b.name for b in p.pool if b.kv_tokens < cfg.large_kv_share * top}
        one_length = len({b.max_model_len for b in p.pool}) == 1
        # What each backend has cached of the prompt, looked up once per decision.
        p.hits = {b.name: self.cached(b, req) for b in p.pool}
        # A request other classes could take too pays, on a class, for the delay it would
        # cause there to work only that class can do (the longest prompts, on the class with
        # the longest max_model_len), which has nowhere else to go: its prefill, once for
        # each request waiting there and the next to come, times the share of the class's
        # recent work that was exclusive. Without per-class lengths no work is exclusive.
        spread = len({b.node_class for b in p.pool}) > 1 and not p.exclusive
        for b in p.pool:
            e = self.predict(b, req, p.hits[b.name])
            # Among servers of one length, long requests prefer the large-KV class: a small-KV
            # backend must promise a first token `long_small_kv_penalty` times sooner.
            slow = cfg.long_small_kv_penalty if long and one_length and b.name in small else 1.0
            extra = 0.0
            if spread and b.perf is not None:
                share = self.exclusive_share(b.node_class)
                own = b.perf.prefill_marginal(req.prompt_tokens - p.hits[b.name], p.hits[b.name])
                extra = share * own * (1 + b.waiting)
            p.effects[b.name] = replace(e, ttft_s=e.ttft_s * slow + extra)
            p.costs[b.name] = cost(p.effects[b.name], req, p.slo, p.others_output)
        p.long, p.small = long, small

    def _pick(self, p: Placement) -> Decision:
        """The cheapest backend, named by the term that set it apart from the next; the
        session's own node instead while it costs no more than the best would with its first
        token `affinity_slack_s` later (its warm prefix cache)."""
        req = p.request
        ranked = sorted(p.pool, key=lambda b: (p.costs[b.name], b.name))
        best = ranked[0]
        if not p.long:
            p.notes.append("length:short")
        elif not p.small:
            p.notes.append("length:long")
        else:
            p.notes.append(f"length:long->{'small' if best.name in p.small else 'large'}-kv")
        if len(ranked) > 1:
            term = deciding_term(
                p.effects[best.name], p.effects[ranked[1].name], req, p.slo, p.others_output
            )
            p.notes.append(f"by:{term}")
        if p.pin is not None:
            home = next((b for b in p.pool if b.node == p.pin.node), None)
            if home is not None and home is not best:
                e = p.effects[best.name]
                later = replace(e, ttft_s=e.ttft_s + self.config.affinity_slack_s)
                if p.costs[home.name] <= cost(later, req, p.slo, p.others_output):
                    best = home
                    p.notes.append("affinity:node")
        if p.hits[best.name]:
            p.notes.append("prefix:hit")
        if best.state == ASLEEP:
            p.notes.append("wake")
        elif best.state != AWAKE:
            p.notes.append("waking")
        e = self.predict(best, req, p.hits[best.name])
        return Decision(
            best,
            self.name,
            tuple(p.notes),
            ttft_s=e.ttft_s,
            tpot_s=e.tpot_s,
            cached_tokens=p.hits[best.name],
            looked_up=True,
            exclusive=p.exclusive,
        )

    def exclusive_share(self, node_class: str) -> float:
        """Of the prefill work recently placed on a class, the share no other class could
        have taken."""
        excl, total = self._work.get(node_class, (0.0, 0.0))
        return excl / total if total else 0.0

    def cached(self, b: Backend, req: Request) -> int:
        """Prompt tokens `b` holds of `req` (at most all but the last, which vLLM always
        computes)."""
        if req.blocks is None:
            return 0
        return min(self.prefix.cached(b.name, req.blocks), req.prompt_tokens - 1)

    def estimate(self, b: Backend, req: Request, cached: int | None = None) -> float:
        """Seconds until `req` would see its first token on `b`; `cached`: prompt tokens `b`
        holds of it (looked up when not given)."""
        return self.predict(b, req, cached).ttft_s

    def predict(self, b: Backend, req: Request, cached: int | None = None) -> Effect:
        """What placing `req` on `b` does to its latency and to the requests there."""
        cfg = self.config
        perf = b.perf
        if perf is None:  # no model of this GPU: fall back to capacity-normalized load
            load = b.outstanding / max(1, b.max_num_seqs)
            return Effect(load + warmup_s(b, self._now), 0.0, 0.0, 0.0, 0.0)
        # Prompt tokens ahead of ours (each its own sequence: linear, at a typical context) and
        # ours, at the GPU's prefill speed. What this server has cached of our prompt is
        # prefill it skips: we compute only the rest, attending to the cached part. A server
        # not awake starts on it after its warm-up: what is left of a wake or start under
        # way, or a whole wake from its sleep level.
        wait = queued_prefill_s(b) + warmup_s(b, self._now)
        if cached is None:
            cached = self.cached(b, req)
        # As much of it as this server really finds of what the router expects it to hold
        # (1 when KV events say exactly; less where an index of placements overstates it).
        cached = int(cached * b.prefix_trust)
        wait += perf.prefill_marginal(req.prompt_tokens - cached, cached)
        # The decode batch this request joins: what is in flight (its KV, as far as the cache
        # holds it) and this request at half its output. Its steps slow our prefill too.
        batch = max(b.outstanding, b.running) + 1
        kv = min(b.reserved_tokens, max(1, b.kv_tokens)) + req.prompt_tokens
        step = perf.step_time(batch, kv + req.output_tokens // 2)
        step += lora_step_s(b, req.adapter, batch)  # the adapters' kernels, its own too
        # KV: if what is in flight plus this request overflows the cache, it waits for room
        # (or forces preemptions): about one request's decode per overflowing request, of
        # the requests in flight (the model's mean output), whose ends free the room. Its
        # own output read a 46K prompt's wait for room on a busy RTX 4090 as under a second
        # for its 25-token answer; it waited 13 s (benchmarks/results/prefix_routing.md).
        over = (b.reserved_tokens + req.total_tokens) / max(1, b.kv_tokens)
        if over > 1.0:
            theirs = cfg.mean_output.get(req.model) or req.output_tokens
            wait += (over - 1.0) * max(1, b.outstanding) * theirs * step
        # A LoRA adapter no GPU slot there holds waits for a slot, then for its load.
        wait += adapter_wait_s(b, req, step, cfg.mean_output.get(req.model))
        # Memory-bandwidth saturation: more work there adds latency but little throughput.
        # The simulator fills bandwidth_util from the perf model's decode work in flight; the
        # daemon measures it live as the rate of vllm:estimated_read_bytes_per_gpu_total over
        # the GPU's peak bandwidth (or DCGM_FI_DEV_MEM_COPY_UTIL), falling back to the perf
        # model applied to the scraped running-request count when that counter is missing.
        # Compute saturation (large batches on compute-rich GPUs): same reasoning. Past its
        # threshold, the share of the room above it in use is taken from this request's steps
        # (and those of the requests there): each decode step stretches by 1 / (1 - that
        # share), as a queue does near full use, at most SATURATED_SLOWDOWN times.
        excess = _past(b.bandwidth_util, cfg.bandwidth_saturation) + _past(
            b.compute_util, cfg.compute_saturation
        )
        slow = 1.0 / max(1.0 / SATURATED_SLOWDOWN, 1.0 - excess)
        return effect(b, req, cached, wait + step, step, slow)

    def placed(self, req: Request, backend: Backend, decision: Decision | None = None) -> None:
        super().placed(req, backend, decision)
        # The class's work, averaged over the last `exclusive_window` placements (all
        # classes age together, so a class that stops getting work keeps its share).
        decay = 1.0 - 1.0 / self.config.exclusive_window
        for k, (e, t) in self._work.items():
            self._work[k] = (e * decay, t * decay)
        e, t = self._work.get(backend.node_class, (0.0, 0.0))
        work = float(req.prefill_tokens)
        exclusive = decision is not None and decision.exclusive
        self._work[backend.node_class] = (e + (work if exclusive else 0.0), t + work)
        if backend.role != PREFILL:  # a prompt's server alone answers nothing: not pinned
            self._pin(req, backend)

    def decoding(self, req: Request, backend: Backend) -> None:
        self._pin(req, backend)

    def _pin(self, req: Request, backend: Backend) -> None:
        """The session's turns stay on the class (and node) that answered this one."""
        if req.session is None:
            return
        pin = self.sessions.get(req.session)
        if pin is None or pin.node_class != backend.node_class or pin.node != backend.node:
            self.sessions.set(req.session, Pin(backend.node_class, backend.node))


# How much slower than modelled a saturated GPU's steps may be taken to run (a measured
# utilization at or past full use).
SATURATED_SLOWDOWN = 10.0


def _past(util: float, threshold: float) -> float:
    """How far a utilization is past its saturation threshold, as a share of the room above
    it: 0 at or below the threshold, 1 at full use. A threshold of 1 (the inventory allows it)
    turns the penalty off, even where a measured rate reads a little over 1."""
    if threshold >= 1:
        return 0.0
    return max(0.0, util - threshold) / (1 - threshold)
