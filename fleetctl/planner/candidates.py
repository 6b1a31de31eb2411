"""Node classes and the candidate deployments each can host, with the numbers that rank them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from fleetctl.base.names import natural_key
from fleetctl.base.text import plural
from fleetctl.fleet.inventory import BucketSpec, Inventory, Model, Node, Variant, WorkloadSpec
from fleetctl.fleet.prices import node_cost_per_hour
from fleetctl.fleet.slo import MODERATE_BATCH, Slo, objectives
from fleetctl.model.calibration import Calibrated, Calibration, calibrated
from fleetctl.model.catalog import GpuProfile
from fleetctl.model.perf import (
    BLOCK_SIZE,
    GB,
    EnginePerf,
    KvBudget,
    kv_budget,
    max_sequences,
    vllm_batch_defaults,
)
from fleetctl.planner.disaggregate import Pool, colocated
from fleetctl.planner.lora import mix, slots
from fleetctl.planner.queueing import TPOT_QUANTILES, Group, attainment, goodput, traffic_of

TP_SIZES = (1, 2, 4, 8)
# Mean request shape assumed when a model has no workload: a chat turn.
DEFAULT_PROMPT, DEFAULT_OUTPUT = 1000, 200
# A length shorter than max_context (a model with min_context) is rounded down to this many
# tokens: whole KV blocks on every block size vLLM uses (16 on GPUs, 128 on CPUs), and a KV
# estimate that moves by a few hundred tokens (a new calibration) does not change the flag and
# so does not restart every server of the class.
CONTEXT_STEP = 1024
# Lengths tried per candidate while solving for the longest that fits (one or two suffice
# where the KV budget does not depend on the length, as on vLLM V1).
CONTEXT_TRIES = 64


@dataclass(frozen=True)
class NodeClass:
    """Identical nodes: same GPU type and count, and the same models allowed on them."""

    index: int
    gpu: GpuProfile
    gpu_count: int
    nodes: tuple[Node, ...]
    allowed: frozenset[str]  # model names whose placement rules admit these nodes
    cost_per_hour: float | None = None  # of one node (fleetctl/fleet/prices.py); None: unknown

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def label(self) -> str:
        return f"{self.gpu_count}x {self.gpu.name}"

    def price_of(self, gpus: int) -> float | None:
        """Per hour, `gpus` of a node's GPUs: their share of its price; None: unknown."""
        if self.cost_per_hour is None:
            return None
        return self.cost_per_hour * gpus / self.gpu_count


@dataclass(frozen=True)
class Candidate:
    """A model variant at one TP size on one node class, with its memory and speed."""

    cls: NodeClass
    model: Model
    variant: Variant
    tp: int
    budget: KvBudget
    perf: EnginePerf
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    sequences_at_max_len: int
    # Per server, requests/s: with an SLO, its share of the goodput of all the servers of it
    # the class could hold (planner/queueing.py); without, saturation for the mean request.
    capacity_rps: float
    decode_tok_s: float  # one request, short context
    # Where measured figures replaced the model's (KV tokens, speed): the calibration's entry.
    calibrated: str | None = None
    # Its --max-model-len: the model's max_context, or with min_context the longest this
    # class's KV cache holds min_sequences of (context_reason says which, in numbers).
    max_model_len: int = 0
    context_reason: str = ""
    # Per length bucket of the model's workload (WorkloadSpec.buckets), the requests/s of it
    # a server carries: with an SLO its share of the goodput on the bucket's requests, as
    # capacity_rps is on the whole workload (`bucket_capacity`); 0 where the bucket's
    # longest request exceeds max_model_len. Empty without buckets.
    bucket_capacity: tuple[float, ...] = ()
    # The engine as measured where the calibration has its class (the figures plan --json
    # shows per deployment); None only for candidates built by hand.
    engine: Calibrated | None = None
    # Per server, (requests/s, share of requests over the TPOT objective there): the rates
    # at which its TPOT quantiles reach the objective (planner/disaggregate.py); () without.
    tpot_rates: tuple[tuple[float, float], ...] = ()
    # The model's SLO the candidate is weighed by: stated, else derived before placement
    # (`candidates`); None only where no candidate of the model holds it.
    slo: Slo | None = None
    # Why its --max-num-batched-tokens is not vLLM's default, in numbers ("": it is, or the
    # inventory stated it).
    budget_reason: str = ""

    @property
    def option(self) -> tuple[str, str, int]:
        return (self.model.name, self.variant.format.name, self.tp)


def node_classes(inv: Inventory) -> list[NodeClass]:
    """Nodes grouped by GPU type and count, allowed models and price: nodes of one class
    are interchangeable for every objective."""
    groups: dict[tuple[str, int, frozenset[str], float | None], list[Node]] = {}
    by_labels: dict[tuple[tuple[str, str], ...], frozenset[str]] = {}
    for node in inv.nodes:
        allowed = by_labels.get(node.labels)
        if allowed is None:
            allowed = frozenset(m.name for m in inv.models if _labels_match(m, node))
            by_labels[node.labels] = allowed
        key = (node.gpu.name, node.gpu_count, allowed, node_cost_per_hour(node))
        groups.setdefault(key, []).append(node)
    out = []
    for i, ((_, count, allowed, price), nodes) in enumerate(
        sorted(groups.items(), key=_class_order)
    ):
        nodes.sort(key=lambda n: natural_key(n.name))
        out.append(NodeClass(i, nodes[0].gpu, count, tuple(nodes), allowed, price))
    return out


def _class_order(
    item: tuple[tuple[str, int, frozenset[str], float | None], list[Node]],
) -> tuple[object, ...]:
    (gpu, count, allowed, price), _ = item
    return (gpu, count, sorted(allowed), -1.0 if price is None else price)


def _labels_match(model: Model, node: Node) -> bool:
    want = model.spec.placement.labels
    have = dict(node.labels)
    return all(have.get(k) == v for k, v in want.items())


def request_shape(model: Model) -> tuple[int, int]:
    w = model.spec.workload
    if w is None:
        return min(DEFAULT_PROMPT, model.spec.max_context // 2), DEFAULT_OUTPUT
    return w.mean_prompt_tokens, w.mean_output_tokens


def tp_sizes(model: Model, gpu_count: int) -> list[int]:
    """TP sizes vLLM accepts for this model that fit in one node."""
    p = model.profile
    return [
        t
        for t in TP_SIZES
        if t <= gpu_count
        and p.num_attention_heads % t == 0
        and (p.num_kv_heads % t == 0 or t % p.num_kv_heads == 0)
    ]


def evaluate(
    cls: NodeClass,
    model: Model,
    variant: Variant,
    tp: int,
    inv: Inventory,
    calibration: Calibration | None = None,
    max_len: int | None = None,
    slo: Slo | None = None,
) -> Candidate:
    """Memory and speed of `model` in `variant` at TP=`tp` on one node of `cls` (fit or not),
    with --max-model-len `max_len` (default: the model's max_context), its capacity weighed
    by `slo` (None: saturation's); a calibration entry for the same GPU, model, format and TP
    replaces the model's KV tokens and speed with what live servers measured.

    Its --max-num-batched-tokens is the inventory's planner.max_num_batched_tokens where
    stated; else, under a TPOT objective, the step budget `step_budget` chooses."""
    max_len = max_len or model.spec.max_context
    tokens, _ = vllm_batch_defaults(cls.gpu, inv.spec.apply.vllm_version, max_len)
    stated = inv.spec.planner.max_num_batched_tokens
    if stated or slo is None or slo.tpot_s is None:
        return _at_budget(cls, model, variant, tp, inv, calibration, max_len, slo, stated or tokens)
    tried = [
        _at_budget(cls, model, variant, tp, inv, calibration, max_len, slo, b)
        for b in step_budgets(tokens)
    ]
    chosen = step_budget(tried, slo.tpot_s)
    if _longest_step(chosen) <= slo.tpot_s:
        return chosen
    # No half both meets the objective and serves as much: the largest budget that meets it,
    # between two halves, may.
    exact = within_objective(tried[0], slo.tpot_s)
    if exact is None or any(k.max_num_batched_tokens == exact for k in tried):
        return chosen
    k = _at_budget(cls, model, variant, tp, inv, calibration, max_len, slo, exact)
    return step_budget(sorted([*tried, k], key=lambda k: -k.max_num_batched_tokens), slo.tpot_s)


# The share of the best capacity within the SLO a smaller step budget may cost (a budget
# whose every step meets the TPOT objective, else the one whose steps stall answers least).
BUDGET_SLACK = 0.02
# The smallest budget weighed: below a few hundred tokens a step is bound by reading the
# weights, so a smaller one no longer shortens it.
MIN_BUDGET = 128


def step_budgets(default: int) -> list[int]:
    """The --max-num-batched-tokens the planner weighs, largest first: vLLM's default,
    halved down to MIN_BUDGET."""
    out = [default]
    while out[-1] // 2 >= MIN_BUDGET:
        out.append(out[-1] // 2)
    return out


# A budget found between halves is a multiple of this many tokens (four KV blocks).
BUDGET_STEP = 64


def within_objective(k: Candidate, tpot_s: float) -> int | None:
    """The largest budget, a multiple of BUDGET_STEP from MIN_BUDGET up to `k`'s, whose full
    step (`_longest_step`) meets the TPOT objective; None where not even MIN_BUDGET's does."""
    lo, hi = MIN_BUDGET // BUDGET_STEP, k.max_num_batched_tokens // BUDGET_STEP
    if _longest_step(replace(k, max_num_batched_tokens=lo * BUDGET_STEP)) > tpot_s:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _longest_step(replace(k, max_num_batched_tokens=mid * BUDGET_STEP)) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo * BUDGET_STEP


def step_budget(tried: Sequence[Candidate], tpot_s: float) -> Candidate:
    """Of one candidate at each step budget (largest first: vLLM's default and its halves,
    and maybe the largest whose full step meets the objective), the one to plan.

    A budget bounds every step: decodes go first, and a prompt is prefilled in chunks of
    what is left. Where a step that fills it (beside a moderate batch of decodes) meets the
    TPOT objective, no prompt can push an answer's TPOT over it, whatever its length: the
    largest such budget is chosen if it costs no more than BUDGET_SLACK of the best
    capacity within the SLO (a small budget reads the weights and pays a step's fixed cost
    for fewer tokens, and spreads a long prompt over more steps). Else the smallest budget
    within BUDGET_SLACK of the best capacity is: its steps, if not all within the
    objective, stall the answers beside them least."""
    default = tried[0]
    top = max(k.capacity_rps for k in tried)
    near = [k for k in tried if k.capacity_rps >= top * (1 - BUDGET_SLACK)]
    bounded = [k for k in near if _longest_step(k) <= tpot_s]
    best = bounded[0] if bounded else near[-1]
    if best is default:
        return best
    ms, objective = _longest_step(best) * 1000, tpot_s * 1000
    if bounded:
        how = f"a step that fills it takes {ms:.0f} ms, within the {objective:g} ms TPOT objective"
    else:
        how = (
            f"none that serves as much keeps a full step within the {objective:g} ms TPOT "
            f"objective, and this one's ({ms:.0f} ms) stalls the answers beside it least"
        )
    why = (
        f"{best.max_num_batched_tokens}, not vLLM's {default.max_num_batched_tokens}: {how} "
        f"({best.capacity_rps:.2f} req/s a server within the SLO, against "
        f"{default.capacity_rps:.2f} at {default.max_num_batched_tokens})"
    )
    return replace(best, budget_reason=why)


def _longest_step(k: Candidate) -> float:
    """Seconds of a step that fills `k`'s budget beside a moderate batch of the mean request."""
    prompt, output = request_shape(k.model)
    return k.perf.full_step(k.max_num_batched_tokens, MODERATE_BATCH, prompt + output / 2, prompt)


def _at_budget(
    cls: NodeClass,
    model: Model,
    variant: Variant,
    tp: int,
    inv: Inventory,
    calibration: Calibration | None,
    max_len: int,
    slo: Slo | None,
    tokens: int,
) -> Candidate:
    """`evaluate` at one step budget (--max-num-batched-tokens `tokens`)."""
    planner = inv.spec.planner
    util = model.spec.gpu_memory_utilization or planner.gpu_memory_utilization
    # The release the servers will run: the inventory's apply.vllm_version, else fleetctl's
    # target; its memory-profiling rules and defaults size the KV cache.
    version = inv.spec.apply.vllm_version
    _, seqs = vllm_batch_defaults(cls.gpu, version, max_len)
    seqs = min(seqs, tokens)  # vLLM refuses a budget below max_num_seqs
    lora = slots(model, cls.gpu.name)
    budget = kv_budget(
        cls.gpu,
        model.profile,
        variant.format,
        tp,
        util,
        model.spec.kv_cache_dtype,
        tokens,
        seqs,
        planner.enforce_eager,
        max_len,
        version,
        lora_bytes=lora.slot_bytes(model.profile, variant.format, tp) if lora else 0,
    )
    perf = EnginePerf(
        cls.gpu,
        model.profile,
        variant.format,
        tp,
        model.spec.kv_cache_dtype,
        version,
        planner.enforce_eager,
    )
    engine = calibrated(
        calibration,
        perf,
        budget.kv_tokens,
        vllm_version=version,
        max_model_len=max_len,
        gpu_memory_utilization=util,
    )
    if engine.kv_tokens != budget.kv_tokens:
        per_gpu = engine.kv_tokens * perf.kv_token_bytes
        budget = replace(budget, kv_tokens=engine.kv_tokens, kv_per_gpu=per_gpu)
    perf = engine.perf
    # Its steps count the kernels of the adapters it runs (measured figures are the base
    # model's: the mix goes on after them).
    lora_mix = mix(model, cls.gpu.name, variant.format.activation_bytes) if lora else None
    if lora_mix is not None:
        perf = replace(perf, lora_mix=lora_mix)
    seq_at_max = max_sequences(budget.kv_tokens, max_len)
    prompt, output = request_shape(model)
    capacity = shape_capacity(perf, slo, prompt, output, budget.kv_tokens, seqs, seq_at_max, tokens)
    traffic = traffic_of(model, (prompt, output))
    tpot = tpot_rates(perf, slo, prompt, output, budget.kv_tokens, seqs, tokens)
    group = None
    if slo is not None:
        most = cls.size * (cls.gpu_count // tp)
        if model.spec.max_replicas is not None:
            most = min(most, model.spec.max_replicas)
        group = Group(max(1, most), perf, budget.kv_tokens, seqs, max_len, tpot, tokens)
    if capacity > 0 and slo is not None and group is not None:
        # Its share of what all such servers serve within the SLO, on the shapes it takes
        # (the longer ones are another class's to carry); where none holds, the old
        # mean-shape figure keeps the candidate weighable, and the model's capacity says 0.
        each = goodput([group], traffic.within(max_len), slo.ttft_s, slo.tpot_s, slo.share)
        capacity = each / group.servers or capacity
    w = model.spec.workload
    per_bucket = tuple(
        0.0
        if b.max_tokens > max_len or not seq_at_max
        else bucket_capacity(model, b, group, slo)
        if group is not None and slo is not None
        else shape_capacity(
            perf,
            None,
            b.mean_prompt_tokens,
            b.mean_output_tokens,
            budget.kv_tokens,
            seqs,
            1,
            tokens,
        )
        for b in (w.buckets if w else ())
    )
    return Candidate(
        cls,
        model,
        variant,
        tp,
        budget,
        perf,
        tokens,
        seqs,
        util,
        seq_at_max,
        capacity,
        perf.decode_tok_s(1, 512),
        engine.provenance or None,
        max_len,
        f"{max_len} = max_context",
        per_bucket,
        engine,
        tpot,
        slo,
    )


def bucket_capacity(model: Model, bucket: BucketSpec, group: Group, slo: Slo) -> float:
    """Requests/s of one length bucket a server of `group` carries within `slo`: its share
    of the group's goodput on the bucket's requests, at the workload's burstiness, as the
    model's capacity is found on the whole workload. Weighing a bucket by its mean request
    at saturation instead (its TPOT capped at half the objective) put a bucket of the mean
    request on other GPUs than the same workload without buckets."""
    w = model.spec.workload
    assert w is not None, "a bucket is a slice of a workload"
    alone = WorkloadSpec(
        requests_per_s=max(w.requests_per_s * bucket.share, 1e-6),
        mean_prompt_tokens=bucket.mean_prompt_tokens,
        mean_output_tokens=bucket.mean_output_tokens,
        burstiness=w.burstiness,
    )
    sliced = replace(model, spec=model.spec.model_copy(update={"workload": alone}))
    prompt, output = bucket.mean_prompt_tokens, bucket.mean_output_tokens
    traffic = traffic_of(sliced, (prompt, output))
    # The rates at which its TPOT quantiles reach the objective are the bucket's own: a
    # short request's step is shorter than the whole workload's mean request's.
    rates = tpot_rates(
        group.perf,
        slo,
        prompt,
        output,
        group.kv_tokens,
        group.max_num_seqs,
        group.max_num_batched_tokens,
    )
    g = replace(group, tpot_rates=rates)
    return goodput([g], traffic, slo.ttft_s, slo.tpot_s, slo.share) / g.servers


def tpot_rates(
    perf: EnginePerf,
    slo: Slo | None,
    prompt: int,
    output: int,
    kv_tokens: int,
    seqs: int,
    max_num_batched_tokens: int = 0,
) -> tuple[tuple[float, float], ...]:
    """Per server, the requests/s at which each TPOT quantile reaches the objective (Poisson
    arrivals of the mean shape, prefill interference counted, one chunk a step at most),
    with the share of requests over it there; () without a TPOT objective."""
    if slo is None or slo.tpot_s is None:
        return ()
    pool = Pool(
        0, "", 1, perf, kv_tokens, seqs, None, max_num_batched_tokens=max_num_batched_tokens
    )
    return tuple(
        (colocated(pool, prompt, output, slo.tpot_s, quantile=q).rate, 1 - q)
        for q in TPOT_QUANTILES
    )


def model_goodput(model: Model, placed: Sequence[tuple[Candidate, int]]) -> float | None:
    """Requests/s the model's placed servers (candidate, count) serve within its SLO's
    share, on its workload's lengths and bursts, the long prompts only where they fit;
    None without an SLO (the capacity is then saturation's)."""
    slo = placed[0][0].slo if placed else None
    if slo is None:
        return None
    traffic = traffic_of(model, request_shape(model))
    return goodput(_groups(placed), traffic, slo.ttft_s, slo.tpot_s, slo.share)


def model_attainment(model: Model, placed: Sequence[tuple[Candidate, int]], rate: float) -> float:
    """The share of the model's requests its placed servers serve within its SLO at `rate`
    requests/s, by the model `model_goodput` searches; 1 without an SLO."""
    slo = placed[0][0].slo if placed else None
    if slo is None:
        return 1.0
    traffic = traffic_of(model, request_shape(model))
    return attainment(_groups(placed), traffic, rate, slo.ttft_s, slo.tpot_s)


def _groups(placed: Sequence[tuple[Candidate, int]]) -> list[Group]:
    return [
        Group(
            n,
            k.perf,
            k.budget.kv_tokens,
            k.max_num_seqs,
            k.max_model_len,
            k.tpot_rates,
            k.max_num_batched_tokens,
        )
        for k, n in placed
    ]


def shape_capacity(
    perf: EnginePerf,
    slo: Slo | None,
    prompt: int,
    output: int,
    kv_tokens: int,
    max_num_seqs: int,
    seq_at_max: int,
    max_num_batched_tokens: int = 0,
) -> float:
    """Requests/s at saturation for one request shape, capped by `slo`: 0 where the KV
    cache holds no sequence at max_model_len."""
    if not seq_at_max:
        return 0.0
    capacity = perf.capacity_rps(prompt, output, kv_tokens, max_num_seqs, max_num_batched_tokens)
    if slo is not None and capacity:
        capacity = slo_capacity(perf, slo, prompt, output, kv_tokens, max_num_seqs, capacity)
    return capacity


# A p99 objective is checked against mean-shape figures: keep this share of it as headroom
# for longer prompts and for the prefill chunks that ride along decode steps.
SLO_HEADROOM = 0.5


def slo_capacity(
    perf: EnginePerf,
    slo: Slo,
    prompt: int,
    output: int,
    kv_tokens: int,
    max_num_seqs: int,
    capacity: float,
) -> float:
    """The capacity at which a server still meets `slo`, by the same perf model: 0 when
    even one request alone misses its TTFT (its prefill) or TPOT (a decode step); else the
    saturation capacity at the largest batch whose decode step stays within SLO_HEADROOM of
    the TPOT objective (fewer concurrent sequences, each faster)."""
    if slo.ttft_s is not None and perf.prefill_time(prompt) > slo.ttft_s * SLO_HEADROOM:
        return 0.0
    if slo.tpot_s is None:
        return capacity
    limit = slo.tpot_s * SLO_HEADROOM
    ctx = prompt + output / 2
    if perf.step_time(1, ctx) > limit:
        return 0.0
    most = min(max_num_seqs, max_sequences(kv_tokens, prompt + output))
    lo, hi = 1, max(most, 1)
    while lo < hi:  # the largest batch whose step is within the limit (steps grow with it)
        mid = (lo + hi + 1) // 2
        if perf.step_time(mid, mid * ctx) <= limit:
            lo = mid
        else:
            hi = mid - 1
    if lo >= most:
        return capacity
    return min(capacity, perf.capacity_rps(prompt, output, kv_tokens, lo))


def slo_miss(cand: Candidate) -> str | None:
    """Why `cand` carries no request within its model's SLO, in numbers; None if it does or
    the model has no SLO."""
    slo = cand.slo
    if slo is None or cand.capacity_rps > 0:
        return None
    prompt, output = request_shape(cand.model)
    if slo.ttft_s is not None:
        prefill = cand.perf.prefill_time(prompt)
        if prefill > slo.ttft_s * SLO_HEADROOM:
            return (
                f"a {prompt}-token prompt alone takes {prefill:.2f} s to prefill, over "
                f"{SLO_HEADROOM:g} x ttft_p99_s {slo.ttft_s:g} s ({slo.source})"
            )
    if slo.tpot_s is not None:
        step = cand.perf.step_time(1, prompt + output / 2) * 1000
        return (
            f"one request's decode step takes {step:.1f} ms, over {SLO_HEADROOM:g} x "
            f"tpot_p99_ms {slo.tpot_s * 1000:g} ms ({slo.source})"
        )
    return None


def fits(cand: Candidate) -> bool:
    """The planner's KV rule: the cache holds min_sequences sequences of max_model_len, and
    it carries some requests within the SLO (the mean request, or one length bucket's)."""
    return cand.sequences_at_max_len >= cand.model.spec.min_sequences and (
        cand.capacity_rps > 0 or any(cand.bucket_capacity)
    )


def _longest(cand: Candidate) -> int:
    """The longest length, in CONTEXT_STEPs and below max_context, of which `cand`'s KV
    budget holds min_sequences (the inverse of max_sequences: whole blocks per sequence)."""
    per_seq = (cand.budget.kv_tokens // BLOCK_SIZE) // cand.model.spec.min_sequences * BLOCK_SIZE
    return min(cand.model.spec.max_context - 1, per_seq) // CONTEXT_STEP * CONTEXT_STEP


def shorter(cand: Candidate, inv: Inventory, calibration: Calibration | None = None) -> Candidate:
    """`cand` (which does not fit at max_context) at the longest max_model_len from its
    model's min_context up that fits, or `cand` unchanged when not even min_context does.

    The KV budget may depend on the length (vLLM V0 profiles a whole max-length prompt), so
    each length is evaluated again: start where the budget at max_context says, climb while a
    fitting length's own budget allows a longer one, step down while one does not fit."""
    model = cand.model
    lo = model.spec.min_context
    if lo is None:
        return cand
    best: Candidate | None = None
    tried: set[int] = set()
    n = _longest(cand)
    for _ in range(CONTEXT_TRIES):
        n = max(n, lo)
        if n in tried:
            break
        tried.add(n)
        k = evaluate(cand.cls, model, cand.variant, cand.tp, inv, calibration, n, cand.slo)
        if fits(k):
            best = k
            n = _longest(k)
            if n <= k.max_model_len:
                break
        elif best is not None or n == lo:
            break
        else:
            n = min(n - CONTEXT_STEP, _longest(k))
    if best is None:
        return cand
    seqs = plural(best.sequences_at_max_len, "sequence")
    why = (
        f"{best.max_model_len}: the KV budget of {best.budget.kv_total / GB:.1f} GB "
        f"({best.budget.kv_tokens:,} tokens) holds {seqs} of {best.max_model_len}, not of "
        f"max_context {model.spec.max_context} (min_context {lo})"
    )
    return replace(best, context_reason=why)


def why_not(cls: NodeClass, model: Model, variant: Variant, tp: int | None) -> str | None:
    """Why this combination is ruled out before any memory arithmetic, or None."""
    fmt = variant.format
    if model.name not in cls.allowed:
        return f"{cls.label}: excluded by the model's placement labels"
    if model.gpu_types and cls.gpu.name not in model.gpu_types:
        return f"{cls.label}: not in the model's placement gpu_types"
    if not fmt.runs_on(cls.gpu):
        archs = ", ".join(fmt.architectures)
        return f"{cls.label}: {fmt.name} does not run on {cls.gpu.architecture} (needs {archs})"
    if tp is None:
        return f"{cls.label}: no TP size divides {model.profile.num_attention_heads} heads"
    return None


def candidates(
    inv: Inventory, classes: list[NodeClass], calibration: Calibration | None = None
) -> tuple[list[Candidate], list[Candidate]]:
    """(feasible, rejected) candidates; rejected ones fit no KV for min_sequences at max_context
    (with min_context: at any length from min_context up). A model with min_context whose
    candidates all fall short of max_context is rejected whole: the fleet must serve
    max_context somewhere. `calibration`: measured figures that replace the model's where an
    entry matches. Each model is weighed by `planned_slo`."""
    feasible: list[Candidate] = []
    rejected: list[Candidate] = []
    for model in inv.models:
        combos = _combos(model, classes)
        slo = planned_slo(model, combos, inv, calibration)
        mine: list[Candidate] = []
        for cls, variant, tp in combos:
            cand = _sized(cls, model, variant, tp, inv, calibration, slo)
            (mine if fits(cand) else rejected).append(cand)
        if model.spec.min_context is not None and not any(reaches_max(k) for k in mine):
            rejected += mine
        else:
            feasible += mine
    # Class-major order, as the optimizer and the plan's tie-breaks have always seen them.
    feasible.sort(key=lambda k: k.cls.index)
    return feasible, rejected


def _combos(model: Model, classes: list[NodeClass]) -> list[tuple[NodeClass, Variant, int]]:
    """Every (class, variant, TP size) that could serve `model` before memory is counted."""
    return [
        (cls, variant, tp)
        for cls in classes
        for variant in model.variants
        for sizes in (tp_sizes(model, cls.gpu_count),)
        if not why_not(cls, model, variant, sizes[0] if sizes else None)
        for tp in sizes
    ]


def model_slo(inv: Inventory, model: Model, calibration: Calibration | None = None) -> Slo | None:
    """The SLO `plan` plans `model` by on `inv`'s classes, for the workload `model` states
    (simulate gives it the traffic it replays, as `plan --workload-from` does)."""
    return planned_slo(model, _combos(model, node_classes(inv)), inv, calibration)


def _sized(
    cls: NodeClass,
    model: Model,
    variant: Variant,
    tp: int,
    inv: Inventory,
    calibration: Calibration | None,
    slo: Slo | None,
) -> Candidate:
    """The candidate at max_context, else at the longest length that fits (min_context)."""
    cand = evaluate(cls, model, variant, tp, inv, calibration, None, slo)
    return cand if fits(cand) else shorter(cand, inv, calibration)


def planned_slo(
    model: Model,
    combos: Sequence[tuple[NodeClass, Variant, int]],
    inv: Inventory,
    calibration: Calibration | None = None,
) -> Slo | None:
    """The SLO `model` is planned by: its stated one, else the one fleet/slo.py derives
    from the slowest of the servers (class, format, TP; at the length each holds) that
    could serve it. Placement has not chosen them yet, so every one that holds the model
    counts, and the plan keeps this one as the model's SLO (ModelSummary.slo), whichever
    classes it places."""
    stated = Slo.of(model.spec.slo)
    if stated is not None:
        return stated
    held = (_sized(c, model, v, tp, inv, calibration, None) for c, v, tp in combos)
    return objectives(model, ((k.perf, k.max_model_len) for k in held if fits(k)))


def reaches_max(cand: Candidate) -> bool:
    return cand.max_model_len >= cand.model.spec.max_context


def prune_dominated(cands: list[Candidate], warn_below: int, keep: set[int]) -> list[Candidate]:
    """Drop candidates another one beats on the same GPUs; `keep` holds indices to retain.

    B dominates A on one class and model when B's TP size divides A's (A's GPU block splits
    into TP_A / TP_B blocks for B), those copies of B serve at least A's capacity, and B's KV
    headroom is no worse. Dropping A then loses no optimal plan and shrinks the MILP.
    """
    out = []
    for i, a in enumerate(cands):
        dominated = i not in keep and any(
            _dominates(b, a, warn_below, tie_wins=j < i)
            for j, b in enumerate(cands)
            if j != i and b.cls is a.cls and b.model is a.model
        )
        if not dominated:
            out.append(a)
    return out


def _dominates(b: Candidate, a: Candidate, warn_below: int, tie_wins: bool) -> bool:
    if a.tp % b.tp:
        return False
    copies = a.tp // b.tp
    cap_b, cap_a = copies * b.capacity_rps, a.capacity_rps
    head_b = min(b.sequences_at_max_len, warn_below)
    head_a = min(a.sequences_at_max_len, warn_below)
    # A shorter length never stands in for a longer one (a model with min_context).
    if cap_b < cap_a or head_b < head_a or b.max_model_len < a.max_model_len:
        return False
    # With length buckets, B must carry at least A's capacity in every one of them.
    if any(copies * x < y for x, y in zip(b.bucket_capacity, a.bucket_capacity, strict=True)):
        return False
    more = any(copies * x > y for x, y in zip(b.bucket_capacity, a.bucket_capacity, strict=True))
    return cap_b > cap_a or head_b > head_a or more or tie_wins
