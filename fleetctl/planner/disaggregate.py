"""Prefill and decode on separate servers, or both on each: which serves a model's workload
within its SLO at the higher rate, from the one performance model and the network.

A colocated server prefills and decodes in the same steps: every prompt it takes stretches
the decode steps of the requests it is generating (DistServe's interference). At a rate of
`r` requests/s, a share `r x prefill` of its time goes to prefill, so a decode token takes
`step(B) / (1 - r x prefill)`, where the batch `B` holds the requests then decoding (Little:
`r x output x TPOT`). Its rate within a TPOT objective is the largest `r` that keeps that
under the objective.

Disaggregated, a prefill server only prefills (its rate is one over the prompt's prefill
time), the KV cache crosses the network (`kv bytes per token x prompt` at the link's speed,
which adds to the first token and bounds each prefill node's rate), and a decode server only
decodes: its batch is as large as its KV cache and the TPOT objective allow, and no prompt
stalls it. The pools' rate is the least of the prefill pool's, the links' and the decode
pool's; the split of servers between the pools is chosen to balance them.

Where the planner knows the model's traffic (its lengths and bursts) and its colocated
servers' goodput (planner/queueing.py: the capacity `plan` prints), a split is weighed by the
same model: its prefill pools are the queueing model's servers for the prompts alone (each
prompt only where its length fits, the TTFT objective less the transfer), so a long-prompt
tail that only one class holds bounds the split as it bounds the colocated servers; its
decode pools are its servers for the outputs alone (the TPOT tail of the batch they hold, no
prompt stalling it, in a KV cache that must hold the batch's own lengths: `kv_batch`); and
the split's rate is the highest at which the SLO's share meets both, within the links'
rates. Without them, every request is the mean one.

The rule (`decide`): with `disaggregation: on`, split whenever both pools can exist; with
`auto` (the default), by the model's SLO, stated or derived (disaggregation trades the first
token's latency, a network hop and a GPU's generality for the requests that meet both
objectives: an SLO is what weighs that), where the fleet gives the model two classes of GPU
or more, the first token still meets the TTFT objective after the transfer, and the split
serves at least GAIN x the colocated rate (and more than nothing) and, past the rate where
the colocated servers miss the SLO, up to the workload's rate, never a smaller share within
it than they do (`_falls_short`). Otherwise the servers stay colocated, and the reason says
why.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from fleetctl.fleet.inventory import Model
from fleetctl.fleet.slo import DEFAULT_SHARE, Slo
from fleetctl.model.perf import BLOCK_SIZE, EnginePerf, max_sequences
from fleetctl.planner.queueing import (
    BURST_WINDOW,
    STEPS,
    TPOT_QUANTILES,
    Group,
    Traffic,
    _rate_factors,
    attainment,
    goodput,
)

# How much more the split must serve than colocated servers under `auto`: a split costs a
# network hop per request, a second server's failure and GPUs that serve one phase only.
GAIN = 1.2
# How many rates, evenly up to the workload's rate (or the split's goodput where higher), a
# split's share within the SLO is weighed against colocated servers' at.
WEIGHED_RATES = 12
# A p99 TTFT objective held against a lone request's first token keeps this share as headroom
# (the planner's SLO_HEADROOM: queueing, longer prompts and bursts).
SLO_HEADROOM = 0.5
# The TPOT objective is a p99: both arrangements are held to it at that quantile of what
# varies per request (the prompts that stall a colocated request's steps, the batch a decode
# server holds), not by a flat headroom on the mean that would charge the steady decode-only
# server as much as the stalled colocated one.
TPOT_QUANTILE = 0.99
# Priors for moving a KV cache, not yet measured here: the share of the line rate a transfer
# gets (NIXL over UCX; RDMA reaches nearly all of it, TCP less) and a fixed cost per transfer
# (the side channel's handshake and the first bytes' latency).
LINK_EFFICIENCY = {True: 0.9, False: 0.7}
LINK_LATENCY_S = {True: 0.0002, False: 0.002}


# A request's KV on a decode server: (share of requests, prompt + output tokens).
Lengths = tuple[tuple[float, int], ...]


@dataclass(frozen=True)
class Link:
    """The network between two nodes: the slower NIC's line rate; RDMA where both have it."""

    gbps: float
    rdma: bool = False

    def seconds(self, nbytes: float) -> float:
        """One transfer of `nbytes` alone on the link."""
        rate = self.gbps * 1e9 / 8 * LINK_EFFICIENCY[self.rdma]
        return LINK_LATENCY_S[self.rdma] + nbytes / rate

    def between(self, other: Link) -> Link:
        return Link(min(self.gbps, other.gbps), self.rdma and other.rdma)


@dataclass(frozen=True)
class Pool:
    """The servers of one candidate (a class, format and TP size) a model was given: their
    engine, KV cache and batch limit, and the node network they sit on (None: unknown)."""

    key: int  # the candidate's index, to map a split back to deployments
    label: str  # "A100-SXM4-80GB bf16 TP=1", for the explanation
    servers: int
    perf: EnginePerf
    kv_tokens: int
    max_num_seqs: int
    link: Link | None
    servers_per_node: int = 1
    max_model_len: int | None = None  # None: it holds every request
    max_num_batched_tokens: int = 0  # a step's token budget (prefill chunks); 0: unbounded


@dataclass(frozen=True)
class Figures:
    """What one arrangement serves: requests/s within the SLO, and the first token and
    decode token time of a request at that rate's light end."""

    rate: float
    ttft_s: float
    tpot_s: float
    transfer_s: float = 0.0


@dataclass(frozen=True)
class Split:
    """A model's servers in two pools: per candidate key, how many prefill (the rest decode);
    with the traffic known, the pools as the queueing model sees them."""

    prefill: dict[int, int] = field(default_factory=dict)
    figures: Figures | None = None
    phases: _Phases | None = None


@dataclass(frozen=True)
class Goodput:
    """What weighs a split by the planner's capacity model: the model's traffic (lengths and
    bursts), its colocated servers' goodput on it, requests/s, and their share of requests
    within the SLO at any rate (`colocated_at`; None: not known)."""

    traffic: Traffic
    colocated_rps: float
    colocated_at: Callable[[float], float] | None = None


@dataclass(frozen=True)
class Choice:
    """What the planner does with a model's servers, and why in numbers."""

    disaggregate: bool
    colocated: Figures
    split: Split | None
    reason: str
    tpot_objective_s: float | None = None  # the TPOT objective it was weighed under
    held: Lengths = ()  # the request lengths a decode server's KV cache was sized for


def colocated(
    pool: Pool,
    prompt: int,
    output: int,
    tpot_s: float | None,
    ttft_s: float | None = None,
    quantile: float = TPOT_QUANTILE,
) -> Figures:
    """One colocated server of `pool`: its rate within the TPOT objective `tpot_s` (None:
    saturation) at its `quantile`, prefill interference counted, and none where even a
    request alone misses the TTFT objective `ttft_s`; TTFT and TPOT at light load."""
    p = pool.perf
    t_prefill = p.prefill_marginal(prompt)
    most = min(pool.max_num_seqs, max_sequences(pool.kv_tokens, prompt + output))
    budget = pool.max_num_batched_tokens
    light = Figures(0.0, p.prefill_time(prompt, chunk=budget), p.step_time(1, prompt + output / 2))
    if most < 1 or (ttft_s is not None and light.ttft_s > ttft_s * SLO_HEADROOM):
        return light
    ctx = prompt + output / 2

    def tpot(rate: float) -> float | None:
        """A request's TPOT at `rate` at the objective's quantile, or None where the server
        cannot keep up."""
        busy = rate * t_prefill
        if busy >= 1:
            return None
        t = p.step_time(1, ctx) / (1 - busy)
        for _ in range(60):  # the mean: the fixed point of T = step(rate x output x T) / (1 - busy)
            batch = rate * output * t
            if batch > most:
                return None
            nxt = p.step_time(max(1, math.ceil(batch)), max(1.0, batch) * ctx) / (1 - busy)
            if abs(nxt - t) < 1e-9:
                break
            t = nxt
        if tpot_s is None:
            return t
        # The tail: the prompts that arrive while a request decodes (Poisson over its
        # output x T seconds) each stall its steps by their prefill, on a batch that is
        # itself at its quantile. Both count the arrivals over one decode (Little), so one
        # quantile serves for both.
        high = poisson_quantile(rate * output * t, quantile)
        if high > most:
            return None
        tpot = p.step_time(max(1, high), max(1, high) * ctx) + high * t_prefill / output
        # No step is longer than one that fills the budget (--max-num-batched-tokens).
        return min(tpot, p.full_step(budget, high, ctx, prompt)) if budget else tpot

    lo, hi = 0.0, 1.0 / t_prefill
    for _ in range(50):  # the largest rate whose TPOT holds
        mid = (lo + hi) / 2
        t = tpot(mid)
        if t is not None and (tpot_s is None or t <= tpot_s):
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-6 * hi:
            break
    return Figures(lo, light.ttft_s, light.tpot_s)


def prefill_rate(pool: Pool, prompt: int) -> float:
    """Requests/s one prefill-only server of `pool` takes: its compute alone."""
    return 1.0 / pool.perf.prefill_marginal(prompt)


def decode_rate(
    pool: Pool,
    prompt: int,
    output: int,
    tpot_s: float | None,
    quantile: float = TPOT_QUANTILE,
    held: Lengths = (),
) -> float:
    """Requests/s one decode-only server of `pool` generates: the largest mean batch whose
    `quantile` (Poisson arrivals) fits its KV cache (prompt and output of each) and whose step
    there meets the TPOT objective, no prompt stalling it. With `held`, the workload's
    request lengths (share, prompt + output tokens), the KV cache must hold the batch's own
    lengths at the quantile (`kv_batch`), not its count times the mean request's."""
    p = pool.perf
    ctx = prompt + output / 2
    most = min(pool.max_num_seqs, max_sequences(pool.kv_tokens, prompt + output))
    if len(held) > 1:
        most = min(pool.max_num_seqs, kv_batch(pool.kv_tokens, held, quantile))
    best = 0.0
    for batch in range(1, most + 1):
        if tpot_s is not None:
            high = poisson_quantile(batch, quantile)
            # With the lengths known the KV cache bounds the mean batch, the engine its count.
            over = high > (pool.max_num_seqs if len(held) > 1 else most)
            if over or p.step_time(high, high * ctx) > tpot_s:
                break
        best = max(best, batch / (output * p.step_time(batch, batch * ctx)))
    return best


# The grid the KV a batch holds is counted on: this many steps up to the cache's size (a
# step is at least a KV block), four times as many in all so that the sum of the requests
# in flight does not wrap around.
KV_STEPS = 4096


@functools.lru_cache(maxsize=512)
def kv_batch(kv_tokens: int, held: Lengths, quantile: float) -> int:
    """The largest mean batch whose KV a cache of `kv_tokens` holds with probability
    `quantile`: the requests in flight are Poisson in number, each with its own length
    drawn from `held` (share, tokens), so their sum is compound Poisson, counted on a grid by
    its characteristic function. A heavy tail (Mooncake: the p99 prompt seven times the
    mean) holds far more at the quantile than the count's quantile times the mean request,
    which is what a decode server whose cache runs out queues requests on."""
    total = sum(share for share, _ in held)
    if total <= 0:
        return 0
    mean = sum(share * tokens for share, tokens in held) / total
    unit = max(BLOCK_SIZE, -(-kv_tokens // KV_STEPS))
    cap = kv_tokens // unit
    size = 1 << (4 * cap + 1).bit_length()
    pmf = np.zeros(size)
    for share, tokens in held:  # whole steps each, as vLLM allocates whole blocks
        pmf[min(size - 1, -(-tokens // unit))] += share / total
    spectrum = np.fft.rfft(pmf)

    def fits(batch: int) -> bool:
        if batch * mean > kv_tokens:
            return False
        dist = np.fft.irfft(np.exp(batch * (spectrum - 1.0)), size)
        return float(dist[: cap + 1].sum()) >= quantile

    lo, hi = 0, int(kv_tokens // mean) + 1  # fits(lo); not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(N <= k) >= q for N ~ Poisson(mean): how many requests a server
    holds, or how many prompts arrive in a span, at the objective's quantile."""
    if mean <= 0:
        return 0
    if mean > 200:  # the normal approximation; exp(-mean) would underflow
        return math.ceil(mean + NormalDist().inv_cdf(q) * math.sqrt(mean))
    k, term = 0, math.exp(-mean)
    cdf = term
    while cdf < q:
        k += 1
        term *= mean / k
        cdf += term
    return k


def transfer_bytes(pool: Pool, prompt: int) -> float:
    """The KV cache of a prompt, every tensor-parallel rank's share."""
    return pool.perf.kv_token_bytes * pool.perf.tp * prompt


def split_figures(
    pools: Sequence[Pool],
    prefill: dict[int, int],
    prompt: int,
    output: int,
    tpot_s: float | None,
    ttft_s: float | None = None,
    traffic: Traffic | None = None,
    share: float = DEFAULT_SHARE,
) -> Figures:
    """The rate the two pools serve together (the least of prefill, the prefill nodes' and
    the decode nodes' NICs, and decode),
    and a request's TTFT (prefill and transfer) and TPOT at light load. A prefill server
    whose first token, transfer included, misses the TTFT objective `ttft_s` adds nothing.
    With `traffic`, the rate is the split's goodput on it by the planner's queueing model."""
    return _figures(_limits(pools, prefill, prompt, output, tpot_s, ttft_s, traffic, share), share)


def _figures(limits: tuple[float, float, Figures, _Phases | None], share: float) -> Figures:
    """The split's figures from its `_limits`: its rate, both phases together."""
    up, down, light, phases = limits
    rate = min(up, down)
    if phases is not None:  # both phases together, within the links' rates
        rate = phases.goodput(share, rate)
    return Figures(rate, light.ttft_s, light.tpot_s, light.transfer_s)


@dataclass(frozen=True)
class _Phases:
    """A split's two pools as the planner's queueing model (planner/queueing.py) sees them:
    prefill servers that prefill only (one token out), each prompt only where its length
    fits, the first token their prefill and the slowest of the pools' KV transfers; decode
    servers that decode only, their TPOT tail that of the batch they hold (no prompt stalls
    it), on the workload's output lengths (their context is not checked: the prefill side
    already sends a prompt only where it fits). Both see its bursts."""

    prefill: tuple[Group, ...]
    prompts: Traffic
    ttft_s: float
    decode: tuple[Group, ...]
    outputs: Traffic
    links_rps: float = math.inf  # the KV transfers the NICs carry, requests/s

    @classmethod
    def of(
        cls,
        prefills: Sequence[tuple[Pool, int, float]],
        decodes: Sequence[tuple[Pool, int]],
        traffic: Traffic,
        prompt: int,
        output: int,
        ttft_s: float,
        tpot_s: float | None,
        links_rps: float = math.inf,
    ) -> _Phases:
        move = max((s for _, n, s in prefills if n > 0), default=0.0)
        prefill = tuple(
            Group(n, q.perf, q.kv_tokens, q.max_num_seqs, q.max_model_len or 1 << 40)
            for q, n, _ in prefills
            if n > 0
        )
        decode = tuple(
            Group(
                n,
                q.perf,
                q.kv_tokens,
                q.max_num_seqs,
                1 << 40,
                _decode_tails(q, prompt, output, tpot_s, lengths(traffic)),
            )
            for q, n in decodes
            if n > 0
        )
        prompts = Traffic(
            tuple((s, p, 1) for s, p, _ in traffic.points), traffic.burstiness, traffic.assumed
        )
        outputs = Traffic(
            tuple((s, 1, o) for s, o in traffic.outputs), traffic.burstiness, traffic.assumed
        )
        return cls(prefill, prompts, max(0.0, ttft_s - move), decode, outputs, links_rps)

    def prefill_goodput(self, share: float) -> float:
        """Requests/s the prefill servers serve within the TTFT objective for `share`."""
        return (
            goodput(self.prefill, self.prompts, self.ttft_s, None, share) if self.prefill else 0.0
        )

    def decode_goodput(self, share: float) -> float:
        """Requests/s the decode servers serve within the TPOT objective for `share`."""
        return goodput(self.decode, self.outputs, None, None, share) if self.decode else 0.0

    def goodput(self, share: float, most: float) -> float:
        """Requests/s, at most `most` (the least of each phase's goodput and the links'
        rates), at which `share` of requests meet both objectives (the two phases taken as
        independent)."""
        if not self.prefill or not self.decode:
            return 0.0
        met = self.attainment
        hi = most
        if hi <= 0:
            return 0.0
        if met(hi) >= share:
            return hi
        lo = 0.0
        for _ in range(STEPS):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if met(mid) >= share else (lo, mid)
            if hi - lo < 1e-4 * hi:
                break
        return lo

    def attainment(self, rate: float) -> float:
        """The share of requests that meet both objectives at `rate` requests/s."""
        if not self.prefill or not self.decode:
            return 0.0
        return (
            attainment(self.prefill, self.prompts, rate, self.ttft_s)
            * attainment(self.decode, self.outputs, rate, None)
            * self.carried(rate)
        )

    def carried(self, rate: float) -> float:
        """The share of requests whose KV transfer the NICs carry in time at `rate`: in a
        burst past the links' rate the transfers queue, growing by the excess over the
        burst's span, and only those sent before the queue outgrows the first token's slack
        make it (the queueing model's rule for its servers)."""
        if self.links_rps == math.inf:
            return 1.0
        ok = 0.0
        for weight, factor in _rate_factors(self.prompts.rate_cv2):
            rho = rate * factor / self.links_rps
            grow = (rho - 1.0) * BURST_WINDOW / (rate * factor)
            ok += weight * (1.0 if rho <= 1 else min(1.0, self.ttft_s / grow))
        return ok


def _decode_tails(
    pool: Pool, prompt: int, output: int, tpot_s: float | None, held: Lengths = ()
) -> tuple[tuple[float, float], ...]:
    """Per decode-only server, the requests/s at which each TPOT quantile reaches the
    objective, or its KV cache no longer holds the batch's lengths (`held`) at that quantile,
    with the share over it there (queueing.Group.tpot_rates); () without one."""
    if tpot_s is None:
        return ()
    return tuple(
        (decode_rate(pool, prompt, output, tpot_s, q, held), 1 - q) for q in TPOT_QUANTILES
    )


def lengths(traffic: Traffic | None) -> Lengths:
    """The KV each request of `traffic` holds on a decode server once answered: its prompt
    and output, by the shapes of its length distribution; () without one."""
    if traffic is None:
        return ()
    return tuple((share, prompt + output) for share, prompt, output in traffic.points)


def _limits(
    pools: Sequence[Pool],
    prefill: dict[int, int],
    prompt: int,
    output: int,
    tpot_s: float | None,
    ttft_s: float | None,
    traffic: Traffic | None,
    share: float,
) -> tuple[float, float, Figures, _Phases | None]:
    """The split's rates that grow with its prefill servers (prefill, the prefill nodes'
    NICs) and those that shrink (the decode nodes' NICs, decode), its light-load figures
    (rate 0), and with `traffic` its pools for the queueing model (the phases' rates then
    their goodput on it)."""
    p_rate = n_rate = in_rate = d_rate = 0.0
    ttft, tpot, move = math.inf, math.inf, 0.0
    prefills: list[tuple[Pool, int, float]] = []
    decodes: list[tuple[Pool, int]] = []
    decoders = [q for q in pools if q.servers - prefill.get(q.key, 0) > 0]
    for q in pools:
        n_p = prefill.get(q.key, 0)
        n_d = q.servers - n_p
        if n_p:
            links = [q.link.between(d.link) for d in decoders if q.link and d.link]
            link = min(links, key=lambda k: k.gbps) if links else None
            if link is None:
                return 0.0, 0.0, Figures(0.0, math.inf, math.inf), None
            seconds = link.seconds(transfer_bytes(q, prompt))
            first = q.perf.prefill_time(prompt) + seconds
            if first < ttft:
                ttft, move = first, seconds
            if ttft_s is not None and first > ttft_s * SLO_HEADROOM:
                continue
            p_rate += n_p * prefill_rate(q, prompt)
            prefills.append((q, n_p, seconds))
            # A node's NIC carries the transfers of every prefill server on it.
            n_rate += n_p / q.servers_per_node / seconds if seconds > 0 else math.inf
        if n_d:
            d_rate += n_d * decode_rate(q, prompt, output, tpot_s)
            decodes.append((q, n_d))
            tpot = min(tpot, q.perf.step_time(1, prompt + output / 2))
            # ... and a decode node's NIC receives the transfers of every decode server on it.
            arrive = q.link.seconds(transfer_bytes(q, prompt)) if q.link else math.inf
            in_rate += n_d / q.servers_per_node / arrive if arrive > 0 else math.inf
    phases = None
    if traffic is not None and ttft_s is not None:
        nics = min(n_rate, in_rate)
        phases = _Phases.of(prefills, decodes, traffic, prompt, output, ttft_s, tpot_s, nics)
        p_rate, d_rate = phases.prefill_goodput(share), phases.decode_goodput(share)
    light = Figures(0.0, ttft, tpot, move)
    return min(p_rate, n_rate), min(in_rate, d_rate), light, phases


def best_split(
    pools: Sequence[Pool],
    prompt: int,
    output: int,
    tpot_s: float | None,
    ttft_s: float | None = None,
    traffic: Traffic | None = None,
    share: float = DEFAULT_SHARE,
) -> Split:
    """The split of servers into prefill and decode that serves the highest rate: pools
    ordered by how much better they prefill than decode take the prefill share first, then
    every count of prefill servers is tried; with `traffic` (each count's prefill rate a
    goodput search), the count where the rates that grow with it meet those that shrink is
    found by bisection, and it and the one below are tried."""
    ratio = {
        q.key: prefill_rate(q, prompt) / max(decode_rate(q, prompt, output, tpot_s), 1e-12)
        for q in pools
    }
    order = sorted(pools, key=lambda q: -ratio[q.key])
    total = sum(q.servers for q in pools)

    def first(n: int) -> dict[int, int]:
        """n prefill servers, from the pools that prefill best."""
        prefill: dict[int, int] = {}
        left = n
        for q in order:
            take = min(left, q.servers)
            if take:
                prefill[q.key] = take
            left -= take
        return prefill

    known: dict[int, tuple[float, float, Figures, _Phases | None]] = {}

    def limits(n: int) -> tuple[float, float, Figures, _Phases | None]:
        if n not in known:
            known[n] = _limits(pools, first(n), prompt, output, tpot_s, ttft_s, traffic, share)
        return known[n]

    counts: Sequence[int] = range(1, total)
    if traffic is not None and total > 2:
        lo, hi = 1, total - 1  # the least count whose growing rates reach the shrinking ones
        while lo < hi:
            mid = (lo + hi) // 2
            up, down, _, _ = limits(mid)
            lo, hi = (lo, mid) if up >= down else (mid + 1, hi)
        counts = sorted({max(1, lo - 1), lo})
    best = Split()
    for n in counts:
        got = _figures(limits(n), share)
        if best.figures is None or got.rate > best.figures.rate:
            best = Split(first(n), got, limits(n)[3])
    return best


def _falls_short(
    split: Split, weigh: Goodput | None, model: Model, share: float
) -> tuple[float, float, float, float] | None:
    """The first rate at which the split serves a smaller share within the SLO than the
    colocated servers, where they miss it, by the queueing model: (rate, the split's share,
    colocated's, the highest rate weighed); None where it never does. Rates are weighed up to
    the workload's rate or the split's goodput, whichever is higher: a split whose pools
    bound it more tightly (a decode server's KV cache that holds few of a heavy tail's long
    requests) can serve more at the SLO's share and fall far below colocated servers just
    past it, at a rate the workload brings."""
    if weigh is None or weigh.colocated_at is None or split.phases is None:
        return None
    assert split.figures is not None
    w = model.spec.workload
    top = max(split.figures.rate, w.requests_per_s if w is not None else 0.0)
    for k in range(1, WEIGHED_RATES + 1):
        rate = top * k / WEIGHED_RATES
        mine = split.phases.attainment(rate)
        theirs = weigh.colocated_at(rate)
        if mine < min(theirs, share):
            return rate, mine, theirs, top
    return None


def decide(
    model: Model,
    pools: Sequence[Pool],
    prompt: int,
    output: int,
    classes: int,
    slo: Slo | None = None,
    weigh: Goodput | None = None,
) -> Choice:
    """Colocated or split for `model`'s servers (`pools`, on `classes` GPU types), and why,
    by `slo` (the one it is planned by: planner/candidates.py); with `weigh`, both ways'
    rates are goodput on the model's traffic by the planner's queueing model."""
    tpot_s = slo.tpot_s if slo is not None else None
    ttft_s = slo.ttft_s if slo is not None else None
    colo = [colocated(q, prompt, output, tpot_s, ttft_s) for q in pools]
    traffic = weigh.traffic if weigh is not None and slo is not None else None
    together = Figures(
        sum(f.rate * q.servers for f, q in zip(colo, pools, strict=True))
        if traffic is None or weigh is None
        else weigh.colocated_rps,
        min((f.ttft_s for f in colo), default=math.inf),
        min((f.tpot_s for f in colo), default=math.inf),
    )

    def choice(split_it: bool, why: str, split: Split | None = None) -> Choice:
        return Choice(split_it, together, split, why, tpot_s, lengths(traffic))

    mode = model.spec.disaggregation
    if mode == "off":
        return choice(False, "disaggregation: off")
    if sum(q.servers for q in pools) < 2:
        return choice(False, "one server: nothing to split")
    missing = [q.label for q in pools if q.link is None]
    if missing:
        return choice(
            False, f"no network speed known for {', '.join(missing)}: set nodes[].network"
        )
    share = slo.share if slo is not None else DEFAULT_SHARE
    split = best_split(pools, prompt, output, tpot_s, ttft_s, traffic, share)
    got = split.figures
    assert got is not None
    if mode == "on":
        return choice(got.rate > 0, "disaggregation: on", split)
    if slo is None:
        why = "no SLO: a split trades the first token's latency for requests within an SLO"
        return choice(False, why, split)
    if classes < 2:
        return choice(False, "one GPU type: a split would only halve its GPUs", split)
    if got.rate == 0 and ttft_s is not None and got.ttft_s > ttft_s * SLO_HEADROOM:
        why = (
            f"the KV transfer ({got.transfer_s:.2f} s) puts the first token at {got.ttft_s:.2f} s,"
            f" past the TTFT objective's share ({ttft_s * SLO_HEADROOM:.2f} s)"
        )
        return choice(False, why, split)
    if got.rate <= 0 and traffic is not None and slo is not None:
        why = (
            f"no split serves {slo.share:.0%} of requests within the SLO at any rate "
            f"(colocated: {together.rate:.2f} req/s)"
        )
        return choice(False, why, split)
    if got.rate < GAIN * together.rate:
        why = (
            f"a split serves {got.rate:.2f} req/s within the SLO against {together.rate:.2f} "
            f"colocated: less than {GAIN:g}x"
        )
        return choice(False, why, split)
    short = _falls_short(split, weigh, model, share)
    if short is not None:
        rate, mine, theirs, top = short
        why = (
            f"a split serves {got.rate:.2f} req/s within the SLO against {together.rate:.2f} "
            f"colocated, but past that it serves fewer within it: {mine:.1%} against "
            f"{theirs:.1%} at {rate:.2f} req/s (weighed up to {top:.2f})"
        )
        return choice(False, why, split)
    why = (
        f"a split serves {got.rate:.2f} req/s within the SLO against {together.rate:.2f} "
        f"colocated ({got.rate / together.rate:.2f}x); the KV transfer adds "
        f"{got.transfer_s * 1000:.0f} ms to the first token"
    )
    return choice(True, why, split)
