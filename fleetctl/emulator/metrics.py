"""vLLM 0.32's /metrics: the same family names, label sets and histogram buckets, written by hand.

The reference is a real server's output (shared/captures/vllm-0.32.0-cpu-metrics.txt). Every
latency here is in EMULATED seconds (wall seconds x the time scale), so the numbers describe the
modelled GPU whatever speed the emulation runs at; they come from the Engine's own clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fleetctl.model.perf import BLOCK_SIZE
from fleetctl.sim.engine import Engine

# Bucket boundaries exactly as vLLM 0.32 declares them.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
PREEMPTION_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

HELP = {
    "estimated_read_bytes_per_gpu": "Estimated number of bytes read from memory per GPU (for "
    "Model Flops Utilization calculations).",
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "num_requests_waiting_by_reason": "Number of waiting requests by reason. Reason labels: "
    "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
    "constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals "
    "vllm:num_requests_waiting.",
    "engine_sleep_state": "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 "
    "means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
    "sleep level 2.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "prompt_tokens_by_source": "Number of prompt tokens by source.",
    "prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "generation_tokens": "Number of generation tokens processed.",
    "request_success": "Count of successfully processed requests.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation "
    "tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per "
    "request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_num_preemptions": "Number of preemptions per request.",
    "request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill "
    "(excluding cached tokens).",
    "cache_config_info": "Information of the LLMEngine CacheConfig",
}

# vllm:cache_config_info's labels as vLLM 0.32 writes them on a CUDA host; the KV capacity ones
# are filled in from the modelled engine. Prefix caching is on, vLLM's default; the Engine
# models it (fleetctl/sim/kvpool.py).
CACHE_CONFIG_DEFAULTS = {
    "_block_size_resolved": "True",
    "block_size": str(BLOCK_SIZE),
    "cache_hit_alignment_tokens": "None",
    "effective_attention_block_size": str(BLOCK_SIZE),
    "enable_mamba_shared_prefix_checkpoint": "False",
    "enable_prefix_caching": "True",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "num_gpu_blocks_override": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    "user_specified_block_size": "False",
}


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 buckets up to `limit` (token-count histograms: limit is max_model_len)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += times
                break
        self.sum += value * times
        self.count += times

    def cumulative(self) -> Iterable[tuple[str, int]]:
        total = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            total += n
            yield prom_number(bound), total
        yield "+Inf", self.count


class Recorder:
    """What vLLM's frontend records per request; the engine's counters come from Engine.stats."""

    def __init__(self, max_model_len: int):
        tokens = one_two_five_buckets(max_model_len)
        self.created = time.time()
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.hist: dict[str, Histogram] = {
            "request_prompt_tokens": Histogram(tokens),
            "request_generation_tokens": Histogram(tokens),
            "request_max_num_generation_tokens": Histogram(tokens),
            "request_params_n": Histogram(PARAMS_N_BUCKETS),
            "request_params_max_tokens": Histogram(tokens),
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "request_time_per_output_token_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_num_preemptions": Histogram(PREEMPTION_BUCKETS),
            "request_prefill_kv_computed_tokens": Histogram(tokens),
        }

    def observe(self, name: str, value: float, times: int = 1) -> None:
        self.hist[name].observe(value, times)


@dataclass(frozen=True)
class CacheInfo:
    """The KV capacity vllm:cache_config_info reports."""

    cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int
    kv_tokens: int
    max_model_len: int

    def labels(self) -> dict[str, str]:
        return CACHE_CONFIG_DEFAULTS | {
            "cache_dtype": self.cache_dtype,
            "engine": "0",
            "gpu_memory_utilization": prom_number(self.gpu_memory_utilization),
            "kv_cache_max_concurrency": prom_number(self.kv_tokens / self.max_model_len),
            "kv_cache_memory_bytes": str(self.kv_cache_memory_bytes),
            "kv_cache_size_tokens": str(self.kv_tokens),
            "num_gpu_blocks": str(self.kv_tokens // BLOCK_SIZE),
        }


def prom_number(value: float) -> str:
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Writer:
    """Builds the exposition text family by family, with vLLM's `_created` companions."""

    def __init__(self, base: dict[str, str], created: float):
        self.base, self.created = base, created
        self.lines: list[str] = []

    def _head(self, name: str, kind: str, help_key: str) -> None:
        self.lines.append(f"# HELP vllm:{name} {HELP[help_key]}")
        self.lines.append(f"# TYPE vllm:{name} {kind}")

    def _sample(self, name: str, value: float, extra: dict[str, str] | None = None) -> None:
        self.lines.append(f"vllm:{name}{_labels(self.base | (extra or {}))} {prom_number(value)}")

    def gauge(self, name: str, values: dict[str, float] | float, label: str = "") -> None:
        self._head(name, "gauge", name)
        if isinstance(values, dict):
            for key, v in values.items():
                self._sample(name, v, {label: key})
        else:
            self._sample(name, values)

    def counter(self, name: str, values: dict[str, float] | float, label: str = "") -> None:
        items = values.items() if isinstance(values, dict) else [("", values)]
        self._head(f"{name}_total", "counter", name)
        for key, v in items:
            self._sample(f"{name}_total", v, {label: key} if label else None)
        self._head(f"{name}_created", "gauge", name)
        for key, _ in items:
            self._sample(f"{name}_created", self.created, {label: key} if label else None)

    def histogram(self, name: str, h: Histogram) -> None:
        self._head(name, "histogram", name)
        for le, n in h.cumulative():
            self._sample(f"{name}_bucket", n, {"le": le})
        self._sample(f"{name}_count", h.count)
        self._sample(f"{name}_sum", h.sum)
        self._head(f"{name}_created", "gauge", name)
        self._sample(f"{name}_created", self.created)

    def info(self, name: str, labels: dict[str, str]) -> None:
        self._head(name, "gauge", name)
        self.lines.append(f"vllm:{name}{_labels(labels)} 1.0")


def render(
    model_name: str,
    engine: Engine,
    rec: Recorder,
    cache: CacheInfo,
    time_scale: float = 1.0,
    sleep_state: dict[str, float] | None = None,
) -> str:
    """The /metrics text of one emulated server; `sleep_state`: vllm:engine_sleep_state's
    samples (awake when not given)."""
    w = Writer({"engine": "0", "model_name": model_name}, rec.created)
    st = engine.stats
    # A scraper turns this counter into bandwidth on its own (wall) clock. Divided by the time
    # scale, that rate is the modelled GPU's bytes per emulated second, as the latencies here
    # are emulated seconds; else an emulator running 4x fast reads as 4x the GPU's bandwidth.
    w.counter("estimated_read_bytes_per_gpu", st.read_bytes / time_scale)
    w.gauge("num_requests_running", engine.num_running)
    w.gauge("num_requests_waiting", engine.num_waiting)
    waiting = {"capacity": float(engine.num_waiting), "deferred": 0.0}
    w.gauge("num_requests_waiting_by_reason", waiting, "reason")
    awake = {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    w.gauge("engine_sleep_state", sleep_state or awake, "sleep_state")
    w.gauge("kv_cache_usage_perc", engine.kv_usage)
    # The engine's prefix cache: prompt tokens looked up at admission, and those found.
    hits = float(st.prefix_cache_hits)
    w.counter("prefix_cache_queries", float(st.prefix_cache_queries))
    w.counter("prefix_cache_hits", hits)
    w.counter("num_preemptions", st.preemptions)
    # A decode server of a disaggregated model receives its prompts' KV from prefill servers:
    # vLLM counts those tokens as prompt tokens from the external_kv_transfer source.
    external = float(st.external_tokens)
    w.counter("prompt_tokens", st.prompt_tokens + hits + external)
    sources = {"local_compute": float(st.prompt_tokens), "local_cache_hit": hits}
    w.counter("prompt_tokens_by_source", sources | {"external_kv_transfer": external}, "source")
    w.counter("prompt_tokens_cached", hits + external)
    w.counter("generation_tokens", st.generation_tokens)
    w.counter("request_success", {k: float(v) for k, v in rec.success.items()}, "finished_reason")
    for name, h in rec.hist.items():
        w.histogram(name, h)
    w.info("cache_config_info", cache.labels())
    return "\n".join(w.lines) + "\n"
