"""What the calibration's users take from an entry: the engine's measured terms in
`EnginePerf`'s own units (a speed, fixed and per-sequence step costs, a prefill compute
speed) and the measured KV, and the figures beside the model's for people."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fleetctl.model.calibration.figures import Figure, mean_context
from fleetctl.model.calibration.fit import StepModel
from fleetctl.model.calibration.rules import IMPLAUSIBLE_RATIO
from fleetctl.model.calibration.store import Calibration, Entry
from fleetctl.model.perf import BLOCK_SIZE, EnginePerf, cuda_total, vllm_batch_defaults

# How far past a GPU's peak a measured term may be and still be a noisy reading of a GPU near
# its peak (then capped at the peak), rather than a broken measurement (refused).
PEAK_NOISE = 0.10


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
    # Terms measured but not used because they would run the GPU past its peak, and why.
    refused: tuple[str, ...] = ()

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
        parts += self.refused
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
    model's mean step at that window's batch, context and prompt tokens per step (a window's
    mean step carries the prefill chunks run beside its decodes, `_window_step`), weighted by
    its tokens. None unless the step fit is trusted, or when the measured steps are no longer
    than what no GPU speed shortens (nothing left to scale) or the speed is 10x off the
    model's."""
    decoding = [s for s in entry.samples if s.tokens > 0]
    if entry.step is None or not entry.step_trusted or not decoding:
        return None
    ctx = mean_context(entry.samples)
    chunk = prefill_chunk(entry, perf)
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
        return sum(w * _window_step(at, b, c, ctx, chunk) for (b, c), w in shapes.items()) / total

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


def prefill_chunk(entry: Entry, perf: EnginePerf) -> int | None:
    """The prompt tokens a step that prefills computes beside its decodes: the mean prompt the
    entry's finished requests computed (vLLM V1 schedules a waiting prompt whole where the
    step's token budget allows), at most the release's default budget. None when no request
    finished."""
    requests = sum(s.requests for s in entry.samples)
    tokens = sum(s.prefill_tokens for s in entry.samples)
    if not requests or not tokens:
        return None
    max_len = entry.key.max_model_len or perf.model.max_context
    budget, _ = vllm_batch_defaults(perf.gpu, perf.vllm_version, max_len)
    return max(1, min(round(tokens / requests), budget))


def _window_step(
    perf: EnginePerf, batch: int, per_step: float, ctx: float, chunk: int | None
) -> float:
    """The model's mean step over a window of `batch` decodes at `ctx` tokens each that
    computed `per_step` prompt tokens a step on average. Those come as whole chunks of `chunk`
    tokens in some of the steps, not as a sliver in each: a step with a 550-token chunk is
    compute-bound where a decode step reads the weights, so spreading the chunk over the
    window's steps hid most of its cost (a 4090 at 0.7x its profile under 400-700-token
    prompts read 0.56x). Without a chunk (no request finished), every step carries
    `per_step`."""
    decode = perf.step_time(batch, batch * ctx)
    if per_step <= 0:
        return decode
    # A window that prefilled more than a chunk a step prefilled in every step.
    size = per_step if chunk is None else max(per_step, chunk)
    mixed = perf.step_time(
        round(batch + size),
        batch * ctx + size,
        batch * ctx + size * size / 2,
        seqs=batch + 1,
    )
    share = per_step / size
    return (1.0 - share) * decode + share * mixed


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
    return None if fit is None else within_physics(fit, perf)


def within_physics(fit: EngineFit, perf: EnginePerf) -> EngineFit:
    """`fit` with no term past the GPU's peaks (memory read faster than its peak bandwidth,
    or compute faster than its peak FLOP/s). A term up to PEAK_NOISE past is a noisy
    measurement of a GPU near its peak: capped at it. One further past is broken (cached
    tokens counted as computed, another model behind the URL): refused, with why."""
    notes = list(fit.refused)

    def bounded(value: float | None, bound: float, what: str) -> float | None:
        if value is None or value <= bound:
            return value
        if value <= bound * (1 + PEAK_NOISE):
            notes.append(f"{what} {value:.2f}x the model's capped at the GPU's peak ({bound:.2f}x)")
            return bound
        notes.append(
            f"{what} {value:.2f}x the model's not used: past the GPU's peak (at most {bound:.2f}x)"
        )
        return None

    speed = bounded(fit.speed, perf.max_speed, "speed")
    compute = bounded(fit.compute_speed, perf.max_compute_speed, "prefill compute")
    return replace(fit, speed=speed, compute_speed=compute, refused=tuple(notes))


def _mean_batch(entry: Entry) -> float:
    decoding = [s for s in entry.samples if s.tokens > 0]
    tokens = sum(s.tokens for s in decoding)
    return sum(s.batch * s.tokens for s in decoding) / tokens if tokens else 1.0


def _gpu_work(entry: Entry, perf: EnginePerf, batch: float) -> float:
    """The model's GPU seconds for a decode step of `batch` at the entry's mean context."""
    b = max(1, round(batch))
    bare = replace(perf, overhead_s=0.0, per_seq_s=0.0)
    return bare.step_time(b, b * mean_context(entry.samples))


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
            per_gpu += int((now - was) * cuda_total(perf.gpu))
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


# --- the one lookup: a calibrated engine -------------------------------------------------------

# What every command quotes an engine's speed at, so that their figures can be laid side by
# side: decode at these batch sizes of sequences this long, and one prompt this long alone
# (estimate's defaults).
REFERENCE_BATCHES = (1, 8, 32)
REFERENCE_CONTEXT = 1024
REFERENCE_PROMPT = 1024


@dataclass(frozen=True)
class Calibrated:
    """One engine as every command uses it: the performance model's, with what live servers of
    its class measured in place of the model's figures (see `calibrated`)."""

    perf: EnginePerf
    kv_tokens: int
    measured: Measured | None = None  # None: the model's figures alone
    entry: Entry | None = None  # the calibration entry of its class, trusted figures or not

    @property
    def provenance(self) -> str:
        """`calibrated from 3 servers, 2026-12-01 10:20 (KV 20,576 tokens, speed 0.70x ...)`,
        or "" for the model's own figures."""
        return "" if self.measured is None else self.measured.provenance

    def sources(self) -> dict[str, str]:
        """Per figure, where it comes from: measured, scaled from a measurement (by how
        much), or modelled."""
        m = self.measured
        fit = m.fit if m is not None else None
        kv = "measured" if m is not None and m.kv_tokens is not None else "modelled"
        decode = prefill = "modelled"
        if fit is not None and fit.speed is not None:
            decode = f"scaled from a measurement: speed {fit.speed:.2f}x the model's"
            prefill = f"scaled from the measured decode speed ({fit.speed:.2f}x)"
        elif fit is not None and fit.overhead_s is not None:
            decode = (
                f"measured: steps {fit.overhead_s * 1e3:.2f} ms + "
                f"{(fit.per_seq_s or 0.0) * 1e3:.2f} ms a sequence on the model's GPU work"
            )
        if fit is not None and fit.compute_speed is not None:
            prefill = f"scaled from a measurement: compute {fit.compute_speed:.2f}x the model's"
        return {"kv_cache_tokens": kv, "decode": decode, "prefill": prefill}

    def figures(self) -> dict[str, Any]:
        """The engine's figures at the reference shapes, as plan, estimate, simulate and
        status print them (`perf` in their JSON): KV tokens, decode tokens/s per sequence at
        batch 1, 8 and 32 of REFERENCE_CONTEXT tokens, one REFERENCE_PROMPT's prefill
        tokens/s, and where each comes from."""
        p = self.perf
        decode = {
            str(b): round(1.0 / p.step_time(b, b * REFERENCE_CONTEXT), 2) for b in REFERENCE_BATCHES
        }
        return {
            "kv_cache_tokens": self.kv_tokens,
            "decode_tok_s_per_seq_at_batch": decode,
            "prefill_tok_s": round(REFERENCE_PROMPT / p.prefill_time(REFERENCE_PROMPT), 1),
            "source": {"calibrated": self.provenance or None, **self.sources()},
        }


def calibrated(
    calibration: Calibration | None,
    perf: EnginePerf,
    kv_tokens: int,
    *,
    vllm_version: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
) -> Calibrated:
    """The engine `perf` with `kv_tokens` of KV, as measured where `calibration` has an entry
    for its class (GPU, model, format, TP; then the same vLLM release and max_model_len): the
    one place any command looks a calibration up and applies it. A measured ratio travels to
    every batch size through the model's own shape (an `EngineFit` is in the model's terms),
    and no term past the GPU's peaks is used (`within_physics`)."""
    if calibration is None:
        return Calibrated(perf, kv_tokens)
    entry = calibration.find(
        perf.gpu.name,
        perf.model.name,
        perf.fmt.name,
        perf.tp,
        vllm_version if vllm_version is not None else perf.vllm_version,
        max_model_len,
    )
    found = measured(entry, perf, gpu_memory_utilization) if entry is not None else None
    if found is None:
        return Calibrated(perf, kv_tokens, entry=entry)
    kv = found.kv_tokens if found.kv_tokens is not None else kv_tokens
    return Calibrated(found.perf(perf), kv, found, entry)
