"""Two scrapes of one server: one window sample of what it did between them (decode tokens
at a batch, requests finished, their prefill time and computed prompt tokens)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Annotated, NamedTuple

from fleetctl.model.calibration.rules import rounded
from fleetctl.vllm.metrics import Scrape


class Sample(NamedTuple):
    """What one server did between two scrapes: decode tokens at a batch, requests finished.

    A named tuple: the file keeps a sample as a row of these numbers in this order, compact for
    the thousands a fleet's file keeps. Rows of 9, from before the clock timed the windows, read
    with the last two 0."""

    batch: Annotated[float, rounded(4)] = 0.0  # mean sequences per decode step
    step_s: float = 0.0  # mean inter-token latency: one decode step at that batch
    tokens: int = 0  # inter-token intervals observed (the decode weight)
    prefill_s: float = 0.0  # summed prefill time of the requests that finished
    prefill_tokens: int = 0  # their prompt tokens computed
    requests: int = 0  # requests that finished
    ttft_s: float = 0.0  # summed time to first token
    first_tokens: int = 0  # requests that got their first token
    # The mean prompt + half the mean output of the finished requests.
    context: Annotated[float, rounded(1)] = 0.0
    # Timed by the clock, when the server ran a request at both ends of the window and counts
    # its steps: the mean engine step (wall seconds over steps) and the prompt tokens each step
    # computed besides its decodes. Unlike the inter-token latency, the wall clock does not
    # count the time a preempted request waits to be readmitted as one long step.
    wall_step_s: float = 0.0
    prefill_per_step: Annotated[float, rounded(3)] = 0.0


# The counters of a Scrape that a window differences (the gauges are read at its ends).
_COUNTERS = (
    "itl_sum",
    "itl_count",
    "steps",
    "step_tokens",
    "prompt_tokens",
    "prompt_cached",
    "prefill_sum",
    "prefill_count",
    "prefill_kv_tokens",
    "prompt_sum",
    "prompt_count",
    "generation_sum",
    "generation_count",
    "ttft_sum",
    "ttft_count",
)


def window(before: Scrape, after: Scrape) -> Sample | None:
    """One sample from two scrapes of the same server; None when a counter went backwards (the
    server restarted between them) or nothing happened."""

    def delta(name: str) -> float | None:
        a, b = getattr(before, name), getattr(after, name)
        if a is None or b is None:
            return None
        return b - a

    deltas = {name: delta(name) for name in _COUNTERS}
    # Not a sample's figures: they only say how many prompt tokens each step carried (below).
    step_tokens, prompted, cached = (
        deltas.pop(n) for n in ("step_tokens", "prompt_tokens", "prompt_cached")
    )
    if any(d is not None and d < 0 for d in deltas.values()):
        return None
    tokens = int(deltas["itl_count"] or 0)
    step = (deltas["itl_sum"] or 0.0) / tokens if tokens else 0.0
    steps = deltas["steps"]
    if tokens and steps:
        # Decode tokens per engine step: the batch each step served, from vLLM's own counters.
        batch = tokens / steps
    else:
        # Without the step counter: the running gauge at both ends.
        ends = [v for v in (before.running, after.running) if v is not None]
        batch = sum(ends) / len(ends) if ends else 0.0
    requests = int(deltas["prefill_count"] or 0)
    # Prompt tokens from the per-request histograms, observed when a request finishes as the
    # prefill time is: vllm:prompt_tokens_total counts at prefill, so over a short window it
    # would pair one set of requests' tokens with another's seconds. The computed tokens leave
    # out prefix-cache hits, which took no prefill time.
    computed = deltas["prefill_kv_tokens"]
    prompt = deltas["prompt_sum"]
    if computed is None and prompt is not None and cached:
        # A release without that histogram: its prompts less the prefix-cache hits counted
        # over the window (at prefill, not at finish: close over a window of many requests).
        computed = max(0.0, prompt - cached)
    prefill_tokens = int(computed if computed is not None else (prompt or 0))
    finished = deltas["prompt_count"] or 0
    context = 0.0
    if finished and deltas["generation_count"]:
        mean_prompt = (prompt or 0.0) / finished
        context = mean_prompt + (deltas["generation_sum"] or 0.0) / deltas["generation_count"] / 2
    wall_step = per_step = 0.0
    if tokens and steps and step_tokens is not None:
        # Prompt tokens each step computed beside its decodes, from the step counter.
        per_step = max(0.0, step_tokens - tokens) / steps
    elif tokens and batch > 0 and prompted is not None:
        # Without it: the prompt tokens counted over the window, over the steps that decoded
        # `tokens` at `batch` a step. The mean inter-token latency carries these prefill chunks.
        per_step = max(0.0, prompted - (cached or 0.0)) * batch / tokens
    busy = bool(before.running) and bool(after.running)
    if busy and steps and before.at is not None and after.at is not None and after.at > before.at:
        wall_step = (after.at - before.at) / steps
    out = Sample(
        batch=batch if tokens else 0.0,
        step_s=step,
        tokens=tokens,
        prefill_s=deltas["prefill_sum"] or 0.0,
        prefill_tokens=prefill_tokens,
        requests=requests,
        ttft_s=deltas["ttft_sum"] or 0.0,
        first_tokens=int(deltas["ttft_count"] or 0),
        context=context,
        wall_step_s=wall_step,
        prefill_per_step=per_step,
    )
    return out if (out.tokens or out.requests or out.first_tokens) else None


def windows(scrapes: Sequence[Scrape]) -> list[Sample]:
    """One sample per consecutive pair of scrapes."""
    out = []
    for a, b in itertools.pairwise(scrapes):
        s = window(a, b)
        if s is not None:
            out.append(s)
    return out
