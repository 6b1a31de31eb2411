"""Two scrapes of one server: one window sample of what it did between them (decode tokens
at a batch, requests finished, their prefill time and computed prompt tokens)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from fleetctl.model.calibration.rules import CalibrationError
from fleetctl.vllm.metrics import Scrape


@dataclass(frozen=True)
class Sample:
    """What one server did between two scrapes: decode tokens at a batch, requests finished."""

    batch: float = 0.0  # mean sequences per decode step
    step_s: float = 0.0  # mean inter-token latency: one decode step at that batch
    tokens: int = 0  # inter-token intervals observed (the decode weight)
    prefill_s: float = 0.0  # summed prefill time of the requests that finished
    prefill_tokens: int = 0  # their prompt tokens computed
    requests: int = 0  # requests that finished
    ttft_s: float = 0.0  # summed time to first token
    first_tokens: int = 0  # requests that got their first token
    context: float = 0.0  # mean prompt + half the mean output of the finished requests
    # Timed by the clock, when the server ran a request at both ends of the window and counts
    # its steps: the mean engine step (wall seconds over steps) and the prompt tokens each step
    # computed besides its decodes. Unlike the inter-token latency, the wall clock does not
    # count the time a preempted request waits to be readmitted as one long step.
    wall_step_s: float = 0.0
    prefill_per_step: float = 0.0

    def to_json(self) -> list[float]:
        # Compact: a file of a fleet keeps hundreds of these.
        return [
            round(self.batch, 4),
            self.step_s,
            self.tokens,
            self.prefill_s,
            self.prefill_tokens,
            self.requests,
            self.ttft_s,
            self.first_tokens,
            round(self.context, 1),
            self.wall_step_s,
            round(self.prefill_per_step, 3),
        ]

    @classmethod
    def from_json(cls, raw: object, where: str) -> Sample:
        # 9 numbers: written before samples were timed by the clock.
        if not isinstance(raw, list) or len(raw) not in (9, 11):
            raise CalibrationError(f"{where}: not a list of 11 numbers")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw):
            raise CalibrationError(f"{where}: not a list of 11 numbers")
        b, s, t, ps, pt, r, ts, ft, c, *timed = raw
        wall, per_step = (float(timed[0]), float(timed[1])) if timed else (0.0, 0.0)
        return cls(
            float(b),
            float(s),
            int(t),
            float(ps),
            int(pt),
            int(r),
            float(ts),
            int(ft),
            float(c),
            wall,
            per_step,
        )


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
