"""Each measured figure (KV tokens, decode step, prefill speed, TTFT) beside the performance
model's for the same server, with whether it is trusted and why not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, FiniteFloat

from fleetctl.model.calibration.fit import StepModel, fit_step
from fleetctl.model.calibration.rules import (
    DEFAULT_CONTEXT,
    IMPLAUSIBLE_RATIO,
    MIN_DECODE_TOKENS,
    MIN_DECODE_WINDOWS,
    MIN_PREFILL_REQUESTS,
)
from fleetctl.model.calibration.window import Sample
from fleetctl.model.perf import EnginePerf


@dataclass(frozen=True)
class Figure:
    """One measured figure, the model's for the same server, and whether to use it."""

    value: FiniteFloat
    model: FiniteFloat | None = None
    # Not trusted unless it says so: a file's figure without the key is not used.
    trusted: bool = False
    why: str = ""  # why it is not trusted, or a note on how it was measured


def _checked(value: float, model: float | None, what: str, note: str = "") -> Figure:
    """Flag a figure 10x or more off the model's."""
    if model and model > 0 and value > 0:
        ratio = value / model
        if ratio >= IMPLAUSIBLE_RATIO or ratio <= 1 / IMPLAUSIBLE_RATIO:
            return Figure(value, model, False, f"{what} is {ratio:.3g}x the model's: implausible")
    return Figure(value, model, True, note)


def _beyond(f: Figure, broken: bool, why: str) -> Figure:
    """`f`, untrusted with `why` when it breaks physics (no GPU runs faster than its peak)."""
    return Figure(f.value, f.model, False, why) if broken else f


@dataclass(frozen=True)
class Figures:
    kv_tokens: Figure | None = None
    step: StepModel | None = None
    # The fitted step at the samples' mean batch (in seconds, as its key says).
    step_at_batch: Annotated[Figure | None, Field(alias="step_at_batch_s")] = None
    prefill_tok_s: Figure | None = None
    ttft_s: Figure | None = None


def measure(
    samples: Sequence[Sample],
    kv_tokens: Sequence[int],
    perf: EnginePerf | None = None,
    model_kv_tokens: int | None = None,
    previous_kv: int | None = None,
) -> Figures:
    """Every figure the samples and KV readings support, each checked against the model."""
    kv = None
    if kv_tokens:
        measured = sorted(kv_tokens)[len(kv_tokens) // 2]
        kv = _checked(float(measured), _f(model_kv_tokens), "KV capacity")
        if kv.trusted and previous_kv and not 0.1 < measured / previous_kv < 10:
            kv = Figure(kv.value, kv.model, False, f"a 10x jump from the last {previous_kv:,}")
    step, note = fit_step(samples)
    at_batch = None
    decoding = [s for s in samples if s.tokens > 0]
    if step is not None:
        tokens = sum(s.tokens for s in decoding)
        batch = sum(s.batch * s.tokens for s in decoding) / tokens
        ctx = mean_context(samples)
        model_step = perf.step_time(max(1, round(batch)), batch * ctx) if perf else None
        if len(decoding) < MIN_DECODE_WINDOWS or tokens < MIN_DECODE_TOKENS:
            at_batch = Figure(
                step.at(batch),
                model_step,
                False,
                f"too few samples ({len(decoding)} windows, {tokens} tokens; need "
                f"{MIN_DECODE_WINDOWS} and {MIN_DECODE_TOKENS})",
            )
        else:
            at_batch = _checked(step.at(batch), model_step, "the decode step", note)
            if perf is not None:
                # The windows' own steps, not the fit's split of them into terms: a step can
                # be no shorter than reading its weights and KV at the GPU's peak bandwidth.
                seen = sum(s.tokens * (s.wall_step_s or s.step_s) for s in decoding) / tokens
                floor = (
                    sum(
                        s.tokens * perf.min_step_s(max(1, round(s.batch)), s.batch * ctx)
                        for s in decoding
                    )
                    / tokens
                )
                at_batch = _beyond(
                    at_batch,
                    seen < floor,
                    f"the decode steps ({seen * 1e3:.2f} ms) are shorter than reading the "
                    f"weights and KV at the GPU's peak bandwidth ({floor * 1e3:.2f} ms)",
                )
    prefill = None
    requests = sum(s.requests for s in samples)
    seconds = sum(s.prefill_s for s in samples)
    tokens_in = sum(s.prefill_tokens for s in samples)
    if requests and seconds > 0 and tokens_in > 0:
        mean_prompt = tokens_in / requests
        model_tok_s = mean_prompt / perf.prefill_time(max(1, round(mean_prompt))) if perf else None
        if requests < MIN_PREFILL_REQUESTS:
            prefill = Figure(
                tokens_in / seconds,
                model_tok_s,
                False,
                f"too few samples ({requests} requests; need {MIN_PREFILL_REQUESTS})",
            )
        else:
            prefill = _checked(tokens_in / seconds, model_tok_s, "prefill speed")
            if perf is not None:
                ceiling = perf.max_prefill_tok_s(max(1, round(mean_prompt)))
                prefill = _beyond(
                    prefill,
                    tokens_in / seconds > ceiling,
                    f"prefill is faster than the GPU's peak compute allows ({ceiling:,.0f} "
                    "tok/s): were cached prompt tokens counted as computed?",
                )
    ttft = None
    first = sum(s.first_tokens for s in samples)
    if first:
        ttft = Figure(sum(s.ttft_s for s in samples) / first, None, True)
    return Figures(kv, step, at_batch, prefill, ttft)


def mean_context(samples: Sequence[Sample]) -> float:
    known = [(s.context, s.requests or 1) for s in samples if s.context > 0]
    if not known:
        return DEFAULT_CONTEXT
    return sum(c * n for c, n in known) / sum(n for _, n in known)


def _f(v: int | None) -> float | None:
    return None if v is None else float(v)
