"""`fleetctl estimate`: will a model fit on a GPU group, and how fast will it run, in one answer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fleetctl.model.calibration import Calibration, calibrated
from fleetctl.model.catalog import FormatProfile, GpuProfile, ModelProfile
from fleetctl.model.perf import (
    EnginePerf,
    GiB,
    KvBudget,
    kv_budget,
    vllm_batch_defaults,
)
from fleetctl.vllm.release import release


@dataclass(frozen=True)
class Settings:
    """The `vllm serve` settings an estimate is for; None means vLLM's default."""

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # None: the release's default (0.9, 0.92)
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    vllm_version: str | None = None


@dataclass(frozen=True)
class Workload:
    """What the speeds are quoted at: `batch` sequences decoding, each `context` tokens long,
    and one prompt of `prompt` tokens prefilled alone."""

    batch: int = 1
    context: int = 1024
    prompt: int = 1024


MODELLED = {"kv_cache_tokens": "modelled", "decode": "modelled", "prefill": "modelled"}


@dataclass(frozen=True)
class Source:
    """Where the figures come from: the profiles through the model, or measured servers; per
    figure, measured, scaled from a measurement (by how much), or modelled."""

    kind: str = "model"  # "model" or "calibrated"
    detail: str = "profiles through fleetctl's performance model"
    figures: dict[str, str] = field(default_factory=lambda: dict(MODELLED))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "detail": self.detail, "figures": self.figures}


@dataclass(frozen=True)
class Estimate:
    gpu: GpuProfile
    model: ModelProfile
    fmt: FormatProfile
    settings: Settings
    workload: Workload
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    budget: KvBudget
    decode_step_s: float
    prefill_s: float
    source: Source = field(default_factory=Source)

    @property
    def fits(self) -> bool:
        """vLLM starts: the KV cache holds one sequence of max_model_len."""
        return self.budget.kv_tokens >= self.max_model_len

    @property
    def max_concurrency_at_max_len(self) -> float:
        """vLLM's "Maximum concurrency for N tokens per request": KV tokens / max_model_len."""
        return self.budget.kv_tokens / self.max_model_len

    @property
    def decode_tok_s_total(self) -> float:
        return self.workload.batch / self.decode_step_s

    @property
    def decode_tok_s_per_seq(self) -> float:
        return 1.0 / self.decode_step_s

    @property
    def prefill_tok_s(self) -> float:
        return self.workload.prompt / self.prefill_s

    def to_json(self) -> dict[str, Any]:
        b, s, w = self.budget, self.settings, self.workload
        return {
            "gpu": self.gpu.name,
            "model": self.model.name,
            "format": self.fmt.name,
            "tensor_parallel_size": s.tensor_parallel_size,
            "vllm_version": s.vllm_version,
            "settings": {
                "gpu_memory_utilization": s.gpu_memory_utilization,
                "max_model_len": self.max_model_len,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_seqs": self.max_num_seqs,
                "kv_cache_dtype": s.kv_cache_dtype,
                "enforce_eager": s.enforce_eager,
            },
            "fits": self.fits,
            "kv_cache_tokens": b.kv_tokens,
            "kv_cache_gib_per_gpu": _gib(max(0, b.kv_per_gpu)),
            "weights_gib_per_gpu": _gib(b.weights),
            "reserved_gib_per_gpu": _gib(b.reserve),
            "reserved_parts_gib_per_gpu": {
                "activation_peak": _gib(b.activation),
                "non_torch": _gib(b.non_torch),
                "cuda_graphs": _gib(b.cuda_graphs),
            },
            "max_concurrency_at_max_len": round(self.max_concurrency_at_max_len, 2),
            "batch": w.batch,
            "context": w.context,
            "prompt": w.prompt,
            **self._speeds(),
            "source": self.source.to_json(),
        }

    def _speeds(self) -> dict[str, float | None]:
        """The speeds, or None where the model does not fit: a server that never starts
        runs at no speed, and a figure would read as one it might."""
        speeds: dict[str, float | None] = {
            "decode_tok_s_per_seq": round(self.decode_tok_s_per_seq, 2),
            "decode_tok_s_total": round(self.decode_tok_s_total, 2),
            "step_time_ms": round(self.decode_step_s * 1e3, 3),
            "prefill_tok_s": round(self.prefill_tok_s, 1),
        }
        return speeds if self.fits else dict.fromkeys(speeds)


def _gib(n: float) -> float:
    return round(n / GiB, 3)


def estimate(
    gpu: GpuProfile,
    model: ModelProfile,
    fmt: FormatProfile,
    settings: Settings = Settings(),
    workload: Workload = Workload(),
    calibration: Calibration | None = None,
) -> Estimate:
    """Memory and speed of `model` in `fmt` on `tensor_parallel_size` GPUs of type `gpu`;
    with `calibration`, as its servers of that class measured them (the one calibrated model
    every command uses: fleetctl.model.calibration.calibrated)."""
    tp = settings.tensor_parallel_size
    rel = release(settings.vllm_version)
    max_len = settings.max_model_len or model.max_context
    if settings.gpu_memory_utilization is None:
        settings = replace(settings, gpu_memory_utilization=rel.default_utilization)
    assert settings.gpu_memory_utilization is not None
    # The release's defaults: V0 without chunked prefill batches a whole max-length prompt.
    default_tokens, default_seqs = vllm_batch_defaults(gpu, settings.vllm_version, max_len)
    tokens = settings.max_num_batched_tokens or default_tokens
    seqs = settings.max_num_seqs or default_seqs
    budget = kv_budget(
        gpu,
        model,
        fmt,
        tp,
        settings.gpu_memory_utilization,
        settings.kv_cache_dtype,
        tokens,
        seqs,
        settings.enforce_eager,
        max_len,
        settings.vllm_version,
    )
    perf = EnginePerf(
        gpu, model, fmt, tp, settings.kv_cache_dtype, settings.vllm_version, settings.enforce_eager
    )
    engine = calibrated(
        calibration,
        perf,
        budget.kv_tokens,
        max_model_len=max_len,
        gpu_memory_utilization=settings.gpu_memory_utilization,
    )
    source = Source()
    if engine.provenance:
        # The GiB per GPU follow the measured tokens, so the two figures never disagree.
        per_gpu = engine.kv_tokens * perf.kv_token_bytes
        budget = replace(budget, kv_tokens=engine.kv_tokens, kv_per_gpu=per_gpu)
        source = Source("calibrated", engine.provenance, engine.sources())
    batch = workload.batch
    step = engine.perf.step_time(batch, batch * workload.context)
    prefill = engine.perf.prefill_time(workload.prompt)
    return Estimate(
        gpu, model, fmt, settings, workload, max_len, tokens, seqs, budget, step, prefill, source
    )


# The tensor-parallel sizes tried for a fit: one node's, as the planner tries them
# (fleetctl/planner/candidates.py, TP_SIZES and tp_sizes, which this layer may not import).
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Fit:
    """Settings that fit where the asked ones do not, and the KV tokens they leave."""

    tensor_parallel_size: int
    format: str
    kv_cache_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "format": self.format,
            "kv_cache_tokens": self.kv_cache_tokens,
        }


def fits_instead(
    asked: Estimate,
    formats: list[FormatProfile],
    calibration: Calibration | None = None,
) -> list[Fit]:
    """For an estimate that does not fit, estimated by the same model: the smallest larger
    TP that fits in its format, and, at its TP, the format with the most bytes per weight
    (the least quantized) that fits. Empty when neither does."""
    out = []
    s = asked.settings
    for tp in _tp_sizes(asked.model, s.tensor_parallel_size):
        e = _again(asked, asked.fmt, replace(s, tensor_parallel_size=tp), calibration)
        if e.fits:
            out.append(Fit(tp, asked.fmt.name, e.budget.kv_tokens))
            break
    lighter = [
        f
        for f in formats
        if f.weight_bytes_per_param < asked.fmt.weight_bytes_per_param and f.runs_on(asked.gpu)
    ]
    for f in sorted(lighter, key=lambda f: (-f.weight_bytes_per_param, f.name)):
        e = _again(asked, f, s, calibration)
        if e.fits:
            out.append(Fit(s.tensor_parallel_size, f.name, e.budget.kv_tokens))
            break
    return out


def _tp_sizes(model: ModelProfile, above: int) -> list[int]:
    """TP sizes past `above` that vLLM accepts for the model (heads divide evenly)."""
    return [
        t
        for t in TP_SIZES
        if t > above
        and model.num_attention_heads % t == 0
        and (model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0)
    ]


def _again(
    asked: Estimate, fmt: FormatProfile, settings: Settings, calibration: Calibration | None
) -> Estimate:
    return estimate(asked.gpu, asked.model, fmt, settings, asked.workload, calibration)
