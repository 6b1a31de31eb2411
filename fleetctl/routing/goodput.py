"""What placing a request on a backend does to latency, and how hardware-aware weighs it.

Pure: a backend snapshot and a request in, an `Effect` out. The effect has two sides, as a
user of a chat service feels both:
- the request's own time to first token (TTFT) and time per output token (TPOT);
- the seconds it adds to each request already decoding there: its prefill runs inside their
  steps (vLLM's chunked prefill stalls every decode while a chunk computes), and it joins
  their batch, so each of their steps reads more KV.

The decode step comes from the performance model at the batch and context in flight. A step
also carries the prefill chunks of the prompts sent there after this one: at a prefill rate
of R tokens/s that costs t seconds a token, the GPU spends rho = R x t of its time on them, so
a decode token takes step / (1 - rho), and at most a step with a full chunk (a backlog).

`cost` turns an effect into the number hardware-aware minimises: the seconds of latency the
placement gives the fleet's requests, each phase weighed against its objective. Waiting for
the first token counts against the model's TTFT objective; its own decoding against its
output x the TPOT objective, and the seconds it adds to the others against theirs (the
model's mean output) x the TPOT objective. Without both objectives they weigh the same: the
plain sum of seconds.

Why seconds and not a count of expected SLO misses: a count was tried
(benchmarks/results/goodput.md). The TPOT estimate cannot see the prompts that arrive in the
next seconds (its real/estimated ratio has a p90 of 1.4-2.9 under Azure's bursts), so
thresholds on it misfire, and a count makes an overloaded server a sink: its requests miss
already, so more of them cost nothing. Seconds grow without bound there, and the sum is
linear, so the policy is free to let a few requests pay for many (long prompts where they
stall few decodes), which is what serves the most requests within both objectives at high
load.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetctl.fleet.slo import Slo
from fleetctl.model.lora import LoraPerf
from fleetctl.model.perf import EnginePerf
from fleetctl.routing.types import Backend, Request

# Prompt tokens are costed at the speed of a chunk of this many tokens (vLLM's usual budget)
# where their own lengths are unknown: the prefill rate, and the queue the router did not send.
PREFILL_PROBE = 2048
# A step's token budget where the backend's max_num_batched_tokens is unknown (vLLM's default
# on most GPUs).
DEFAULT_BUDGET = 2048
TERMS = ("ttft", "tpot", "others")
# The slots' rank where a server's --max-lora-rank is unknown (vLLM's default).
DEFAULT_LORA_RANK = 16


@dataclass(frozen=True, slots=True)
class Effect:
    """The predicted latency of placing one request on one backend."""

    ttft_s: float  # its time to first token (queued prefill, its own, one step; KV waits)
    tpot_s: float  # its time per output token while it decodes there
    others: float  # requests decoding there while it prefills and decodes
    others_tpot_s: float  # their time per output token without it
    others_added_s: float  # seconds it adds to each of them: its prefill and its share of steps

    def added_s(self) -> float:
        """Seconds it adds to the requests already there, summed."""
        return self.others * self.others_added_s


def prefill_s_per_token(b: Backend) -> float:
    """Seconds `b` takes to compute one prompt token inside a chunk (0 without a model)."""
    if b.perf is None:
        return 0.0
    return b.perf.prefill_marginal(PREFILL_PROBE) / PREFILL_PROBE


def prompt_prefill_s(b: Backend, req: Request) -> float:
    """Seconds `b` takes to compute the part of `req`'s prompt it does not hold cached, at
    the prompt's own length (0 without a model)."""
    if b.perf is None:
        return 0.0
    return b.perf.prefill_marginal(req.prefill_tokens, req.cached_tokens)


def queued_prefill_s(b: Backend) -> float:
    """Seconds of prefill queued on `b` ahead of a new prompt: its prompts' own modelled
    times where the router sent them, at least its pending tokens at a chunk's speed."""
    return max(b.pending_prefill_s, b.pending_prefill * prefill_s_per_token(b))


_LORA: dict[tuple[int, int], tuple[EnginePerf, LoraPerf]] = {}


def lora_perf(perf: EnginePerf, rank: int) -> LoraPerf:
    """The LoRA costs of an engine at a slot rank, built once per (engine model, rank)."""
    key = (id(perf), rank)
    found = _LORA.get(key)
    if found is None or found[0] is not perf:
        if len(_LORA) >= 256:
            _LORA.clear()
        found = _LORA[key] = (perf, LoraPerf(perf, rank))
    return found[1]


def adapter_wait_s(b: Backend, req: Request, step_s: float, mean_output: int | None) -> float:
    """Seconds before `b` can batch `req`'s adapter, from its newest vllm:lora_requests_info:
    none where requests of it run (a GPU slot holds it); else its copy into a slot from the
    CPU cache (model/lora.py), and, where the slots all hold adapters with requests running,
    first the wait for one to drain: a request's whole decode at the step in flight, once
    for it and once for each adapter waiting there before it.

    Whole decodes, one per adapter ahead: vLLM lets an adapter in only once every request of
    a running one has finished, and keeps admitting new requests of the running ones past
    it, so a popular adapter holds its slot while its traffic lasts. Half a decode per round
    of --max-loras adapters ahead sent the tail adapters into full slots: on
    benchmarks/lora.py at 90% load their first tokens waited 31 s at p90 inside the engines.
    """
    if not req.adapter or b.perf is None or req.adapter in b.lora_running:
        return 0.0
    lora = lora_perf(b.perf, b.lora_rank or DEFAULT_LORA_RANK)
    wait = lora.activate_s(lora.max_rank)
    if b.lora_max and len(b.lora_running) >= b.lora_max:
        ahead = len(b.lora_waiting - {req.adapter})
        wait += (1 + ahead) * max(1, mean_output or req.output_tokens) * step_s
    return wait


def lora_step_s(b: Backend, adapter: str | None, seqs: int) -> float:
    """Seconds the adapters running on `b` add to a decode step of `seqs` sequences, with
    `adapter` joining them (model/lora.py's step, at most --max-loras of them): every
    sequence taken to run one, as vllm:lora_requests_info names the adapters, not how many
    of their requests run."""
    running = b.lora_running | {adapter} if adapter else b.lora_running
    if not running or b.perf is None:
        return 0.0
    lora = lora_perf(b.perf, b.lora_rank or DEFAULT_LORA_RANK)
    return lora.step_s(min(len(running), b.lora_max or len(running)), seqs)


def effect(
    b: Backend, req: Request, cached: int, ttft_s: float, step_s: float, slow: float = 1.0
) -> Effect:
    """The effect of placing `req` on `b`, which holds `cached` of its prompt tokens; `ttft_s`
    is the first token the caller worked out, `step_s` the modelled decode step it joins
    (it in the batch, the LoRA kernels counted), `slow` how much slower than modelled the
    GPU's steps run (measured saturation). Needs `b.perf`."""
    perf = b.perf
    assert perf is not None
    per_token = prefill_s_per_token(b)
    n = _decoding(b)
    # The GPU's share of time on prompts sent after this one, at the rate prompts come here.
    rho = b.prefill_rate * per_token
    budget = max(1, (b.max_num_batched_tokens or DEFAULT_BUDGET) - round(n) - 1)
    full = budget * per_token  # a step's prefill chunk, when prompts queue
    tpot = stretched(step_s * slow, rho, full)
    if not n:
        return Effect(ttft_s, tpot, 0.0, 0.0, 0.0)
    kv = min(b.reserved_tokens, max(1, b.kv_tokens))
    others = max(1, round(n))
    before = stretched(
        (perf.step_time(others, kv) + lora_step_s(b, None, others)) * slow, rho, full
    )
    per_step = max(0.0, tpot - before)  # it joins their batch for as long as it decodes
    own_prefill = perf.prefill_marginal(req.prompt_tokens - cached, cached)
    return Effect(ttft_s, tpot, n, before, own_prefill + per_step * req.output_tokens)


def stretched(step_s: float, rho: float, full_chunk_s: float) -> float:
    """A decode token's time when the GPU spends `rho` of its time on prefill chunks: the
    step over the time left, and at most a step with a full chunk (the prompts queue)."""
    if rho <= 0:
        return step_s
    cap = step_s + full_chunk_s
    return cap if rho >= 1 else min(cap, step_s / (1 - rho))


def _decoding(b: Backend) -> float:
    """Requests decoding on `b` while a new one would prefill and decode: what is in flight,
    as far as its KV cache and max_num_seqs hold them at once."""
    n = float(max(b.outstanding, b.running))
    if not n:
        return 0.0
    if b.reserved_tokens > b.kv_tokens > 0:
        n = n * b.kv_tokens / b.reserved_tokens
    return float(min(n, b.max_num_seqs or n))


def terms(
    e: Effect, req: Request, slo: Slo | None, others_output: int | None = None
) -> dict[str, float]:
    """The cost's parts: the request's first token, its own decode, and the seconds it adds
    to the others, each over what its objective allows (module docstring). `others_output`:
    the output tokens a request in flight decodes (the model's mean; None: this one's)."""
    decode = max(1, req.output_tokens - 1)
    theirs = max(1, (others_output or req.output_tokens) - 1)
    ttft_s = slo.ttft_s if slo else None
    tpot_s = slo.tpot_s if slo else None
    ttft_scale, decode_scale, others_scale = 1.0, 1.0, 1.0  # plain seconds
    if ttft_s is not None and tpot_s is not None:
        # The seconds it adds to the others stretch their decodes, not its own: they are
        # weighed against their output x the TPOT objective. Its own output would make a
        # 3-token answer's prefill stall count 100 times a 300-token one's, and steer such
        # requests onto the server with the fewest decodes whatever prefill it has queued.
        ttft_scale, decode_scale, others_scale = ttft_s, decode * tpot_s, theirs * tpot_s
    return {
        "ttft": e.ttft_s / ttft_scale,
        "tpot": decode * e.tpot_s / decode_scale,
        "others": e.added_s() / others_scale,
    }


def cost(e: Effect, req: Request, slo: Slo | None, others_output: int | None = None) -> float:
    """What hardware-aware minimises (module docstring)."""
    return sum(terms(e, req, slo, others_output).values())


def deciding_term(
    best: Effect, runner_up: Effect, req: Request, slo: Slo | None, others_output: int | None = None
) -> str:
    """Which part of the cost separated the pick from the next best: `ttft` (its first
    token), `tpot` (its own decode) or `others` (what it adds to the requests there); `tie`
    when none did (the name decided)."""
    a, b = terms(best, req, slo, others_output), terms(runner_up, req, slo, others_output)
    term = max(TERMS, key=lambda k: b[k] - a[k])
    return term if b[term] > a[term] else "tie"
