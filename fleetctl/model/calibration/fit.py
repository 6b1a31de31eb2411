"""The decode step fitted over window samples: `step = fixed_s + per_seq_s x running`, plus a
cost per prompt token where the clock timed the steps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import FiniteFloat

from fleetctl.model.calibration.rules import MIN_TIMED_WINDOWS, rounded
from fleetctl.model.calibration.window import Sample


@dataclass(frozen=True)
class StepModel:
    """An engine step's seconds: `fixed_s + per_seq_s x running` for its decodes, plus
    `per_prefill_token_s` for each prompt token it computes beside them (when the samples were
    timed by the clock). per_seq_s is None when the samples' batch sizes were too alike to
    separate the two: fixed_s is then the mean step at `batch_lo`..`batch_hi`."""

    fixed_s: FiniteFloat
    per_seq_s: FiniteFloat | None
    batch_lo: Annotated[FiniteFloat, rounded(3)]
    batch_hi: Annotated[FiniteFloat, rounded(3)]
    per_prefill_token_s: FiniteFloat | None = None

    def at(self, batch: float) -> float:
        """A step of `batch` decodes alone."""
        return self.fixed_s + (self.per_seq_s or 0.0) * batch


def fit_step(samples: Iterable[Sample]) -> tuple[StepModel | None, str]:
    """The step model over the windows that decoded something, each weighted by its tokens:
    from the clock's mean step on decode batch and prompt tokens per step where at least
    MIN_TIMED_WINDOWS windows were timed so, else from the inter-token latency on batch; a
    note when only the fixed cost could be fitted. None when no window decoded anything."""
    decoding = [s for s in samples if s.tokens > 0]
    timed = [s for s in decoding if s.wall_step_s > 0]
    if len(timed) >= MIN_TIMED_WINDOWS:
        fitted = _fit_timed(timed)
        if fitted is not None:
            return fitted, ""
    if len(decoding) >= MIN_TIMED_WINDOWS:
        # The inter-token latency on the same terms: it too carries the steps' prefill chunks.
        fitted = _fit_timed([s._replace(wall_step_s=s.step_s) for s in decoding])
        if fitted is not None and fitted.per_prefill_token_s is not None:
            return fitted, ""
    pts = [(s.batch, s.step_s, float(s.tokens)) for s in decoding]
    if not pts:
        return None, "no decode tokens in any window"
    w = sum(p[2] for p in pts)
    mx = sum(b * t for b, _, t in pts) / w
    my = sum(s * t for _, s, t in pts) / w
    lo, hi = min(p[0] for p in pts), max(p[0] for p in pts)
    distinct = {round(b) for b, _, _ in pts}
    if len(distinct) < 2 or hi - lo < 1.0:
        return StepModel(my, None, lo, hi), (
            f"batch sizes too alike ({lo:.1f} to {hi:.1f} sequences): fixed cost only"
        )
    sxx = sum(t * (b - mx) ** 2 for b, _, t in pts)
    sxy = sum(t * (b - mx) * (s - my) for b, s, t in pts)
    slope = sxy / sxx
    if slope < 0:
        return StepModel(my, None, lo, hi), "per-sequence cost came out negative: fixed cost only"
    if my - slope * mx < 0:  # noisy windows over a narrow range of batches
        return StepModel(my, None, lo, hi), "fixed cost came out negative: fixed cost only"
    return StepModel(my - slope * mx, slope, lo, hi), ""


def _fit_timed(samples: Sequence[Sample]) -> StepModel | None:
    """Weighted least squares of the clock's step on [1, batch, prompt tokens per step]; the
    prompt term is left out when the windows hardly vary in it. None when a cost comes out
    negative (the windows do not separate the terms) or the batches are too alike."""
    lo, hi = min(s.batch for s in samples), max(s.batch for s in samples)
    if hi - lo < 1.0:
        return None
    rows = [((1.0, s.batch, s.prefill_per_step), s.wall_step_s, float(s.tokens)) for s in samples]
    spread = max(s.prefill_per_step for s in samples) - min(s.prefill_per_step for s in samples)
    coef = _least_squares(rows) if spread >= 1.0 else None
    # The prompt term must agree with the requests' own prefill times, which cost at most the
    # whole steps they took (fixed costs and decodes included): windows whose prompt tokens
    # move with their batch cannot separate the two, and then give nonsense.
    prompt_tokens = sum(s.prefill_tokens for s in samples)
    per_token = sum(s.prefill_s for s in samples) / prompt_tokens if prompt_tokens else None
    if coef is not None and per_token is not None and not per_token / 8 <= coef[2] <= per_token:
        coef = None
    if coef is None or any(c < 0 for c in coef):
        coef = _least_squares([(x[:2], y, w) for x, y, w in rows])
        if coef is None or any(c < 0 for c in coef):
            return None
        return StepModel(coef[0], coef[1], lo, hi)
    return StepModel(coef[0], coef[1], lo, hi, coef[2])


def _least_squares(rows: Sequence[tuple[tuple[float, ...], float, float]]) -> list[float] | None:
    """Weighted least squares by the normal equations (at most 3 unknowns: Gauss-Jordan)."""
    n = len(rows[0][0])
    a = [[sum(w * x[i] * x[j] for x, _, w in rows) for j in range(n)] for i in range(n)]
    b = [sum(w * x[i] * y for x, y, w in rows) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, abs(a[col][col])):
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]
