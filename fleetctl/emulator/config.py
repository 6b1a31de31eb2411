"""Resolve the emulator's arguments into profiles, a KV budget and an Engine, as vLLM starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleetctl.base.errors import UserError
from fleetctl.emulator.args import EmulatorArgs
from fleetctl.emulator.kv_publisher import KvEventsConfig, parse_kv_events_config
from fleetctl.emulator.kv_transfer import KvTransferConfig, parse_kv_transfer_config
from fleetctl.emulator.lora import LoraConfig, lora_config
from fleetctl.emulator.truth import less_kv, slower
from fleetctl.model.catalog import Catalog, FormatProfile, GpuProfile, ModelProfile, load_catalog
from fleetctl.model.lora import LoraPerf
from fleetctl.model.perf import (
    BLOCK_SIZE,
    EnginePerf,
    KvBudget,
    kv_budget,
    vllm_batch_defaults,
    weights_bytes,
)
from fleetctl.model.startup import wake_seconds
from fleetctl.planner.disaggregate import Link
from fleetctl.sim.engine import Engine

VLLM_VERSION = "0.32.0"  # the vLLM release whose API and metrics the emulator reproduces
# Longest run of decode steps the engine applies at once, in emulated seconds, so tokens stream
# step by step. At high time scales a step lasts well under a millisecond of wall time, so the
# span also covers at least MIN_WALL_TICK_S of wall time: the event loop would not keep up.
MAX_SPAN_S = 0.02
MIN_WALL_TICK_S = 0.002


@dataclass(frozen=True)
class Faults:
    """Misbehaviours for tests of the router and of apply."""

    startup_delay: float = 0.0  # wall seconds of 503s before the "model" is loaded
    crash_after: int | None = None
    hang_after: int | None = None
    error_rate: float = 0.0
    die_mid_stream: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything one emulated server needs; `make_app` takes it."""

    gpu: GpuProfile
    model: ModelProfile
    fmt: FormatProfile
    source: str
    served_names: tuple[str, ...]
    tp: int
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    budget: KvBudget
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    time_scale: float = 1.0
    faults: Faults = Faults()
    # vLLM V1's automatic prefix caching (on unless --no-enable-prefix-caching), the hash it
    # names blocks by, and --kv-events-config (None: no events published).
    prefix_caching: bool = True
    hash_algo: str = "sha256"
    kv_events: KvEventsConfig | None = None
    # --kv-transfer-config: one phase of a disaggregated model (None: both, as usual).
    kv_transfer: KvTransferConfig | None = None
    # Sleep mode (fleetctl/emulator/sleep.py): --enable-sleep-mode, whether the dev endpoints
    # are served (VLLM_SERVER_DEV_MODE=1), and the folder of a GPU's shared memory ledger.
    sleep_mode: bool = False
    dev_mode: bool = False
    gpu_ledger: Path | None = None
    lora: LoraConfig | None = None  # --enable-lora's settings; None: no adapters

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE

    @property
    def name(self) -> str:
        """The served model name responses and metrics carry (vLLM: the first one)."""
        return self.served_names[0]

    @property
    def perf(self) -> EnginePerf:
        return EnginePerf(self.gpu, self.model, self.fmt, self.tp, self.kv_cache_dtype)

    def wake_seconds(self, level: int) -> float:
        """Emulated seconds a wake from sleep `level` takes on this class (the model's)."""
        return wake_seconds(self.gpu, weights_bytes(self.model, self.fmt), self.tp, level)

    @property
    def kv_cache_bytes(self) -> int:
        """KV cache bytes per GPU in whole blocks, as vLLM's cache_config reports them."""
        return self.budget.kv_tokens * self.perf.kv_token_bytes

    def engine(self) -> Engine:
        engine = Engine(
            self.perf,
            self.budget.kv_tokens,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            self.name,
            block_size=self.block_size,
            kv_events=self.kv_events is not None and self.prefix_caching,
            max_span_s=max(MAX_SPAN_S, MIN_WALL_TICK_S * self.time_scale),
        )
        if self.lora is not None:
            # Slots of --max-lora-rank; an adapter's own rank is unknown here, so taken as that.
            lora = self.lora
            engine.lora = LoraPerf(self.perf, lora.max_rank, self.fmt.activation_bytes)
            engine.max_loras = lora.max_loras
            engine.max_cpu_loras = max(lora.max_loras, lora.max_cpu_loras or 0)
            for name, _ in lora.modules:
                engine.add_lora(name, lora.max_rank)
        return engine


def pick_format(catalog: Catalog, args: EmulatorArgs, gpu: GpuProfile) -> FormatProfile:
    """--variant, else the format whose vLLM flags match --quantization / --dtype."""
    if args.variant:
        return catalog.format(args.variant)
    if args.quantization:
        for fmt in catalog.formats.values():
            flags = {fmt.vllm.quantization, *fmt.vllm.quantization_by_architecture.values()}
            if args.quantization in flags and fmt.runs_on(gpu):
                return fmt
        raise UserError(
            f"no format profile runs --quantization {args.quantization} on {gpu.name}",
            None,
            "pass --variant with a name from profiles/formats",
        )
    return catalog.format("fp16" if args.dtype in ("float16", "half") else "bf16")


def resolve(args: EmulatorArgs) -> EmulatorConfig:
    """Check the arguments the way `vllm serve` would at start-up and size the KV cache."""
    _check_ranges(args)
    catalog = load_catalog(args.profiles)
    gpu = catalog.gpu(args.gpu)
    model = catalog.model(args.model)
    fmt = pick_format(catalog, args, gpu)
    if not fmt.runs_on(gpu):
        raise UserError(f"format {fmt.name} does not run on {gpu.name} ({gpu.architecture})")
    if model.num_attention_heads % args.tensor_parallel_size:
        raise UserError(
            f"Total number of attention heads ({model.num_attention_heads}) must be divisible "
            f"by tensor parallel size ({args.tensor_parallel_size})"
        )
    max_len = args.max_model_len or model.max_context
    if max_len > model.max_context:
        raise UserError(
            f"User-specified max_model_len ({max_len}) is greater than the derived "
            f"max_model_len ({model.max_context}) of {model.name}"
        )
    default_tokens, default_seqs = vllm_batch_defaults(gpu)
    tokens = args.max_num_batched_tokens or default_tokens
    seqs = args.max_num_seqs or default_seqs

    def budget_on(g: GpuProfile) -> KvBudget:
        return kv_budget(
            g,
            model,
            fmt,
            args.tensor_parallel_size,
            args.gpu_memory_utilization,
            args.kv_cache_dtype,
            tokens,
            seqs,
            args.enforce_eager,
        )

    budget = budget_on(gpu)
    # The knobs skew the truth after the profiles: the batch defaults above stay the profile's.
    if args.truth_kv != 1.0:
        gpu = less_kv(gpu, args.truth_kv, budget, args.gpu_memory_utilization)
        budget = budget_on(gpu)
    if args.truth_speed != 1.0:
        gpu = slower(gpu, args.truth_speed)
    _check_fits(budget, max_len)
    source = args.source or model.hf_id or model.name
    kv_events = parse_kv_events_config(args.kv_events_config) if args.kv_events_config else None
    kv_transfer = None
    if args.kv_transfer_config:
        link = Link(args.kv_link_gbps, args.kv_link_rdma)
        kv_transfer = parse_kv_transfer_config(args.kv_transfer_config, link)
    return EmulatorConfig(
        gpu=gpu,
        model=model,
        fmt=fmt,
        source=source,
        served_names=tuple(args.served_model_name) or (source,),
        tp=args.tensor_parallel_size,
        max_model_len=max_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        enforce_eager=args.enforce_eager,
        budget=budget,
        host=args.host,
        port=args.port,
        api_keys=tuple(args.api_key),
        time_scale=args.time_scale,
        faults=Faults(
            args.startup_delay,
            args.crash_after,
            args.hang_after,
            args.error_rate,
            args.die_mid_stream,
            args.seed,
        ),
        prefix_caching=args.enable_prefix_caching is not False,
        hash_algo=args.prefix_caching_hash_algo,
        kv_events=kv_events if kv_events is not None and kv_events.publishes else None,
        kv_transfer=kv_transfer,
        sleep_mode=args.enable_sleep_mode,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE", "0").lower() in ("1", "true"),
        gpu_ledger=args.gpu_ledger,
        lora=lora_config(
            args.enable_lora,
            args.max_loras,
            args.max_lora_rank,
            args.lora_modules,
            args.lora_load_seconds,
            args.max_cpu_loras,
        ),
    )


def _check_ranges(args: EmulatorArgs) -> None:
    if args.time_scale <= 0:
        raise UserError(f"--time-scale must be positive, got {args.time_scale:g}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization:g}"
        )
    if not 0 <= args.error_rate <= 1:
        raise UserError(f"--error-rate must be in [0, 1], got {args.error_rate:g}")
    if args.truth_speed <= 0:
        raise UserError(f"--truth-speed must be positive, got {args.truth_speed:g}")
    if not 0 < args.truth_kv <= 1:
        raise UserError(f"--truth-kv must be in (0, 1], got {args.truth_kv:g}")
    if args.tensor_parallel_size < 1:
        raise UserError("--tensor-parallel-size must be at least 1")
    if not 0 < args.kv_link_gbps <= 3200:
        raise UserError(f"--kv-link-gbps must be in (0, 3200], got {args.kv_link_gbps:g}")


def _check_fits(budget: KvBudget, max_len: int) -> None:
    # vLLM's own start-up errors, so `apply` sees the failure a real server would report.
    if budget.kv_tokens < BLOCK_SIZE:
        raise UserError(
            "No available memory for the cache blocks",
            None,
            "try increasing `gpu_memory_utilization` or a smaller format or more GPUs",
        )
    if max_len > budget.kv_tokens:
        raise UserError(
            f"The model's max seq len ({max_len}) is larger than the maximum number of tokens "
            f"that can be stored in KV cache ({budget.kv_tokens})",
            None,
            "try increasing `gpu_memory_utilization` or decreasing `max_model_len`",
        )
