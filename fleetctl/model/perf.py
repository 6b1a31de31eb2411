"""The one performance model: weights, KV cache budget, and decode/prefill speed on a GPU group.

The planner, the router's estimates and the simulator all call this module, so they never
disagree about how much fits on a GPU or how fast it runs. Everything here is pure arithmetic.
Kept whole because it is the one model, past 500 lines: memory (weights, LoRA slots, KV) and
speed read the same figures of the same engine, and split they could drift apart.

Memory model (per GPU of a tensor-parallel group), by the profiling rules of the vLLM release
it runs (vllm/release.py, read from each release's source): vLLM may use what CUDA reports of
the GPU's memory times `gpu_memory_utilization`; from that it subtracts the weights it loaded
(weights / TP), the peak of its profiling pass (the forward pass over the profiled tokens, or
the sampler's pass over its rows of the vocabulary, whichever is larger), the memory outside
PyTorch the release counts (workspaces; the CUDA context and tensor-parallel buffers in some
releases) and, from 0.21 unless `--enforce-eager`, the CUDA-graph pool. What is left is the KV
cache, in whole blocks.

Speed model (roofline): a forward step reads the weights once (for MoE, only the experts the
step's tokens touch) plus the KV cache of every sequence in the batch, and does ~2 FLOPs per
active parameter per token plus attention. Step time is the larger of bytes / effective
bandwidth and FLOPs / effective compute, plus tensor-parallel all-reduces, plus a fixed cost
per step outside the GPU (scheduling, sampling: V0 paid far more than V1). Under
`--enforce-eager` the host launches every layer's kernels one by one while the GPU runs the ones
before, so a step takes the longer of the GPU's work and the launches. Effective bandwidth is
the GPU's peak times its calibrated `decode_efficiency` times the format's kernel efficiency on
that architecture (profiles/formats).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from fleetctl.model.catalog import FormatProfile, GpuProfile, ModelProfile
from fleetctl.vllm.release import Release, release


class LoraMixLike(Protocol):
    """model/lora.py's LoraMix as a step needs it: declared here, since that module builds on
    this one (the package's layers allow no import cycle, even for types)."""

    @property
    def lora_share(self) -> float: ...

    def costs(self, perf: EnginePerf) -> Any: ...  # its LoraPerf

    def step_s(self, lora: Any, seqs: int, tokens: int) -> float: ...


GiB = 2**30
GB = 1e9

# Constants fitted on public vLLM measurements, a handful for all of them, never one per point
# (`python benchmarks/accuracy/fit.py --exclude-doubtful`; benchmarks/results/accuracy.md). Not
# fitted, for want of data, and so priors from vLLM's logs: the CUDA context, the CUDA-graph
# estimate, V1's fixed step cost ("under 1 ms"; the speed rows hold almost no V1 decode
# figures).
# - the part of a GPU's memory CUDA never reports (nvidia-smi's total minus cudaMemGetInfo's:
#   79.2 GiB of an H100's 79.6, 23.6 of a 4090's 24.0);
CUDA_INVISIBLE_BYTES = int(0.44 * GiB)
# - memory outside PyTorch's allocator that vLLM counts (library workspaces; 0.16-0.2 GiB logged
#   as "non_torch_memory"), the CUDA context where a release counts it, and tensor-parallel
#   communication buffers where a release counts them (vllm_release.Release);
NON_TORCH_BYTES = int(0.2 * GiB)
CUDA_CONTEXT_BYTES = int(0.45 * GiB)
NCCL_BYTES = int(0.25 * GiB)
# - the CUDA-graph pool a release subtracts before sizing the KV cache (from 0.21: logged as
#   "Estimated CUDA graph memory" 0.17-0.36 GiB);
CUDA_GRAPH_BYTES = int(0.3 * GiB)
# - the profiling pass's activation peak is the model's per-token activations times this; up to
#   0.6.3 vLLM read the allocator's reserved peak, fragmentation included.
ACTIVATION_SCALE = 1.0
RESERVED_ACTIVATION_SCALE = 1.3
# - bytes per (row x vocabulary) element of the sampler's profiling pass: PyTorch's sampler
#   (fp32 logits, probabilities, sorted copies; ~30 read from the source) and FlashInfer's.
SAMPLER_BYTES = {"torch": 16.0, "flashinfer": 12.0}
# Fixed seconds of every engine step outside the GPU's roofline: scheduling, sampling and kernel
# launches (CUDA-graph replays); V0's Python loop cost far more than V1's. Without CUDA graphs
# each layer's kernels are launched one by one, overlapping the GPU's work (EnginePerf.launch_s).
STEP_OVERHEAD_S = {"v0": 4.0e-3, "v1": 1.0e-3}
EAGER_LAYER_S = 600e-6
# Fraction of peak tensor throughput reached by large GEMMs in vLLM (prefill MFU ~50-60%).
COMPUTE_EFFICIENCY = 0.55
# All-reduce latency per call by link kind (two all-reduces per layer under TP).
ALLREDUCE_LATENCY_S = {"nvlink": 8e-6, "pcie": 25e-6}
PCIE_GB_S = {3: 12.0, 4: 25.0, 5: 50.0}
BLOCK_SIZE = 16  # vLLM's KV block size in tokens on CUDA

KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2}


def vllm_batch_defaults(
    gpu: GpuProfile, vllm_version: str | None = None, max_model_len: int = 8192
) -> tuple[int, int]:
    """`vllm serve`'s default (max_num_batched_tokens, max_num_seqs) on this GPU and release."""
    return release(vllm_version).batch_defaults(
        gpu.memory_bytes, gpu.architecture == "ampere", max_model_len
    )


@dataclass(frozen=True)
class KvBudget:
    """Where one GPU's memory goes, in bytes, and the KV cache that is left for the group."""

    usable: int  # memory x gpu_memory_utilization
    weights: int  # this GPU's share of the weights
    activation: int
    non_torch: int
    cuda_graphs: int
    kv_per_gpu: int  # what is left for the KV cache on each GPU (may be negative)
    kv_tokens: int  # tokens of KV the whole group holds, rounded down to whole blocks
    tensor_parallel_size: int
    lora: int = 0  # this GPU's LoRA slots (--enable-lora), taken before the KV cache

    @property
    def kv_total(self) -> int:
        return max(0, self.kv_per_gpu) * self.tensor_parallel_size

    @property
    def reserve(self) -> int:
        return self.activation + self.non_torch + self.cuda_graphs


def weights_bytes(model: ModelProfile, fmt: FormatProfile) -> int:
    """Bytes of weights; quantized formats keep the embeddings and lm_head in 16 bits."""
    body = model.params_total - model.embedding_params
    return int(body * fmt.weight_bytes_per_param + model.embedding_params * fmt.activation_bytes)


def cuda_total(gpu: GpuProfile) -> int:
    """What CUDA reports as the card's total memory: gpu_memory_utilization's base."""
    total = gpu.cuda_total_bytes
    return total if total is not None else gpu.memory_bytes - CUDA_INVISIBLE_BYTES


def kv_heads_per_gpu(model: ModelProfile, tp: int) -> int:
    # With fewer KV heads than GPUs, vLLM replicates each head so every GPU holds one.
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token(model: ModelProfile, kv_dtype_bytes: int = 2, tp: int = 1) -> int:
    """KV bytes per token on one GPU: 2 (K and V) x layers x KV heads x head dim x dtype bytes."""
    return 2 * model.num_layers * kv_heads_per_gpu(model, tp) * model.head_dim * kv_dtype_bytes


def kv_dtype_bytes(kv_cache_dtype: str, fmt: FormatProfile) -> int:
    """Bytes per KV element; 'auto' follows the activation dtype."""
    return KV_DTYPE_BYTES.get(kv_cache_dtype, fmt.activation_bytes)


def activation_peak_bytes(
    model: ModelProfile,
    tp: int,
    profile_tokens: int,
    sampler_rows: int,
    rel: Release | None = None,
) -> int:
    """Peak activations of vLLM's profiling pass on one GPU: the forward pass over
    `profile_tokens`, or the sampler's pass over `sampler_rows` rows of the vocabulary with the
    hidden states kept alive, whichever is larger.

    Forward, per token: the residual stream, its norm and the attention output (about
    4 x hidden), and the MLP's gate/up output plus the activated product (3 x intermediate /
    TP), in 16 bits.
    """
    rel = rel or release()
    # V0's forward held one fewer hidden-sized tensor at its peak: 0.6.4's logged peaks are
    # 110.9 KB a profiled token for Llama-3.1 8B, (3h + 3i)·2 = 110.6 KB.
    hidden = 4 if rel.v1 else 3
    per_token = (hidden * model.hidden_size + 3 * model.intermediate_size // tp) * 2
    scale = RESERVED_ACTIVATION_SCALE if rel.reserved_peak else ACTIVATION_SCALE
    forward = scale * profile_tokens * per_token
    per_element = (
        rel.v0_sampler_bytes or SAMPLER_BYTES["flashinfer" if rel.flashinfer_sampler else "torch"]
    )
    sampler = model.hidden_size * profile_tokens * 2 + per_element * sampler_rows * (
        model.vocab_size
    )
    return int(max(forward, sampler))


def lora_slot_bytes(
    model: ModelProfile,
    max_loras: int,
    max_lora_rank: int,
    tp: int = 1,
    dtype_bytes: int = 2,
) -> int:
    """Bytes one GPU of a TP group holds for `--max-loras` slots of `--max-lora-rank`.

    vLLM allocates every slot at full rank when it wraps the model, whether an adapter is
    loaded or not (vllm/lora/model_manager.py wraps every linear layer and the embedding
    modules; each wrapper's create_lora_weights in vllm/lora/layers/ makes zeroed stacks of
    max_loras x rank x in for A and max_loras x out x rank for B, in the model's dtype). Per
    decoder layer: qkv_proj (A: 3 x rank x hidden; B: (q + k + v outputs) / TP x rank),
    o_proj (A: rank x q width / TP; B: hidden x rank), gate_up_proj (A: 2 x rank x hidden;
    B: 2 x intermediate / TP x rank), down_proj (A: rank x intermediate / TP; B: hidden x
    rank); a MoE model holds the MLP's stacks once per expert (vllm/lora/layers/fused_moe.py).
    Outside the layers: embed_tokens (A: vocab x rank; B: hidden x rank) and lm_head through
    the logits processor (A: rank x hidden; B: vocab / TP x rank).
    """
    if max_loras <= 0:
        return 0
    h, r = model.hidden_size, max_lora_rank
    outside = model.vocab_size * r + h * r + r * h + (model.vocab_size // tp) * r
    return max_loras * (lora_layer_params(model, r, tp) + outside) * dtype_bytes


def lora_layer_params(model: ModelProfile, rank: int, tp: int = 1) -> int:
    """Parameters one GPU of a TP group holds of one adapter of `rank` on the decoder layers'
    linear modules (qkv_proj, o_proj, gate_up_proj, down_proj; lora_slot_bytes's layout):
    an adapter's file and what its GPU slot is filled with, embeddings aside."""
    h, r = model.hidden_size, rank
    q = model.num_attention_heads * model.head_dim
    kv = kv_heads_per_gpu(model, tp) * model.head_dim
    inter = model.intermediate_size
    attn = 3 * r * h + (q // tp + 2 * kv) * r + r * (q // tp) + h * r
    mlp = 2 * r * h + 2 * (inter // tp) * r + r * (inter // tp) + h * r
    mlp *= model.num_experts or 1
    return model.num_layers * (attn + mlp)


def kv_budget(
    gpu: GpuProfile,
    model: ModelProfile,
    fmt: FormatProfile,
    tp: int = 1,
    gpu_memory_utilization: float = 0.92,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    vllm_version: str | None = None,
    chunked_prefill: bool | None = None,
    lora_bytes: int = 0,
) -> KvBudget:
    """The KV cache a tensor-parallel group of `tp` GPUs has left after weights and reserves,
    by the memory-profiling rules of `vllm_version` (default: the release fleetctl targets).

    `lora_bytes` (lora_slot_bytes) comes off with the weights: vLLM's GPU model runner wraps
    the model for LoRA inside the same memory profiler that measures the weights it loaded
    (vllm/v1/worker/gpu_model_runner.py, load_model), so the slots count as model memory."""
    rel = release(vllm_version)
    max_len = max_model_len or model.max_context
    chunked = rel.chunked_by_default(max_len) if chunked_prefill is None else chunked_prefill
    default_tokens, default_seqs = rel.batch_defaults(
        gpu.memory_bytes, gpu.architecture == "ampere", max_len
    )
    if not rel.v1 and chunked and max_num_batched_tokens is None:
        default_tokens = rel.chunked_prefill_budget
    tokens = max_num_batched_tokens or default_tokens
    seqs = max_num_seqs or default_seqs
    usable = int(cuda_total(gpu) * gpu_memory_utilization)
    weights = math.ceil(weights_bytes(model, fmt) / tp)
    profiled = rel.profile_tokens(tokens, max_len, chunked)
    activation = activation_peak_bytes(model, tp, profiled, rel.sampler_rows(seqs, profiled), rel)
    non_torch = NON_TORCH_BYTES
    if rel.counts_cuda_context:
        non_torch += CUDA_CONTEXT_BYTES
    if tp > 1 and rel.counts_nccl:
        non_torch += NCCL_BYTES
    graphs = CUDA_GRAPH_BYTES if rel.subtracts_cuda_graphs and not enforce_eager else 0
    kv_per_gpu = usable - weights - lora_bytes - activation - non_torch - graphs
    per_token = kv_bytes_per_token(model, kv_dtype_bytes(kv_cache_dtype, fmt), tp)
    blocks = max(0, kv_per_gpu) // (per_token * BLOCK_SIZE)
    return KvBudget(
        usable,
        weights,
        activation,
        non_torch,
        graphs,
        kv_per_gpu,
        blocks * BLOCK_SIZE,
        tp,
        lora_bytes,
    )


def cpu_kv_tokens(
    kv_cache_space_bytes: int, model: ModelProfile, kv_cache_dtype: str, fmt: FormatProfile
) -> int:
    """The KV cache of vLLM's CPU backend, in tokens: a fixed size, VLLM_CPU_KVCACHE_SPACE
    (or --kv-cache-memory-bytes), whatever the weights or LoRA slots take; its worker returns
    that size as the memory available (vllm/v1/worker/cpu_worker.py,
    determine_available_memory), so LoRA slots leave it as it is."""
    per_token = kv_bytes_per_token(model, kv_dtype_bytes(kv_cache_dtype, fmt))
    return kv_cache_space_bytes // (per_token * BLOCK_SIZE) * BLOCK_SIZE


def max_sequences(kv_tokens: int, context_tokens: int) -> int:
    """How many sequences of `context_tokens` the KV cache holds at once (whole blocks each)."""
    blocks_per_seq = -(-context_tokens // BLOCK_SIZE)
    return (kv_tokens // BLOCK_SIZE) // blocks_per_seq if blocks_per_seq else 0


@dataclass(frozen=True)
class EnginePerf:
    """Speed of one vLLM engine (a model in a format on a TP group of one GPU type).

    Built once per deployment; `step_time` is the hot path of the simulator, so the constants
    it needs are precomputed.
    """

    gpu: GpuProfile
    model: ModelProfile
    fmt: FormatProfile
    tp: int = 1
    kv_cache_dtype: str = "auto"
    vllm_version: str | None = None  # None: the release fleetctl targets
    enforce_eager: bool = False
    # What a live server measured (calibration), each None or neutral until measured:
    # - its GPU work over the model's: the roofline's bandwidth and compute scale by it;
    speed: float = 1.0
    # - its compute over the model's where prefills measured it apart (None: as `speed`);
    compute_speed: float | None = None
    # - its fixed seconds per step outside the GPU (None: the release's prior, STEP_OVERHEAD_S);
    overhead_s: float | None = None
    # - host seconds per sequence in a step (scheduling, sampling, output processing): no prior,
    #   as the public figures are nearly all at batch 1; a CPU server's steps are mostly this.
    per_seq_s: float = 0.0
    # The LoRA adapters a server's traffic asks for, where it runs them (model/lora.py): each
    # step adds their kernels' expected seconds, so its capacity and objectives count them.
    # None in the simulator's and the router's engines, which charge the adapters a step
    # actually batches.
    lora_mix: LoraMixLike | None = None

    @cached_property
    def lora_costs(self) -> Any:  # model/lora.py's LoraPerf, or None
        """The LoRA costs of `lora_mix`'s slots on this engine; None without a mix."""
        return None if self.lora_mix is None else self.lora_mix.costs(self)

    @cached_property
    def step_overhead(self) -> float:
        """Seconds every step costs besides its GPU work (scheduling, sampling)."""
        if self.overhead_s is not None:
            return self.overhead_s
        return STEP_OVERHEAD_S["v1" if release(self.vllm_version).v1 else "v0"]

    @cached_property
    def launch_s(self) -> float:
        """Host seconds to launch one step's kernels one by one (`--enforce-eager`). The GPU
        runs them while the host launches the next, so a step takes the longer of the two, not
        their sum; with CUDA graphs a step is one replay. A measured fixed cost holds it."""
        if self.overhead_s is not None or not self.enforce_eager:
            return 0.0
        return EAGER_LAYER_S * self.model.num_layers

    @cached_property
    def bandwidth(self) -> float:
        """Effective bytes/s one GPU reaches reading KV cache (attention kernels)."""
        return self.gpu.memory_bandwidth_gb_s * GB * self.gpu.decode_efficiency * self.speed

    @cached_property
    def weight_bandwidth(self) -> float:
        """Effective bytes/s reading weights: the format's GEMM kernels on this architecture."""
        return self.bandwidth * self.fmt.kernel_efficiency_on(
            self.gpu.architecture, self.vllm_version
        )

    @cached_property
    def flops(self) -> float:
        """Effective FLOP/s one GPU reaches in the format's compute dtype."""
        dtype = self.fmt.compute.get(self.gpu.architecture, "fp16")
        speed = self.speed if self.compute_speed is None else self.compute_speed
        return self.gpu.peak_flops(dtype) * COMPUTE_EFFICIENCY * speed

    @cached_property
    def weights(self) -> int:
        return weights_bytes(self.model, self.fmt)

    @cached_property
    def _expert_bytes(self) -> float:
        """Bytes of all routed experts (MoE); zero for dense models."""
        m = self.model
        if not m.num_experts or not m.experts_per_token:
            return 0.0
        idle = m.num_experts - m.experts_per_token
        expert_params = (m.params_total - m.params_active) * m.num_experts / idle
        return expert_params * self.fmt.weight_bytes_per_param

    @cached_property
    def kv_token_bytes(self) -> int:
        return kv_bytes_per_token(
            self.model, kv_dtype_bytes(self.kv_cache_dtype, self.fmt), self.tp
        )

    @cached_property
    def _attn_flops_per_ctx(self) -> float:
        # QK^T and AV: 2 matmuls x 2 FLOPs x query heads x head_dim per (token, context) pair.
        m = self.model
        return 4.0 * m.num_layers * m.num_attention_heads * m.head_dim

    @cached_property
    def _allreduce_fixed(self) -> float:
        if self.tp == 1:
            return 0.0
        kind = self.gpu.interconnect
        return 2 * self.model.num_layers * ALLREDUCE_LATENCY_S[kind]

    @cached_property
    def _allreduce_per_token(self) -> float:
        if self.tp == 1:
            return 0.0
        g = self.gpu
        # The catalog requires nvlink_gb_s with interconnect nvlink (GpuProfile._link).
        link = (
            g.nvlink_gb_s / 2
            if g.interconnect == "nvlink" and g.nvlink_gb_s
            else PCIE_GB_S.get(g.pcie_gen, 25)
        )
        ring = 2 * (self.tp - 1) / self.tp  # bytes moved per byte reduced in a ring all-reduce
        per_layer = 2 * self.model.hidden_size * 2 * ring / (link * GB)
        return self.model.num_layers * per_layer

    def weight_read_bytes(self, tokens: int) -> float:
        """Weight bytes one step reads for `tokens` tokens (MoE: the experts they touch)."""
        if not self._expert_bytes:
            return float(self.weights)
        m = self.model
        assert m.num_experts and m.experts_per_token
        # Expected share of experts hit when each token picks k of E uniformly.
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** max(tokens, 1)
        return self.weights - self._expert_bytes * (1.0 - touched)

    def step_time(
        self,
        tokens: int,
        kv_tokens: float,
        attn_pairs: float | None = None,
        seqs: int | None = None,
    ) -> float:
        """Seconds for one engine step.

        tokens: tokens computed this step (one per decoding sequence plus prefill chunk tokens);
        kv_tokens: KV-cache tokens read (the context of every sequence in the batch);
        attn_pairs: (query token, context token) pairs attended; defaults to `kv_tokens`,
        which is exact for a batch of pure decodes;
        seqs: sequences in the step; defaults to `tokens` (a batch of pure decodes).
        """
        pairs = kv_tokens if attn_pairs is None else attn_pairs
        mem = self._memory_time(tokens, kv_tokens)
        work = 2.0 * self.model.params_active * tokens + self._attn_flops_per_ctx * pairs
        compute = work / self.tp / self.flops
        comm = self._allreduce_fixed + tokens * self._allreduce_per_token
        n = tokens if seqs is None else seqs
        host = self.per_seq_s * n
        step = max(max(mem, compute) + comm, self.launch_s) + self.step_overhead + host
        lora = self.lora_costs
        if lora is not None:
            assert self.lora_mix is not None
            step += self.lora_mix.step_s(lora, n, tokens)
        return step

    def _memory_time(self, tokens: int, kv_tokens: float) -> float:
        weights = self.weight_read_bytes(tokens) / self.tp / self.weight_bandwidth
        return weights + kv_tokens * self.kv_token_bytes / self.bandwidth

    def _decode_lines(self, batch: int) -> tuple[list[tuple[float, float]], float]:
        """A decode step at batch B as max over lines (a + b*kv, kv = tokens read) plus a
        constant: the memory and compute roofs (all-reduces included) and the eager launch."""
        comm = self._allreduce_fixed + batch * self._allreduce_per_token
        mem = (
            self.weight_read_bytes(batch) / self.tp / self.weight_bandwidth + comm,
            self.kv_token_bytes / self.bandwidth,
        )
        compute = (
            2.0 * self.model.params_active * batch / self.tp / self.flops + comm,
            self._attn_flops_per_ctx / self.tp / self.flops,
        )
        lines = [mem, compute]
        if self.launch_s:
            lines.append((self.launch_s, 0.0))
        return lines, self.step_overhead + self.per_seq_s * batch

    def decode_span(self, batch: int, kv0: float, steps: int, extra_s: float = 0.0) -> float:
        """Seconds for `steps` decode steps of a constant batch whose KV starts at `kv0` tokens
        and grows by `batch` each step: the simulator's fast path, in closed form. `extra_s`:
        seconds each step adds besides (its LoRA adapters' kernels, model/lora.py)."""
        if steps <= 0:
            return 0.0
        lines, const = self._decode_lines(batch)
        const += extra_s
        # The upper envelope of the lines changes only where two of them cross: split the
        # steps there and sum each piece's one line in closed form. (Plain loops: this is the
        # simulator's hot path, and there are at most three lines.)
        cuts = [0, steps]
        for j, (a1, b1) in enumerate(lines):
            for a2, b2 in lines[j + 1 :]:
                if b1 != b2:
                    i = math.ceil(((a2 - a1) / (b1 - b2) - kv0) / batch)
                    if 0 < i < steps:
                        cuts.append(i)
        cuts.sort()
        total = const * steps
        for first, end in itertools.pairwise(cuts):
            if end == first:
                continue
            x = kv0 + batch * first
            a, b = lines[0]
            for a2, b2 in lines[1:]:
                if a2 + b2 * x > a + b * x:
                    a, b = a2, b2
            n = end - first
            # sum over i in [first, end) of a + b * (kv0 + batch * i)
            total += n * (a + b * kv0) + b * batch * (n * first + n * (n - 1) / 2)
        return total

    def decode_steps_within(
        self, batch: int, kv0: float, seconds: float, most: int, extra_s: float = 0.0
    ) -> int:
        """How many whole decode steps (at most `most`) finish within `seconds`."""
        lo, hi = 0, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_span(batch, kv0, mid, extra_s) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def min_step_s(self, batch: int, kv_tokens: float) -> float:
        """The shortest a decode step of `batch` sequences reading `kv_tokens` of KV can be:
        its weights and KV read once at the GPU's peak bandwidth. No measurement or fit may
        beat it (the efficiencies and speeds below are never allowed past peak)."""
        peak = self.gpu.memory_bandwidth_gb_s * GB
        read = self.weight_read_bytes(batch) / self.tp + kv_tokens * self.kv_token_bytes
        return read / peak

    def max_prefill_tok_s(self, tokens: int, context: int = 0) -> float:
        """The fastest `tokens` prompt tokens on top of `context` cached ones can be computed:
        their FLOPs at the GPU's peak compute in the format's dtype."""
        pairs = tokens * (context + tokens / 2)
        work = 2.0 * self.model.params_active * tokens + self._attn_flops_per_ctx * pairs
        dtype = self.fmt.compute.get(self.gpu.architecture, "fp16")
        return tokens / (work / self.tp / self.gpu.peak_flops(dtype))

    @property
    def max_speed(self) -> float:
        """The largest `speed` at which the modelled bandwidth (the weights' kernels and the
        KV reads alike) and, where no separate compute speed is set, the modelled FLOP/s stay
        within the GPU's peaks."""
        kernel = self.fmt.kernel_efficiency_on(self.gpu.architecture, self.vllm_version)
        bandwidth = 1.0 / (self.gpu.decode_efficiency * max(1.0, kernel))
        return (
            bandwidth if self.compute_speed is not None else min(bandwidth, self.max_compute_speed)
        )

    @property
    def max_compute_speed(self) -> float:
        """The largest compute speed at which the modelled FLOP/s stay within peak."""
        return 1.0 / COMPUTE_EFFICIENCY

    def decode_tok_s(self, batch: int = 1, context: int = 512) -> float:
        """Aggregate decode tokens/s at a batch of `batch` sequences of `context` tokens each."""
        return batch / self.step_time(batch, batch * context)

    def bound_regime(self, batch: int, context: int = 512) -> str:
        """'bandwidth' or 'compute': which roof limits a decode step at this batch."""
        mem = self._memory_time(batch, batch * context)
        compute = (
            2.0 * self.model.params_active * batch + self._attn_flops_per_ctx * batch * context
        )
        compute /= self.tp * self.flops
        return "compute" if compute > mem else "bandwidth"

    def prefill_time(self, tokens: int, context: int = 0, chunk: int = 0) -> float:
        """Seconds to prefill `tokens` prompt tokens on top of `context` cached tokens, alone;
        with `chunk` (the step's token budget, --max-num-batched-tokens) in steps of at most
        that many tokens, each step paying its weight reads and fixed cost again."""
        if chunk <= 0 or tokens <= chunk:
            pairs = tokens * (context + tokens / 2)
            return self.step_time(tokens, context + tokens, pairs, seqs=1)
        total, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_time(n, context + done)
            done += n
        return total

    def prefill_marginal(self, tokens: int, context: int = 0) -> float:
        """Compute seconds a prompt adds riding along a batch that reads the weights anyway."""
        pairs = tokens * (context + tokens / 2)
        work = 2.0 * self.model.params_active * tokens + self._attn_flops_per_ctx * pairs
        own = work / self.tp / self.flops + tokens * self._allreduce_per_token + self.per_seq_s
        if self.lora_costs is not None and self.lora_mix is not None:  # its LoRA products
            own += self.lora_mix.lora_share * tokens * self.lora_costs.token_s
        return own

    def capacity_rps(
        self,
        prompt: int,
        output: int,
        kv_tokens: int,
        max_num_seqs: int,
        max_num_batched_tokens: int = 0,
    ) -> float:
        """Requests/s the engine sustains at saturation for a mean prompt and output length.

        Concurrency is capped by max_num_seqs and by how many whole sequences the KV cache holds;
        each request costs its share of the decode steps plus the compute of its prefill, the
        LoRA adapters' kernels included where the engine has a `lora_mix`. With
        `max_num_batched_tokens` (0: unbounded), no step computes more tokens than that,
        decodes included: a small budget pays a step's weight reads and fixed cost for fewer
        tokens, so it caps the tokens a second the engine gets through.
        """
        batch = min(max_num_seqs, max_sequences(kv_tokens, prompt + output))
        if batch < 1:
            return 0.0
        mean_ctx = prompt + output / 2
        step = self.step_time(batch, batch * mean_ctx)
        per_request = output * step / batch + self.prefill_marginal(prompt)
        if max_num_batched_tokens:
            full = self.full_step(max_num_batched_tokens, batch, mean_ctx, prompt)
            per_request = max(per_request, (prompt + output) * full / max_num_batched_tokens)
        return 1.0 / per_request

    def full_step(self, budget: int, batch: int, context: float, prompt: int) -> float:
        """Seconds of the longest step a --max-num-batched-tokens `budget` allows: `batch`
        decodes of `context` tokens each, and the rest of the budget one chunk of a
        `prompt`-token prompt (vLLM schedules the running decodes first)."""
        batch = max(1, min(batch, budget))
        chunk = budget - batch
        kv = batch * context + min(prompt, chunk)
        pairs = batch * context + chunk * prompt / 2
        return self.step_time(budget, kv, pairs, seqs=batch + (1 if chunk else 0))
