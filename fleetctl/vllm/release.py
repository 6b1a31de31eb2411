"""What a vLLM release does that the performance model must follow: memory profiling, defaults.

Read from each release's own source (benchmarks/accuracy/PROFILING.md has the file and line
of every rule): which tokens the start-up profiling pass runs, which memory it counts before
sizing the KV cache, whether CUDA graphs are subtracted, and the defaults `vllm serve` takes.
The model's fitted constants live in model/perf.py; this module only says which rules apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

# The release fleetctl targets when nothing says otherwise (the newest `vllm serve --help=all`
# in profiles/vllm/; tests/vllm/test_vllm_release.py keeps the two the same).
TARGET = "0.32.0"

GIB = 2**30
_NUMBERS = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release string; "0.6.3.post1" -> (0, 6, 3)."""
    m = _NUMBERS.match(text.strip().lstrip("v"))
    if m is None:
        raise ValueError(f"{text!r} is not a vLLM release number")
    return int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)


@dataclass(frozen=True)
class Release:
    """The rules of one vLLM release (patch level matters: 0.6.4 differs from 0.6.3)."""

    text: str
    version: tuple[int, int, int]

    @property
    def v1(self) -> bool:
        """The V1 engine is the default from 0.8."""
        return self.version >= (0, 8, 0)

    @property
    def admits_whole_prompt(self) -> bool:
        """V1 admits a waiting request only when its whole prompt (and, resumed, what it had
        generated) fits the free KV blocks, not just its first chunk (`scheduler_reserve_full_isl`,
        on by default in 0.32.0; added by vllm#37307 in March 2026, so from about 0.18)."""
        return self.version >= (0, 18, 0)

    @property
    def default_utilization(self) -> float:
        return 0.92 if self.version >= (0, 21, 0) else 0.90

    @property
    def chunked_prefill_budget(self) -> int:
        """V0's token budget per step when chunked prefill is on (512, then 2048 from 0.6.5)."""
        return 2048 if self.version >= (0, 6, 5) else 512

    def chunked_by_default(self, max_model_len: int) -> bool:
        """V1 always chunks; V0 from 0.5 turns it on by itself above 32K of context."""
        return self.v1 or (self.version >= (0, 5, 0) and max_model_len > 32768)

    def batch_defaults(
        self, memory_bytes: int, ampere: bool, max_model_len: int
    ) -> tuple[int, int]:
        """`vllm serve`'s default (max_num_batched_tokens, max_num_seqs) on this GPU."""
        if not self.v1:
            if self.chunked_by_default(max_model_len):
                return self.chunked_prefill_budget, 256
            return max(max_model_len, 2048), 256
        # A100s were counted as large GPUs only in 0.8.0-0.9.0; 16384 from 0.29 on >= 160 GiB.
        large = memory_bytes >= 70 * GIB and (not ampere or self.version <= (0, 9, 0))
        if self.version >= (0, 29, 0) and memory_bytes >= 160 * GIB:
            return 16384, 1024
        return (8192, 1024) if large else (2048, 256)

    def profile_tokens(self, batched_tokens: int, max_model_len: int, chunked: bool) -> int:
        """Tokens of the start-up profiling pass: V0 without chunked prefill profiles a whole
        max-length prompt (at least 2048); otherwise the step's token budget."""
        if not self.v1 and not chunked:
            return max(batched_tokens, max_model_len, 2048)
        return batched_tokens

    def sampler_rows(self, max_num_seqs: int, profile_tokens: int) -> int:
        return min(max_num_seqs, profile_tokens) if self.v1 else max_num_seqs

    @property
    def flashinfer_sampler(self) -> bool:
        """FlashInfer's sampler is the default from 0.21; before it, the sampler's dummy pass
        held fp32 logits and their sorted copies (more bytes per row x vocabulary element)."""
        return self.version >= (0, 21, 0)

    @property
    def v0_sampler_bytes(self) -> int | None:
        """Bytes per (row x vocabulary) element of V0's top-k/top-p pass in its profiling run
        (`_apply_top_k_top_p`): logits, their sorted copy and int64 index, masks, softmax,
        cumsum, the inverse index and the gathered result: 28 in the model's dtype, 40 once
        0.5.5 cast the logits to fp32 first (sampler.py:136). None: V1 (SAMPLER_BYTES)."""
        if self.v1:
            return None
        return 40 if self.version >= (0, 5, 5) else 28

    @property
    def counts_cuda_context(self) -> bool:
        """0.6.4 and 0.8.0-0.9.0 counted the whole GPU's non-torch memory (CUDA context)."""
        return self.version[:3] == (0, 6, 4) or (0, 8, 0) <= self.version <= (0, 9, 0)

    @property
    def counts_nccl(self) -> bool:
        """Tensor-parallel buffers came after the memory snapshot until 0.11."""
        return self.version < (0, 11, 0)

    @property
    def subtracts_cuda_graphs(self) -> bool:
        """The CUDA-graph pool is estimated and subtracted before sizing the KV cache from
        0.21; before, graphs were captured afterwards, outside the budget."""
        return self.version >= (0, 21, 0)

    @property
    def reserved_peak(self) -> bool:
        """Up to 0.6.3 the activation peak was read from the allocator's reserved memory."""
        return self.version <= (0, 6, 3)


# The releases whose rules were read (benchmarks/accuracy/PROFILING.md: 0.4.3 to 0.33.0).
# 0.4.0-0.4.2 profile as 0.4.3 does; before 0.4 the V0 worker sized its cache by other rules,
# and a release past the newest read may have changed them again.
OLDEST_MODELLED = (0, 4, 0)
NEWEST_READ = (0, 33, 0)


def unmodelled(text: str) -> str | None:
    """Why release `text` cannot be modelled (one line), or None when it can."""
    v = parse_version(text)
    if v < OLDEST_MODELLED:
        return (
            f"vLLM {text} is not modelled: its memory profiling predates the rules fleetctl "
            f"read (0.4.3 to {'.'.join(map(str, NEWEST_READ))})"
        )
    if v[:2] > NEWEST_READ[:2]:
        return (
            f"vLLM {text} is newer than the newest release whose rules fleetctl read "
            f"({'.'.join(map(str, NEWEST_READ))})"
        )
    return None


@lru_cache(maxsize=64)
def release(text: str | None = None) -> Release:
    """The rules of release `text` (None: the release fleetctl targets)."""
    text = text or TARGET
    return Release(text, parse_version(text))
