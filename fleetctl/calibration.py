"""Calibration from the live fleet: what running vLLM servers measure, fitted and kept per class.

Pure core: parse one /metrics page into the counters that matter, turn two scrapes of a server
into one window sample, fit the decode step model `step = fixed_s + per_seq_s x running` over
the samples, and check each figure against the performance model's for the same server. The
store (`Calibration`) is what `.fleetctl/calibration.json` holds; `fleetctl calibrate` writes it
and `fleetctl estimate` reads it (fleetctl/statedir.py owns the file). `measured` turns an entry
into what plan, route-serve, simulate and status use in place of the model's figures.

Metric names are vLLM 0.32's, checked against a real server's page
(shared/captures/vllm-0.32.0-cpu-metrics.txt). Latency histograms are observed when a request
finishes (prefill time, prompt tokens) or as tokens stream out (inter-token latency), so the
figures are deltas of `_sum`/`_count` between two scrapes, never the totals since start-up.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from fleetctl.perf import BLOCK_SIZE, CUDA_INVISIBLE_BYTES, EnginePerf
from fleetctl.vllm_metrics import Scrape

CALIBRATION_FORMAT = 1
# A fit from fewer windows or tokens than this is noise, not a measurement.
MIN_DECODE_WINDOWS = 3
MIN_DECODE_TOKENS = 100
MIN_PREFILL_REQUESTS = 3
# Timed windows for the clock's fit of three costs (fixed, per sequence, per prompt token).
MIN_TIMED_WINDOWS = 6
# A measured figure this many times off the model's is a broken server or a wrong key (another
# model behind the URL), not a calibration: kept and shown, never used.
IMPLAUSIBLE_RATIO = 10.0
KEEP_SAMPLES = 256  # the sliding window of decode/prefill samples an entry keeps, newest last
DEFAULT_CONTEXT = 512  # tokens per sequence for the model's step when the server gave no lengths


class CalibrationError(ValueError):
    """A calibration document that is not one: the message says which field and why."""


# --- two scrapes: one window -------------------------------------------------------------------


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


# --- the fit -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepModel:
    """An engine step's seconds: `fixed_s + per_seq_s x running` for its decodes, plus
    `per_prefill_token_s` for each prompt token it computes beside them (when the samples were
    timed by the clock). per_seq_s is None when the samples' batch sizes were too alike to
    separate the two: fixed_s is then the mean step at `batch_lo`..`batch_hi`."""

    fixed_s: float
    per_seq_s: float | None
    batch_lo: float
    batch_hi: float
    per_prefill_token_s: float | None = None

    def at(self, batch: float) -> float:
        """A step of `batch` decodes alone."""
        return self.fixed_s + (self.per_seq_s or 0.0) * batch

    def to_json(self) -> dict[str, Any]:
        return {
            "fixed_s": self.fixed_s,
            "per_seq_s": self.per_seq_s,
            "batch_lo": round(self.batch_lo, 3),
            "batch_hi": round(self.batch_hi, 3),
            "per_prefill_token_s": self.per_prefill_token_s,
        }


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
        fitted = _fit_timed([replace(s, wall_step_s=s.step_s) for s in decoding])
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


# --- figures, each beside the model's ----------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One measured figure, the model's for the same server, and whether to use it."""

    value: float
    model: float | None = None
    trusted: bool = True
    why: str = ""  # why it is not trusted, or a note on how it was measured

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "model": self.model, "trusted": self.trusted, "why": self.why}

    @classmethod
    def from_json(cls, raw: object, where: str) -> Figure:
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: not an object")
        value = _num(raw, "value", where)
        model = raw.get("model")
        if model is not None and not _is_num(model):
            raise CalibrationError(f"{where}.model: not a number")
        trusted, why = raw.get("trusted", False), raw.get("why", "")
        if not isinstance(trusted, bool) or not isinstance(why, str):
            raise CalibrationError(f"{where}: 'trusted' must be true or false, 'why' a string")
        return cls(value, None if model is None else float(model), trusted, why)


def _checked(value: float, model: float | None, what: str, note: str = "") -> Figure:
    """Flag a figure 10x or more off the model's."""
    if model and model > 0 and value > 0:
        ratio = value / model
        if ratio >= IMPLAUSIBLE_RATIO or ratio <= 1 / IMPLAUSIBLE_RATIO:
            return Figure(value, model, False, f"{what} is {ratio:.3g}x the model's: implausible")
    return Figure(value, model, True, note)


@dataclass(frozen=True)
class Figures:
    kv_tokens: Figure | None = None
    step: StepModel | None = None
    step_at_batch: Figure | None = None  # the fitted step at the samples' mean batch
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
        ctx = _mean_context(samples)
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
    ttft = None
    first = sum(s.first_tokens for s in samples)
    if first:
        ttft = Figure(sum(s.ttft_s for s in samples) / first, None, True)
    return Figures(kv, step, at_batch, prefill, ttft)


def _mean_context(samples: Sequence[Sample]) -> float:
    known = [(s.context, s.requests or 1) for s in samples if s.context > 0]
    if not known:
        return DEFAULT_CONTEXT
    return sum(c * n for c, n in known) / sum(n for _, n in known)


def _f(v: int | None) -> float | None:
    return None if v is None else float(v)


# --- the store ---------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Key:
    """What an entry is for. `node` only for a node that differs from its class (health)."""

    gpu: str
    model: str
    format: str
    tp: int
    vllm_version: str | None = None
    max_model_len: int | None = None
    node: str | None = None

    @property
    def text(self) -> str:
        out = f"{self.model} {self.format} on {self.tp}x {self.gpu}"
        if self.vllm_version:
            out += f", vLLM {self.vllm_version}"
        if self.max_model_len:
            out += f", max_model_len {self.max_model_len:,}"
        return out + (f" (node {self.node})" if self.node else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "model": self.model,
            "format": self.format,
            "tp": self.tp,
            "vllm_version": self.vllm_version,
            "max_model_len": self.max_model_len,
            "node": self.node,
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> Key:
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: not an object")
        for name in ("gpu", "model", "format"):
            if not isinstance(raw.get(name), str) or not raw[name]:
                raise CalibrationError(f"{where}.{name}: not a name")
        tp = raw.get("tp")
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise CalibrationError(f"{where}.tp: not a positive whole number")
        version, length, node = raw.get("vllm_version"), raw.get("max_model_len"), raw.get("node")
        if version is not None and not isinstance(version, str):
            raise CalibrationError(f"{where}.vllm_version: not a string")
        if length is not None and (not isinstance(length, int) or isinstance(length, bool)):
            raise CalibrationError(f"{where}.max_model_len: not a whole number")
        if node is not None and not isinstance(node, str):
            raise CalibrationError(f"{where}.node: not a string")
        return cls(raw["gpu"], raw["model"], raw["format"], tp, version, length, node)


@dataclass(frozen=True)
class Entry:
    """The measured figures of one key: from `servers`, fitted over `samples`, at `measured_at`
    (UTC, ISO 8601)."""

    key: Key
    measured_at: str
    servers: tuple[str, ...] = ()
    kv_tokens: Figure | None = None
    step: StepModel | None = None
    step_at_batch: Figure | None = None
    prefill_tok_s: Figure | None = None
    ttft_s: Figure | None = None
    samples: tuple[Sample, ...] = ()
    gpu_memory_utilization: float | None = None  # the servers' (their KV cache depends on it)

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    @property
    def step_trusted(self) -> bool:
        return (
            self.step is not None and self.step_at_batch is not None and self.step_at_batch.trusted
        )

    def describe(self) -> str:
        """`calibrated from 3 servers, 2026-12-01 10:20`."""
        n = len(self.servers)
        when = self.measured_at[:16].replace("T", " ")
        return f"calibrated from {n} server{'s' if n != 1 else ''}, {when}"

    def to_json(self) -> dict[str, Any]:
        def fig(f: Figure | None) -> dict[str, Any] | None:
            return None if f is None else f.to_json()

        return {
            "key": self.key.to_json(),
            "measured_at": self.measured_at,
            "servers": list(self.servers),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "n_samples": self.n_samples,
            "kv_tokens": fig(self.kv_tokens),
            "step": None if self.step is None else self.step.to_json(),
            "step_at_batch_s": fig(self.step_at_batch),
            "prefill_tok_s": fig(self.prefill_tok_s),
            "ttft_s": fig(self.ttft_s),
            "samples": [s.to_json() for s in self.samples],
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> Entry:
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: not an object")
        key = Key.from_json(raw.get("key"), f"{where}.key")
        at = raw.get("measured_at")
        if not isinstance(at, str) or not at:
            raise CalibrationError(f"{where}.measured_at: not a timestamp")
        servers = raw.get("servers", [])
        if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
            raise CalibrationError(f"{where}.servers: not a list of URLs")
        samples = raw.get("samples", [])
        if not isinstance(samples, list):
            raise CalibrationError(f"{where}.samples: not a list")

        def fig(name: str) -> Figure | None:
            v = raw.get(name)
            return None if v is None else Figure.from_json(v, f"{where}.{name}")

        util = raw.get("gpu_memory_utilization")
        if util is not None and not _is_num(util):
            raise CalibrationError(f"{where}.gpu_memory_utilization: not a number")
        step = raw.get("step")
        model = None
        if step is not None:
            if not isinstance(step, dict):
                raise CalibrationError(f"{where}.step: not an object")
            per = step.get("per_seq_s")
            if per is not None and not _is_num(per):
                raise CalibrationError(f"{where}.step.per_seq_s: not a number")
            prompt = step.get("per_prefill_token_s")
            if prompt is not None and not _is_num(prompt):
                raise CalibrationError(f"{where}.step.per_prefill_token_s: not a number")
            model = StepModel(
                _num(step, "fixed_s", f"{where}.step"),
                None if per is None else float(per),
                _num(step, "batch_lo", f"{where}.step"),
                _num(step, "batch_hi", f"{where}.step"),
                None if prompt is None else float(prompt),
            )
        return cls(
            key,
            at,
            tuple(servers),
            fig("kv_tokens"),
            model,
            fig("step_at_batch_s"),
            fig("prefill_tok_s"),
            fig("ttft_s"),
            tuple(Sample.from_json(s, f"{where}.samples[{i}]") for i, s in enumerate(samples)),
            util,
        )


@dataclass(frozen=True)
class Calibration:
    entries: tuple[Entry, ...] = field(default_factory=tuple)
    # How long servers took to start, as apply timed them (warm-up; fleetctl/warmup.py).
    startups: tuple[Startup, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "entries": [e.to_json() for e in sorted(self.entries, key=lambda e: e.key)],
            "startups": [s.to_json() for s in sorted(self.startups, key=lambda s: s.key)],
        }

    @classmethod
    def from_json(cls, raw: object) -> Calibration:
        """A calibration from a parsed document; CalibrationError names the field that is wrong."""
        if not isinstance(raw, dict):
            raise CalibrationError("not a JSON object")
        fmt = raw.get("format")
        if fmt != CALIBRATION_FORMAT:
            newer = isinstance(fmt, int) and fmt > CALIBRATION_FORMAT
            raise CalibrationError(
                f"format {fmt!r} was written by a {'newer' if newer else 'different'} fleetctl "
                f"(this one reads {CALIBRATION_FORMAT})"
            )
        entries = raw.get("entries")
        if not isinstance(entries, list):
            raise CalibrationError("no 'entries' list")
        # Absent from files written before apply timed start-ups.
        startups = raw.get("startups", [])
        if not isinstance(startups, list):
            raise CalibrationError("'startups' is not a list")
        return cls(
            tuple(Entry.from_json(e, f"entries[{i}]") for i, e in enumerate(entries)),
            tuple(Startup.from_json(s, f"startups[{i}]") for i, s in enumerate(startups)),
        )

    def get(self, key: Key) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def merged(self, fresh: Iterable[Entry]) -> Calibration:
        """This calibration with `fresh` entries replacing those of the same key."""
        new = {e.key: e for e in fresh}
        kept = [e for e in self.entries if e.key not in new]
        return Calibration(tuple(kept) + tuple(new.values()), self.startups)

    def find(
        self,
        gpu: str,
        model: str,
        fmt: str,
        tp: int,
        vllm_version: str | None = None,
        max_model_len: int | None = None,
    ) -> Entry | None:
        """The entry for a class: the same GPU, model, format and TP; of those, a class entry
        (not one node's), then the same vLLM version, then the same max_model_len, then the
        newest."""
        return _best(self.entries, (gpu, model, fmt, tp), vllm_version, max_model_len)


def entry_for(
    key: Key,
    servers: Sequence[str],
    samples: Sequence[Sample],
    kv_tokens: Sequence[int],
    measured_at: str,
    previous: Entry | None = None,
    perf: EnginePerf | None = None,
    model_kv_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
) -> Entry:
    """The entry after a calibration run: this run's samples after the previous entry's (the
    newest KEEP_SAMPLES of them), refitted; KV from this run's servers."""
    kept = ((previous.samples if previous else ()) + tuple(samples))[-KEEP_SAMPLES:]
    prev_kv = None
    if previous and previous.kv_tokens and previous.kv_tokens.trusted:
        prev_kv = int(previous.kv_tokens.value)
    figs = measure(kept, kv_tokens, perf, model_kv_tokens, prev_kv)
    util = gpu_memory_utilization
    if figs.kv_tokens is None and previous is not None:
        figs = replace(figs, kv_tokens=previous.kv_tokens)
        util = previous.gpu_memory_utilization
    return Entry(
        key,
        measured_at,
        tuple(servers),
        figs.kv_tokens,
        figs.step,
        figs.step_at_batch,
        figs.prefill_tok_s,
        figs.ttft_s,
        kept,
        util,
    )


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _num(raw: dict[str, Any], name: str, where: str) -> float:
    v = raw.get(name)
    if not _is_num(v):
        raise CalibrationError(f"{where}.{name}: not a number")
    return float(v)  # type: ignore[arg-type]


# --- what the calibration's users take from an entry -------------------------------------------


@dataclass(frozen=True)
class EngineFit:
    """What measured steps say about one engine, in `EnginePerf`'s own terms; None: not measured.

    Two shapes. A GPU server whose steps are mostly GPU work gets `speed` (its GPU work over the
    model's). A server whose GPU work is too small to see in its steps (a small model, a CPU
    server, a slow host) gets its fixed and per-sequence step costs instead. Either may add
    `compute_speed`, from its prefills, where they were compute-bound."""

    speed: float | None = None
    compute_speed: float | None = None
    overhead_s: float | None = None
    per_seq_s: float | None = None

    def apply(self, perf: EnginePerf) -> EnginePerf:
        """`perf` with every measured term; the others as they were."""
        return replace(
            perf,
            speed=perf.speed if self.speed is None else self.speed,
            compute_speed=perf.compute_speed if self.compute_speed is None else self.compute_speed,
            overhead_s=perf.overhead_s if self.overhead_s is None else self.overhead_s,
            per_seq_s=perf.per_seq_s if self.per_seq_s is None else self.per_seq_s,
        )

    def text(self) -> str:
        """`speed 0.70x the model's` or `steps 11.2 ms + 0.41 ms a sequence`."""
        parts = []
        if self.speed is not None:
            parts.append(f"speed {self.speed:.2f}x the model's")
        if self.overhead_s is not None:
            parts.append(
                f"steps {self.overhead_s * 1e3:.2f} ms + {(self.per_seq_s or 0) * 1e3:.2f} ms "
                "a sequence"
            )
        if self.compute_speed is not None:
            parts.append(f"prefill compute {self.compute_speed:.2f}x the model's")
        return ", ".join(parts)


@dataclass(frozen=True)
class Measured:
    """What an entry lets plan, route-serve, simulate and status use in place of the model's:
    the measured KV tokens and the engine's measured step terms, each None when the entry holds
    no trusted figure for it; `provenance` says where they came from."""

    kv_tokens: int | None
    fit: EngineFit | None
    provenance: str

    @property
    def speed(self) -> float | None:
        return None if self.fit is None else self.fit.speed

    def perf(self, perf: EnginePerf) -> EnginePerf:
        """`perf` with the measured step terms."""
        return perf if self.fit is None else self.fit.apply(perf)


def speed_factor(entry: Entry, perf: EnginePerf) -> float | None:
    """The speed (what `EnginePerf.speed` scales: the GPU's work, not the host's) at which the
    model's steps take as long as the measured ones: each decode window's mean step beside the
    model's step at that window's batch, context and prompt tokens per step (a window's mean
    step carries the prefill chunks run beside its decodes), weighted by its tokens. None
    unless the step fit is trusted, or when the measured steps are no longer than what no GPU
    speed shortens (nothing left to scale) or the speed is 10x off the model's."""
    decoding = [s for s in entry.samples if s.tokens > 0]
    if entry.step is None or not entry.step_trusted or not decoding:
        return None
    ctx = _mean_context(entry.samples)
    # Windows of one batch and chunk have one model step: each shape is stepped once. (This
    # runs in route-serve's online fit, every few scrapes of every backend.)
    shapes: dict[tuple[int, int], float] = {}
    for s in decoding:
        shape = (max(1, round(s.batch)), round(s.prefill_per_step))
        shapes[shape] = shapes.get(shape, 0.0) + s.tokens
    total = sum(shapes.values())
    measured = sum(s.tokens * (s.wall_step_s or s.step_s) for s in decoding) / total

    def model(speed: float) -> float:
        at = replace(perf, speed=speed)
        return sum(w * _window_step(at, b, c, ctx) for (b, c), w in shapes.items()) / total

    # The model's step falls as the speed rises, down to what no GPU speed shortens (the host's
    # fixed cost, and the launches an eager step waits on). A measured step near that floor
    # says nothing of the GPU; a speed past the 10x bounds is no measurement of it either.
    lo, hi = 1 / IMPLAUSIBLE_RATIO, IMPLAUSIBLE_RATIO
    floor = model(1e9)
    gpu_at_one = model(1.0) - floor
    if gpu_at_one <= 0 or measured - floor < 0.01 * gpu_at_one:
        return None
    if not perf.launch_s and perf.compute_speed is None:
        # Both roofs scale as 1/speed and nothing else does: every step is floor + gpu / speed.
        speed = gpu_at_one / (measured - floor)
        return speed if lo < speed < hi else None
    # With a launch floor (eager) or a separate compute speed, the step is only monotone.
    if not model(hi) < measured < model(lo):
        return None
    for _ in range(40):  # bisection on a log scale: 100^(2^-40), far below any measurement
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if model(mid) > measured else (lo, mid)
    return math.sqrt(lo * hi)


def _window_step(perf: EnginePerf, batch: int, chunk: int, ctx: float) -> float:
    """The model's mean step for a window of `batch` decodes at `ctx` tokens each, and its
    prompt tokens per step (`chunk`) as one chunk beside them."""
    kv = batch * ctx + chunk
    pairs = batch * ctx + chunk * chunk / 2
    return perf.step_time(batch + chunk, kv, pairs, seqs=batch + (1 if chunk else 0))


def engine_fit(entry: Entry, perf: EnginePerf) -> EngineFit | None:
    """The measured step terms of `entry` for servers of `perf`'s class, or None.

    The GPU shape when `speed_factor` finds one. Otherwise, when the measured step is longer
    than the model's GPU work by more than 10x (the GPU part is invisible in it), the step line
    itself: its per-sequence slope less the model's per-sequence GPU work, and what is left at
    the mean batch as the fixed cost. Prefills then give `compute_speed` where the model's
    prefill of the mean prompt is compute-bound and the measured one is longer than the fixed
    costs."""
    fit: EngineFit | None = None
    step = entry.step
    # The clock's cost per prompt token needs no other term: it goes first, and the decode
    # step's GPU work is then the model's at that compute speed.
    compute = _compute_per_token(entry, perf)
    base = perf if compute is None else replace(perf, compute_speed=compute)
    # By the model's own account the GPU idles most of each step: the line is host cost.
    host_bound = _gpu_work(entry, base, _mean_batch(entry)) < base.step_overhead + base.launch_s
    if step is not None and entry.step_trusted and step.per_seq_s is not None and host_bound:
        fit = _host_bound(entry, step, base)
    if fit is None:
        # Over the model's own compute: a speed scales both roofs, and a window whose steps are
        # compute-bound would otherwise read its compute error as a bandwidth one.
        speed = speed_factor(entry, perf)
        if speed is not None:
            fit = EngineFit(speed=speed)
        elif step is not None and entry.step_trusted:
            fit = _host_bound(entry, step, base)
    if compute is None:  # from the requests' prefill times, past the fitted fixed costs
        compute = _compute_per_request(entry, fit.apply(perf) if fit else perf)
    if compute is not None:
        fit = replace(fit or EngineFit(), compute_speed=compute)
    return fit


def _mean_batch(entry: Entry) -> float:
    decoding = [s for s in entry.samples if s.tokens > 0]
    tokens = sum(s.tokens for s in decoding)
    return sum(s.batch * s.tokens for s in decoding) / tokens if tokens else 1.0


def _gpu_work(entry: Entry, perf: EnginePerf, batch: float) -> float:
    """The model's GPU seconds for a decode step of `batch` at the entry's mean context."""
    b = max(1, round(batch))
    bare = replace(perf, overhead_s=0.0, per_seq_s=0.0)
    return bare.step_time(b, b * _mean_context(entry.samples))


def _host_bound(entry: Entry, step: StepModel, perf: EnginePerf) -> EngineFit | None:
    """The measured line as host costs: its slope less the model's GPU work per sequence, and
    what is left at the mean batch as the fixed cost."""
    batch = _mean_batch(entry)
    at = max(1, round(batch))
    gpu = _gpu_work(entry, perf, at)
    per_gpu = _gpu_work(entry, perf, at + 1) - gpu
    per_seq = max(0.0, (step.per_seq_s or 0.0) - per_gpu)
    overhead = step.at(batch) - per_seq * batch - gpu
    if overhead <= 0:
        return None
    return EngineFit(overhead_s=overhead, per_seq_s=per_seq)


def _compute_per_token(entry: Entry, perf: EnginePerf) -> float | None:
    """Prefill compute measured over the model's, from the clock's cost per prompt token in a
    step, where the step fit has one."""
    step = entry.step
    if step is None or not step.per_prefill_token_s or not entry.step_trusted:
        return None
    chunks = [s.prefill_per_step for s in entry.samples if s.prefill_per_step > 0]
    chunk = max(1, round(sum(chunks) / len(chunks))) if chunks else 1
    bare = replace(perf, compute_speed=1.0, per_seq_s=0.0)
    model = bare.prefill_marginal(chunk) / chunk
    factor = model / step.per_prefill_token_s
    return factor if 1 / IMPLAUSIBLE_RATIO < factor < IMPLAUSIBLE_RATIO else None


def _compute_per_request(entry: Entry, perf: EnginePerf) -> float | None:
    """Prefill compute measured over the model's, from the entry's trusted prefill speed."""
    figure = entry.prefill_tok_s
    requests = sum(s.requests for s in entry.samples)
    prompt_tokens = sum(s.prefill_tokens for s in entry.samples)
    if figure is None or not figure.trusted or not requests or figure.value <= 0:
        return None
    prompt = max(1, round(prompt_tokens / requests))
    measured_s = prompt / figure.value
    # Compute time scales as 1/compute_speed and nothing else does: two speeds separate it.
    one = replace(perf, compute_speed=1.0).prefill_time(prompt)
    two = replace(perf, compute_speed=2.0).prefill_time(prompt)
    four = replace(perf, compute_speed=4.0).prefill_time(prompt)
    compute = 2.0 * (one - two)
    rest = one - compute
    if compute <= 0 or measured_s <= rest or abs(four - rest - compute / 4) > 1e-9 * one:
        return None  # bandwidth-bound (or partly so): the prefill does not measure compute
    factor = compute / (measured_s - rest)
    return factor if 1 / IMPLAUSIBLE_RATIO < factor < IMPLAUSIBLE_RATIO else None


def measured(
    entry: Entry, perf: EnginePerf, gpu_memory_utilization: float | None = None
) -> Measured | None:
    """The trusted figures of `entry` for servers of `perf`'s class; None when it has none.
    KV measured at another gpu_memory_utilization than `gpu_memory_utilization` moves by the
    memory the utilization moves (everything else vLLM reserves stays put)."""
    kv_tokens = None
    used: list[str] = []
    note = ""
    kv = entry.kv_tokens
    if kv is not None and kv.trusted and kv.value > 0:
        kv_tokens = int(kv.value)
        was, now = entry.gpu_memory_utilization, gpu_memory_utilization
        if was is not None and now is not None and abs(was - now) > 1e-9:
            per_token = perf.kv_token_bytes
            per_gpu = kv_tokens * per_token
            per_gpu += int((now - was) * (perf.gpu.memory_bytes - CUDA_INVISIBLE_BYTES))
            kv_tokens = max(0, per_gpu) // per_token // BLOCK_SIZE * BLOCK_SIZE
            note = f"; KV moved from gpu_memory_utilization {was:g} to {now:g}"
        used.append(f"KV {kv_tokens:,} tokens")
    fit = engine_fit(entry, perf)
    if fit is not None:
        used.append(fit.text())
    if not used:
        return None
    return Measured(kv_tokens, fit, f"{entry.describe()} ({', '.join(used)}){note}")


def beside_model(entry: Entry) -> dict[str, Any]:
    """An entry's measured figures beside the model's for the same servers (`fleetctl status`
    JSON): KV tokens, the decode step at the measured batch, prefill speed."""

    def pair(f: Figure | None, scale: float = 1.0) -> dict[str, Any] | None:
        if f is None:
            return None
        model = None if f.model is None else f.model * scale
        return {"model": model, "measured": f.value * scale, "trusted": f.trusted, "why": f.why}

    return {
        "source": entry.describe(),
        "kv_tokens": pair(entry.kv_tokens),
        "decode_step_ms": pair(entry.step_at_batch, 1e3),
        "prefill_tok_s": pair(entry.prefill_tok_s),
    }


def beside_model_text(entry: Entry) -> str:
    """`KV 47,712 tokens modelled, 40,000 measured; calibrated from 3 servers, ...`: one line
    for `fleetctl status`; a figure not trusted says so."""
    parts = []
    kv = entry.kv_tokens
    if kv is not None:
        text = f"KV {kv.model:,.0f} tokens modelled, " if kv.model is not None else "KV "
        text += f"{kv.value:,.0f} measured"
        parts.append(text + ("" if kv.trusted else " (not trusted)"))
    step = entry.step_at_batch
    if step is not None:
        text = f"step {step.model * 1e3:.1f} ms modelled, " if step.model is not None else "step "
        text += f"{step.value * 1e3:.1f} ms measured"
        parts.append(text + ("" if step.trusted else " (not trusted)"))
    return "; ".join([*parts, entry.describe()])


# --- one server's reading, for the command's table ---------------------------------------------


@dataclass(frozen=True)
class ServerReading:
    """What one calibration run read from one server: its figures beside the model's, or why
    it could not be read."""

    url: str
    node: str
    key: Key | None = None
    samples: tuple[Sample, ...] = ()
    kv_tokens: int | None = None
    figures: Figures = field(default_factory=Figures)
    gpu_memory_utilization: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        f = self.figures

        def fig(x: Figure | None) -> dict[str, Any] | None:
            return None if x is None else x.to_json()

        return {
            "url": self.url,
            "node": self.node,
            "key": None if self.key is None else self.key.to_json(),
            "error": self.error,
            "n_samples": len(self.samples),
            "kv_tokens": fig(f.kv_tokens),
            "step": None if f.step is None else f.step.to_json(),
            "step_at_batch_s": fig(f.step_at_batch),
            "prefill_tok_s": fig(f.prefill_tok_s),
            "ttft_s": fig(f.ttft_s),
        }


# --- start-up: how long a server takes from start to healthy ----------------------------------

KEEP_STARTUPS = 16  # start-ups an entry keeps per key, newest last

_SECONDS = r"([0-9]+(?:\.[0-9]+)?)\s*(?:s|secs?|seconds)\b"
# (phase, pattern): the first match of each counts; later lines of the same phase (one per
# tensor-parallel rank) took as long, in parallel.
_STARTUP_PHASES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model_init_s", re.compile(r"Initializing model took " + _SECONDS)),
    ("weights_s", re.compile(r"Loading weights took " + _SECONDS)),
    # The GPU runner: the whole load (init and weights) in one line.
    ("model_load_s", re.compile(r"Model loading took [0-9.]+ GiB (?:memory )?and " + _SECONDS)),
    ("compile_s", re.compile(r"torch\.compile takes " + _SECONDS + r" in total")),
    ("graphs_s", re.compile(r"Graph capturing finished in " + _SECONDS)),
    ("engine_init_s", re.compile(r"init engine (?:\([^)]*\) )?took " + _SECONDS)),
)


def parse_startup_log(text: str) -> dict[str, float]:
    """The start-up phases a vLLM server's log names, in seconds: model_init_s, weights_s,
    model_load_s (GPU runner), compile_s, graphs_s, engine_init_s (profile, KV cache and
    warm-up; it includes compile and graphs). A phase the log does not name is left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name, pattern in _STARTUP_PHASES:
            if name in out:
                continue
            m = pattern.search(line)
            if m:
                out[name] = float(m.group(1))
    return out


@dataclass(frozen=True)
class Startup:
    """How long servers of one key took from the start command to a healthy /health and
    /v1/models, as apply timed them (`seconds`, newest last), and the phases the newest
    one's log named. The figure used is the median: the first start on a node may include
    a download, or a cold page cache, that later ones do not."""

    key: Key
    measured_at: str
    seconds: tuple[float, ...]
    phases: tuple[tuple[str, float], ...] = ()
    servers: tuple[str, ...] = ()

    @property
    def median_s(self) -> float:
        xs = sorted(self.seconds)
        mid = len(xs) // 2
        return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

    def describe(self) -> str:
        """`measured by apply over 3 starts, 2026-12-01 10:20`."""
        n = len(self.seconds)
        when = self.measured_at[:16].replace("T", " ")
        return f"measured by apply over {n} start{'s' if n != 1 else ''}, {when}"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key.to_json(),
            "measured_at": self.measured_at,
            "median_s": round(self.median_s, 3),
            "seconds": [round(s, 3) for s in self.seconds],
            "phases": dict(self.phases),
            "servers": list(self.servers),
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> Startup:
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: not an object")
        key = Key.from_json(raw.get("key"), f"{where}.key")
        at = raw.get("measured_at")
        if not isinstance(at, str) or not at:
            raise CalibrationError(f"{where}.measured_at: not a timestamp")
        seconds = raw.get("seconds")
        if not isinstance(seconds, list) or not seconds or not all(_is_num(s) for s in seconds):
            raise CalibrationError(f"{where}.seconds: not a list of numbers")
        if any(s < 0 for s in seconds):
            raise CalibrationError(f"{where}.seconds: a negative time")
        phases = raw.get("phases", {})
        if not isinstance(phases, dict) or not all(
            isinstance(k, str) and _is_num(v) for k, v in phases.items()
        ):
            raise CalibrationError(f"{where}.phases: not an object of numbers")
        servers = raw.get("servers", [])
        if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
            raise CalibrationError(f"{where}.servers: not a list of names")
        return cls(
            key,
            at,
            tuple(float(s) for s in seconds),
            tuple((k, float(v)) for k, v in phases.items()),
            tuple(servers),
        )


def record_startup(
    cal: Calibration,
    key: Key,
    seconds: float,
    measured_at: str,
    phases: dict[str, float] | None = None,
    server: str = "",
) -> Calibration:
    """`cal` with one more start-up of `key` (the newest KEEP_STARTUPS kept)."""
    old = next((s for s in cal.startups if s.key == key), None)
    times = ((old.seconds if old else ()) + (seconds,))[-KEEP_STARTUPS:]
    servers = tuple(dict.fromkeys((*(old.servers if old else ()), server)))
    servers = tuple(s for s in servers if s)[-KEEP_STARTUPS:]
    fresh = Startup(key, measured_at, times, tuple((phases or {}).items()), servers)
    kept = tuple(s for s in cal.startups if s.key != key)
    return replace(cal, startups=(*kept, fresh))


def find_startup(
    cal: Calibration,
    gpu: str,
    model: str,
    fmt: str,
    tp: int,
    vllm_version: str | None = None,
) -> Startup | None:
    """The start-ups of a class (GPU, model, format, TP): the same vLLM version first, then
    the newest."""
    return _best(cal.startups, (gpu, model, fmt, tp), vllm_version)


class _Keyed(Protocol):
    @property
    def key(self) -> Key: ...

    @property
    def measured_at(self) -> str: ...


K = TypeVar("K", bound=_Keyed)


def _best(
    items: Iterable[K],
    cls: tuple[str, str, str, int],
    vllm_version: str | None,
    max_model_len: int | None = None,
) -> K | None:
    """Of `items` for a class (GPU, model, format, TP): a class-wide one (not one node's),
    then the same vLLM version, then the same max_model_len, then the newest."""
    found = [i for i in items if (i.key.gpu, i.key.model, i.key.format, i.key.tp) == cls]
    if not found:
        return None
    return max(
        found,
        key=lambda i: (
            i.key.node is None,
            vllm_version is not None and i.key.vllm_version == vllm_version,
            max_model_len is not None and i.key.max_model_len == max_model_len,
            i.measured_at,
        ),
    )
