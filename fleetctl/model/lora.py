"""What LoRA adapters cost an engine: the extra seconds of a step that batches them, and loads.

The one home of the adapters' speed, beside the one performance model (perf.py holds their
memory): the engine (simulator and emulator alike) charges its steps and loads with it, and
hardware-aware's predicted first token counts the same load.

A step's extra, when any sequence in it runs an adapter (Punica's structure: the base model
batched once, each adapter's low-rank product added by gather kernels, SGMV/BGMV, which vLLM's
punica_wrapper runs as its shrink and expand kernels over every LoRA'd module of every layer):
- a fixed cost per layer, the kernels' launches and small reads: Punica measured 2 ms a token
  on top of the base model (Llama-2 7B, 32 layers, an A100; arXiv:2310.18547, abstract and
  section 7). The kernels are memory-bound, so a card with less bandwidth takes longer in
  proportion (the A100's 2,039 GB/s is the reference);
- each distinct adapter's weights read once a step, at the slot's rank: vLLM's slots are
  stacks of --max-lora-rank, zero-padded for a smaller adapter (vllm/lora/layers/), and its
  kernels run over the whole slot; S-LoRA's heterogeneous batching (arXiv:2311.03285, MBGMV)
  has the same per-adapter read;
- each LoRA token's activations read by the shrink and written by the expand, and its
  2 x rank x (in + out) FLOPs per module.
vLLM's own LoRA benchmark measured more on an older release (benchmark_throughput.py on an
A100, Llama-2 7B, ShareGPT: 11.45 requests/s without LoRA, 7.60 with one rank-8 adapter,
vllm-project/vllm pull 11267); the model keeps Punica's kernel figure, as vLLM's kernels since
are Punica's and run under CUDA graphs.

A server's expected step, for its capacity and objectives (LoraMix): where its traffic asks for
adapters with known shares, a step of n sequences batches the expected number of distinct
adapters among n draws (at most --max-loras, as vLLM's scheduler admits no more), and the
adapters' share of its tokens; the fixed cost where any of them runs.

A load: an adapter in a server's CPU cache (--max-cpu-loras) is copied into a GPU slot over
PCIe when a step first batches it (vLLM's activate_adapter); one not in it is read from disk
first (a runtime load, or one evicted from the CPU cache), at the disk's bandwidth plus a fixed
cost of parsing and building it (LoRAX measured 0.5 to 1 s for a whole load with per-layer
copies, predibase/lorax issue 433; a prior, not fitted).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetctl.model.perf import GB, PCIE_GB_S, EnginePerf, kv_heads_per_gpu, lora_layer_params

# Punica's extra latency per token (2 ms) over Llama-2 7B's 32 layers, on an A100 80GB.
PUNICA_LAYER_S = 2e-3 / 32
PUNICA_BANDWIDTH_GB_S = 2039.0
# Disk reads of an adapter's safetensors (a local NVMe SSD), and the fixed seconds of reading
# its config and building its tensors on the CPU (priors).
DISK_GB_S = 2.0
LOAD_FIXED_S = 0.3
# Seconds of copying an adapter's modules into a slot besides their bytes (a copy per module).
ACTIVATE_FIXED_S = 1e-3


@dataclass
class LoraPerf:
    """The LoRA costs of one engine (`perf`'s GPU, model and TP) with slots of `max_rank`."""

    perf: EnginePerf
    max_rank: int = 16
    dtype_bytes: int = 2
    _bytes: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        p, m = self.perf, self.perf.model
        self.fixed_s = (
            m.num_layers * PUNICA_LAYER_S * PUNICA_BANDWIDTH_GB_S / p.gpu.memory_bandwidth_gb_s
        )
        self.slot_read_s = self.adapter_bytes(self.max_rank) / p.weight_bandwidth
        # Per token and layer: the shrink reads each module's input and the expand reads and
        # writes its output (qkv, o, gate_up, down), in the activations' dtype.
        q = m.num_attention_heads * m.head_dim
        kv = kv_heads_per_gpu(m, p.tp) * m.head_dim
        inter = m.intermediate_size // p.tp
        ins = 2 * m.hidden_size + q // p.tp + inter
        outs = (q // p.tp + 2 * kv) + m.hidden_size + 2 * inter + m.hidden_size
        token_bytes = m.num_layers * (ins + 2 * outs) * self.dtype_bytes
        token_flops = 2.0 * lora_layer_params(m, self.max_rank, p.tp)
        self.token_s = token_bytes / p.bandwidth + token_flops / p.flops

    def adapter_bytes(self, rank: int) -> int:
        """Bytes of one adapter of `rank` on one GPU of the group (its layers' A and B)."""
        got = self._bytes.get(rank)
        if got is None:
            got = self._bytes[rank] = (
                lora_layer_params(self.perf.model, rank, self.perf.tp) * self.dtype_bytes
            )
        return got

    def step_s(self, adapters: float, tokens: float) -> float:
        """Seconds a step adds when it batches `adapters` distinct adapters over `tokens` of
        its tokens (0 without one)."""
        if adapters <= 0:
            return 0.0
        return self.fixed_s + adapters * self.slot_read_s + tokens * self.token_s

    def activate_s(self, rank: int) -> float:
        """Seconds to copy an adapter from the CPU cache into a GPU slot."""
        pcie = PCIE_GB_S.get(self.perf.gpu.pcie_gen, 25.0) * GB
        return ACTIVATE_FIXED_S + self.adapter_bytes(rank) / pcie

    def disk_s(self, rank: int) -> float:
        """Seconds to read an adapter from disk into the CPU cache (the whole adapter: each
        GPU of a TP group reads its files)."""
        return LOAD_FIXED_S + self.adapter_bytes(rank) * self.perf.tp / (DISK_GB_S * GB)

    def load_s(self, rank: int, in_cpu: bool) -> float:
        """Seconds before a step can batch an adapter not in a GPU slot: a copy from the CPU
        cache, or a read from disk and then the copy."""
        return self.activate_s(rank) + (0.0 if in_cpu else self.disk_s(rank))


@dataclass(frozen=True)
class LoraMix:
    """The adapters a LoRA-enabled server's traffic asks for: each one's share of its requests
    (the rest ask for the base model), and its --max-loras slots of --max-lora-rank."""

    shares: tuple[float, ...]
    max_loras: int
    max_rank: int
    dtype_bytes: int = 2

    @classmethod
    def of(
        cls, shares: Iterable[float], max_loras: int, max_rank: int, dtype_bytes: int = 2
    ) -> LoraMix | None:
        """The mix of the positive `shares`; None where no request asks for an adapter."""
        kept = tuple(sorted((p for p in shares if p > 0), reverse=True))
        return cls(kept, max_loras, max_rank, dtype_bytes) if kept else None

    @property
    def lora_share(self) -> float:
        return min(1.0, sum(self.shares))

    def adapters(self, seqs: int) -> float:
        """Expected distinct adapters among `seqs` sequences, at most --max-loras."""
        return min(float(self.max_loras), sum(1.0 - (1.0 - p) ** seqs for p in self.shares))

    def costs(self, perf: EnginePerf) -> LoraPerf:
        return LoraPerf(perf, self.max_rank, self.dtype_bytes)

    def step_s(self, lora: LoraPerf, seqs: int, tokens: int) -> float:
        """Expected seconds a step of `seqs` sequences over `tokens` tokens adds (`lora`'s
        step_s, the fixed cost weighed by the chance that any sequence runs an adapter)."""
        anyone = 1.0 - (1.0 - self.lora_share) ** max(seqs, 1)
        if anyone <= 0:
            return 0.0
        # step_s is linear in its adapters and tokens: this is its mean over the steps.
        return anyone * lora.step_s(self.adapters(seqs) / anyone, tokens * self.lora_share / anyone)
