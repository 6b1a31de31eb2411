"""The capacity a plan promises: goodput at the SLO on the workload's lengths and bursts.

A model's capacity is the highest request rate at which its servers serve the SLO's share of
requests (`Slo.share`: 99% for p99 objectives unless the inventory states another) within both
objectives; the SLO is the stated one, else the one derived before placement
(planner/candidates.py, fleet/slo.py). It is computed here from the one
performance model, by a queueing model of the servers:

- Lengths: the workload's prompt and output quantiles (p50, p90, p99, longest) become a small
  histogram of request shapes (`Traffic.points`); without quantiles, every request is the mean
  shape (the stated assumption). A shape longer than a class's max_model_len goes only to the
  classes that hold it, whatever the others could take: that tail gets capacity of its own.
- Bursts: arrivals are Poisson within short spans at a rate that itself varies. `burstiness`
  is the index of dispersion (variance over mean) of the request count in windows holding
  BURST_WINDOW requests on average (1: Poisson); the rate's squared coefficient of variation
  is then (burstiness - 1) / BURST_WINDOW, and a request sees the rate size-biased: more
  requests arrive in a burst. The servers are judged quasi-statically at each rate a request
  may see (a lognormal of that variance, by quadrature).
- TTFT: each class's servers are an M/G/c queue of prefill work (Allen-Cunneen, with
  Sakasegawa's probability of waiting), the work stretched by the share of the servers' time
  that decoding takes, the service's variability from the prompt lengths; the waiting time's
  tail is exponential. A request meets the objective when its wait and its own prefill fit.
  In a burst past the servers the backlog grows by the excess over the burst's span, and the
  requests that come before it outgrows their slack still make it; past them on average,
  none does.
- TPOT: the rates at which one colocated server's TPOT quantiles (p99.9 to the median) reach
  the objective (planner/disaggregate.py, Poisson arrivals of the mean shape) give the share
  over it at any rate; and the prompts that arrive while a short answer decodes stall it
  (Poisson over its decode span: one whose prefill exceeds what the answer's tokens absorb,
  or several together, push it over). No step carries more tokens than the servers'
  --max-num-batched-tokens, so where a step that fills it meets the objective no answer is
  pushed over, and a prompt's first token waits for all of its chunks' steps.
- Routing: the shapes every class takes fill the classes to equal utilization of what each
  serves within the TPOT objective (a router that knows the SLO).

Only a model with no candidate server at all has no SLO; its capacity, 0 anyway, is the
saturation throughput of the mean request.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from fleetctl.fleet.inventory import Model, WorkloadSpec
from fleetctl.fleet.slo import DEFAULT_SHARE
from fleetctl.model.perf import EnginePerf

# `burstiness` counts arrivals in windows that hold this many requests on average: a span
# that does not change when a trace is replayed faster or slower (simulate --rate).
BURST_WINDOW = 100
# The TPOT quantiles whose rates a server's TPOT tail is interpolated between.
TPOT_QUANTILES = (0.999, 0.99, 0.9, 0.5)
# Quadrature points over the rate a request sees, and the bisection's steps on the rate.
RATE_POINTS = 24
STEPS = 40
# The quantiles a length histogram is cut at (each point's share, and the quantile it sits at).
_CUTS = (
    *((0.1, 0.05 + 0.1 * i) for i in range(9)),
    *((0.01, 0.905 + 0.01 * i) for i in range(9)),
    (0.01, 0.995),
)


# Output lengths weigh the stalls of TPOT: the short answers matter, and fewer points do.
_OUTPUT_CUTS = ((0.2, 0.1), (0.2, 0.3), (0.2, 0.5), (0.2, 0.7), (0.1, 0.85), (0.1, 0.95))


@dataclass(frozen=True)
class Traffic:
    """A model's requests as the queueing model sees them: shapes (share, prompt, output),
    the rate's burstiness, and what was assumed where the workload did not say."""

    points: tuple[tuple[float, int, int], ...]
    burstiness: float
    assumed: tuple[str, ...] = ()
    # Output lengths (share, tokens): a short answer spreads a prompt's stall over few tokens.
    outputs: tuple[tuple[float, int], ...] = ((1.0, 1),)

    def within(self, max_len: int) -> Traffic:
        """The shapes that fit `max_len` tokens, their shares scaled back to one."""
        fit = [(s, p, o) for s, p, o in self.points if p + o <= max_len]
        total = sum(s for s, _, _ in fit)
        if not fit or total >= 1:
            return self
        return Traffic(
            tuple((s / total, p, o) for s, p, o in fit),
            self.burstiness,
            self.assumed,
            self.outputs,
        )

    @property
    def rate_cv2(self) -> float:
        return max(0.0, self.burstiness - 1.0) / BURST_WINDOW


def _quantile(knots: Sequence[tuple[float, float]], u: float) -> float:
    """The length at quantile `u`, log-linear between the known quantiles."""
    for (u0, v0), (u1, v1) in itertools.pairwise(knots):
        if u <= u1:
            f = (u - u0) / (u1 - u0) if u1 > u0 else 1.0
            return math.exp(math.log(v0) + f * (math.log(v1) - math.log(v0)))
    return knots[-1][1]


def _knots(
    mean: int, p50: int | None, p90: int | None, p99: int | None, top: int | None
) -> tuple[tuple[float, float], ...] | None:
    """(quantile, tokens) knots of a length distribution, or None where none is stated."""
    if p50 is None and p90 is None and p99 is None:
        return None
    p50 = p50 or min(mean, p90 or mean, p99 or mean)
    p90 = max(p50, p90 or p50)
    p99 = max(p90, p99 or p90)
    top = max(p99, top or round(p99 * (p99 / p90) ** 0.5))
    low = max(1.0, p50 * p50 / p90)
    return ((0.0, low), (0.5, float(p50)), (0.9, float(p90)), (0.99, float(p99)), (1.0, float(top)))


def traffic_of(model: Model, default: tuple[int, int]) -> Traffic:
    """The model's workload as shapes and burstiness; `default` is the mean shape assumed
    without a workload."""
    w: WorkloadSpec | None = model.spec.workload
    assumed: list[str] = []
    if w is None:
        assumed = ["no workload: a mean request", "Poisson arrivals"]
        return Traffic(((1.0, *default),), 1.0, tuple(assumed), ((1.0, default[1]),))
    prompts = _knots(
        w.mean_prompt_tokens,
        w.prompt_tokens_p50,
        w.prompt_tokens_p90,
        w.prompt_tokens_p99,
        w.max_prompt_tokens,
    )
    outputs = _knots(
        w.mean_output_tokens, w.output_tokens_p50, w.output_tokens_p90, w.output_tokens_p99, None
    )
    if prompts is None:
        assumed.append("every prompt the mean length")
    if outputs is None:
        assumed.append("every output the mean length")
    burst = w.burstiness
    if burst is None:
        assumed.append("Poisson arrivals")
    points: list[tuple[float, int, int]] = []
    for share, u in _CUTS if prompts is not None or outputs is not None else ((1.0, 0.5),):
        p = round(_quantile(prompts, u)) if prompts else w.mean_prompt_tokens
        # Output lengths paired with prompts by rank would overstate the long requests'
        # KV; independent, each prompt point takes the mean output and the outputs' spread
        # enters through the decode's mean (the TPOT objective is per token).
        points.append((share, max(1, p), w.mean_output_tokens))
    lengths = (
        [(s, max(1, round(_quantile(outputs, u)))) for s, u in _OUTPUT_CUTS] if outputs else []
    )
    return Traffic(
        tuple(points),
        1.0 if burst is None else burst,
        tuple(assumed),
        tuple(lengths) or ((1.0, w.mean_output_tokens),),
    )


@dataclass(frozen=True)
class Group:
    """A model's servers of one kind (class, format, TP): how many, and their engine."""

    servers: int
    perf: EnginePerf
    kv_tokens: int
    max_num_seqs: int
    max_model_len: int
    # Per server, (requests/s, share over the TPOT objective there), rates rising; (): none.
    tpot_rates: tuple[tuple[float, float], ...] = ()
    # Their --max-num-batched-tokens: no step carries more tokens, decodes included (a
    # prompt is prefilled in chunks of it); 0: unbounded.
    max_num_batched_tokens: int = 0

    def tpot_misses(self, rate: float) -> float:
        """The share of requests over the TPOT objective at `rate` requests/s a server,
        linear between the rates its quantiles reach the objective; all of them at twice
        the rate of the median's."""
        knots = [(0.0, 0.0), *self.tpot_rates]
        if not self.tpot_rates:
            return 0.0
        for (r0, m0), (r1, m1) in itertools.pairwise(knots):
            if rate <= r1:
                return m0 if r1 <= r0 else m0 + (m1 - m0) * (rate - r0) / (r1 - r0)
        last, miss = knots[-1]
        return min(1.0, miss + (1.0 - miss) * (rate - last) / max(last, 1e-9))

    def slowdown(self, saturation: float) -> float:
        """How far below `saturation` (requests/s a server) the TPOT objective's p99 holds
        it: 1 where it does not."""
        held = [r for r, miss in self.tpot_rates if abs(miss - 0.01) < 1e-9]
        return max(1.0, saturation / held[0]) if held and held[0] > 0 else 1.0

    def seconds(self, prompt: int, output: int) -> float:
        """A request's share of one server's time at saturation (1 / capacity for its shape)."""
        cap = self.perf.capacity_rps(
            prompt, output, self.kv_tokens, self.max_num_seqs, self.max_num_batched_tokens
        )
        return math.inf if cap <= 0 else 1.0 / cap


@dataclass(frozen=True)
class _Fixed:
    """A group's figures per request shape, computed once per goodput search."""

    group: Group
    takes: tuple[bool, ...]
    seconds: tuple[float, ...]  # share of a server's time at saturation
    prefill: tuple[float, ...]  # marginal prefill compute
    alone: tuple[float, ...]  # the prefill of a prompt alone (its first token on an idle server)
    # Per output length: (share, its decode span (tokens x step), the stall its tokens absorb
    # within the TPOT objective, the share of prompts whose prefill alone exceeds that); an
    # output whose full step (one that fills the budget) meets the objective is left out.
    stalls: tuple[tuple[float, float, float, float], ...] = ()
    mean_prefill: float = 0.0

    @classmethod
    def of(cls, g: Group, traffic: Traffic, tpot_s: float | None) -> _Fixed:
        points = traffic.points
        prefill = tuple(g.perf.prefill_marginal(p) for _, p, _ in points)
        mean_prefill = sum(s * x for (s, _, _), x in zip(points, prefill, strict=True))
        stalls = []
        budget = g.max_num_batched_tokens
        if tpot_s is not None:
            prompt = round(sum(s * p for s, p, _ in points))
            for share, out in traffic.outputs:
                step = g.perf.step_time(1, prompt + out / 2)
                # No step carries more than the budget's tokens, so an answer whose longest
                # step meets the objective is never pushed over, however many prompts come.
                if budget and g.perf.full_step(budget, 1, prompt + out / 2, prompt) <= tpot_s:
                    continue
                absorb = (tpot_s - step) * max(1, out - 1)
                over = sum(s for (s, _, _), x in zip(points, prefill, strict=True) if x > absorb)
                stalls.append((share, out * step, absorb, over))
        return cls(
            g,
            tuple(p + o <= g.max_model_len for _, p, o in points),
            tuple(g.seconds(p, o) for _, p, o in points),
            prefill,
            tuple(g.perf.prefill_time(p, chunk=budget) for _, p, _ in points),
            tuple(stalls),
            mean_prefill,
        )

    def stalled(self, rate: float) -> float:
        """The share of requests whose TPOT the prompts arriving while they decode push over
        the objective, at `rate` requests/s a server: k arrivals (Poisson over the decode
        span) miss it where one of them alone is too long, or all k together."""
        missed = 0.0
        for share, span, absorb, over in self.stalls:
            if absorb <= 0:
                missed += share
                continue
            mean = rate * span
            # From k0 arrivals on, their prefills together exceed what the tokens absorb.
            k0 = math.floor(absorb / self.mean_prefill) + 1 if self.mean_prefill > 0 else 10**9
            last = min(k0 - 1, math.ceil(mean + 10 * math.sqrt(mean) + 10))
            term = cdf = math.exp(-mean)
            below = 0.0
            for k in range(1, last + 1):
                term *= mean / k
                cdf += term
                below += term * (1.0 - (1.0 - over) ** k)
            beyond = max(0.0, 1.0 - cdf) if last >= k0 - 1 else 0.0
            missed += share * (below + beyond)
        return min(1.0, missed)


def _erlang_wait(c: int, rho: float) -> float:
    """Sakasegawa's approximation of the probability that a request waits in M/M/c."""
    return rho ** (math.sqrt(2.0 * (c + 1)) - 1.0)


def _assign(
    fixed: Sequence[_Fixed], shares: Sequence[float], rate: float
) -> tuple[list[dict[int, float]], list[float]]:
    """Each shape's requests/s per group: a shape only some groups take is shared among
    them by their servers; the rest fill the groups to equal utilization (a router that
    balances load). Returns per group its rates by shape and its utilization."""
    rates: list[dict[int, float]] = [{} for _ in fixed]
    work = [0.0] * len(fixed)
    everywhere = [i for i in range(len(shares)) if all(f.takes[i] for f in fixed)]
    for i, share in enumerate(shares):
        if i in everywhere:
            continue
        able = [j for j, f in enumerate(fixed) if f.takes[i]]
        n = sum(fixed[j].group.servers for j in able)
        for j in able:  # (none able: those requests are lost, within no objective)
            r = share * rate * fixed[j].group.servers / n
            rates[j][i] = r
            work[j] += r * fixed[j].seconds[i]
    if everywhere:
        mix = sum(shares[i] for i in everywhere)
        cost = [sum(shares[i] * f.seconds[i] for i in everywhere) / mix for f in fixed]
        left = mix * rate
        if len(fixed) == 1:
            given = [left]
        else:  # water-filling: the utilization every group reaches with the rest's share
            # Utilization of what a group serves within the TPOT objective: a router that
            # knows the SLO sends a class whose decode nears it less than its saturation.
            slow = [
                f.group.slowdown(1.0 / c) if c > 0 else 1.0
                for f, c in zip(fixed, cost, strict=True)
            ]

            def take(u: float) -> list[float]:
                return [
                    max(0.0, (u * f.group.servers - w * k) / (c * k)) if c < math.inf else 0.0
                    for f, w, c, k in zip(fixed, work, cost, slow, strict=True)
                ]

            lo, hi = 0.0, 1.0
            while sum(take(hi)) < left and hi < 1e9:
                hi *= 2
            for _ in range(STEPS):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if sum(take(mid)) < left else (lo, mid)
            given = take(hi)
            total = sum(given) or 1.0
            given = [left * x / total for x in given]
        for j, r_g in enumerate(given):
            if r_g <= 0:
                continue
            for i in everywhere:
                rates[j][i] = r_g * shares[i] / mix
            work[j] += r_g * cost[j]
    return rates, [w / f.group.servers for w, f in zip(work, fixed, strict=True)]


def _within(
    f: _Fixed, rates: dict[int, float], rho: float, ttft_s: float | None, span: float
) -> float:
    """Requests/s of `rates` at group `f` that meet the TTFT objective: none if the TPOT
    objective breaks at this rate. At a utilization `rho` of 1 or more (a burst beyond the
    servers), the backlog grows by rho - 1 seconds a second over the burst's `span`: the
    requests that arrive before it outgrows their slack still make it."""
    g = f.group
    total = sum(rates.values())
    if total <= 0:
        return 0.0
    # The TPOT tail (the batch's, and the stalls of long prompts on short answers) and the
    # first token are taken as independent.
    per_server = total / g.servers
    tpot_ok = (1.0 - g.tpot_misses(per_server)) * (1.0 - f.stalled(per_server))
    total_ok = total * tpot_ok
    if ttft_s is None:  # (a burst past the servers only delays first tokens)
        return total_ok
    keep = total_ok / total
    busy_prefill = sum(r * f.prefill[i] for i, r in rates.items()) / g.servers
    # The share of the servers' time decoding takes: prefill work queues behind it.
    stretch = 1.0 / max(1e-6, 1.0 - max(0.0, min(rho, 1.0) - busy_prefill))
    if rho >= 1:
        grow = (rho - 1.0) * span
        return keep * sum(
            r * min(1.0, max(0.0, ttft_s - f.alone[i] * stretch) / grow) if grow > 0 else r
            for i, r in rates.items()
        )
    mean_s = sum(r * f.prefill[i] for i, r in rates.items()) / total * stretch
    second = sum(r * (f.prefill[i] * stretch) ** 2 for i, r in rates.items()) / total
    cs2 = max(0.0, second / (mean_s * mean_s) - 1.0) if mean_s > 0 else 0.0
    waits = _erlang_wait(g.servers, rho)
    mean_w = waits * mean_s / (g.servers * (1.0 - rho)) * (1.0 + cs2) / 2.0
    tail = mean_w / waits if waits > 0 and mean_w > 0 else 0.0
    ok = 0.0
    for i, r in rates.items():
        slack = ttft_s - f.alone[i] * stretch
        if slack < 0:
            continue
        ok += r * (1.0 - (waits * math.exp(-slack / tail) if tail > 0 else 0.0))
    return keep * ok


def _rate_factors(cv2: float) -> list[tuple[float, float]]:
    """(weight, factor) quadrature of the rate a request sees: a lognormal of mean 1 and
    squared coefficient of variation `cv2`, size-biased (bursts hold more requests)."""
    if cv2 <= 0:
        return [(1.0, 1.0)]
    s2 = math.log1p(cv2)
    nd = NormalDist(s2 / 2, math.sqrt(s2))  # mean 1 is mu = -s2/2; size-biased adds s2
    return [
        (1.0 / RATE_POINTS, math.exp(nd.inv_cdf((k + 0.5) / RATE_POINTS)))
        for k in range(RATE_POINTS)
    ]


def _attainment(
    fixed: Sequence[_Fixed], traffic: Traffic, rate: float, ttft_s: float | None
) -> float:
    """The share of requests within both objectives at `rate` requests/s."""
    shares = [s for s, _, _ in traffic.points]
    _, mean_rho = _assign(fixed, shares, rate)
    if max(mean_rho) >= 1:  # past the servers on average: the queues grow without bound
        return 0.0
    got = 0.0
    for weight, factor in _rate_factors(traffic.rate_cv2):
        local = rate * factor
        rates, rho = _assign(fixed, shares, local)
        span = BURST_WINDOW / local
        ok = sum(_within(f, r, u, ttft_s, span) for f, r, u in zip(fixed, rates, rho, strict=True))
        got += weight * ok / local
    return got


def attainment(
    groups: Sequence[Group],
    traffic: Traffic,
    rate: float,
    ttft_s: float | None,
    tpot_s: float | None = None,
) -> float:
    """The share of requests within both objectives at `rate` requests/s."""
    if rate <= 0:
        return 1.0
    fixed = [_Fixed.of(g, traffic, tpot_s) for g in groups if g.servers > 0]
    return _attainment(fixed, traffic, rate, ttft_s) if fixed else 0.0


def goodput(
    groups: Sequence[Group],
    traffic: Traffic,
    ttft_s: float | None,
    tpot_s: float | None = None,
    share: float = DEFAULT_SHARE,
) -> float:
    """The highest requests/s at which `groups` serve `share` of `traffic` within the SLO
    (`ttft_s`, `tpot_s`: the objectives, None for none; `share`: the Slo's)."""
    fixed = [_Fixed.of(g, traffic, tpot_s) for g in groups if g.servers > 0]
    if not fixed:
        return 0.0
    hi = 0.0
    for f in fixed:  # no rate beyond every server saturated on its lightest shape
        hi += f.group.servers / min(f.seconds)
    if not hi or _attainment(fixed, traffic, hi * 1e-6, ttft_s) < share:
        return 0.0
    lo = 0.0
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _attainment(fixed, traffic, mid, ttft_s) >= share else (lo, mid)
        if hi - lo < 1e-4 * hi:
            break
    return lo
