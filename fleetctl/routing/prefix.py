"""Prompt prefixes as chained block hashes, and the per-server index of what each has cached.

A prompt is a run of blocks; `PromptBlocks.hashes[j]` names the whole prompt up to the end of
block j (a chain: equal hashes at j mean equal prompts up to there), as vLLM's prefix cache
names its KV blocks. The blocks may be coarser than the engine's: the Mooncake trace hashes
512-token blocks, a tokenizer gives 16-token ones. Everything here is pure.

`PrefixIndex` is the router's picture of which blocks each server holds. It is fed either by
the router's own placements (approximate: what was sent there is probably still cached) or by
vLLM's KV events (precise), and it is bounded: least recently used blocks go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt of `tokens` tokens as chained hashes of `block_tokens`-token blocks (the
    last block may be partial)."""

    hashes: tuple[int, ...]
    block_tokens: int
    tokens: int

    def prefix_tokens(self, blocks: int) -> int:
        """Prompt tokens covered by the first `blocks` blocks."""
        return min(self.tokens, blocks * self.block_tokens)

    def full_blocks(self) -> int:
        """Whole blocks of the prompt: the peers hash (and engines cache) only full blocks."""
        return self.tokens // self.block_tokens


def chain(ids: Iterable[int], seed: int = 0) -> tuple[int, ...]:
    """Chained hashes of a sequence of per-block ids (content hashes, or a trace's remapped
    block ids): element j depends on ids[0..j], so a shared leading run is a shared prefix
    even when the ids themselves are not chained."""
    out = []
    h = seed
    for i in ids:
        h = hash((h, i))
        out.append(h)
    return tuple(out)


class PrefixView(Protocol):
    """What a routing policy asks: tokens of this prompt that `backend` has cached; and what
    it tells: this prompt was sent to `backend` (an index fed by placements learns from it;
    one fed by KV events waits for them)."""

    def cached(self, backend: str, blocks: PromptBlocks) -> int: ...

    def routed(self, backend: str, blocks: PromptBlocks) -> None: ...


class NoPrefix:
    """A view that knows nothing (no hashes, or a policy that ignores prefixes)."""

    def cached(self, backend: str, blocks: PromptBlocks) -> int:
        return 0

    def routed(self, backend: str, blocks: PromptBlocks) -> None:
        pass


class PrefixIndex:
    """Per backend, the block hashes it is believed to hold, bounded to `capacity` blocks
    per backend; least recently used blocks go first.

    A prompt's blocks are inserted last block first, so the index drops a prompt's tail
    before its head, as vLLM frees a request's blocks (last first) and evicts them. What a
    backend holds of a prompt is then a leading run, and matching finds its end by
    bisection: O(log n) lookups for a 100K-token prompt, not one per block. vLLM's own
    lookup walks from the start and stops at the first miss; they agree while the held
    part is a leading run, which both eviction orders keep.
    """

    def __init__(self, capacity: int = 1 << 20, learn: bool = True):
        self.capacity = capacity
        self.learn = learn  # whether placements feed it (False: KV events do)
        self.blocks: dict[str, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks.values())

    def follow_events(self) -> None:
        """From now on the servers' KV events feed the index, placements no longer."""
        self.learn = False

    def resize(self, capacity: int) -> None:
        """A new bound per backend; a smaller one takes effect at each backend's next insert."""
        self.capacity = capacity

    def match(self, backend: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` that `backend` holds."""
        held = self.blocks.get(backend)
        if not held or not hashes or hashes[0] not in held:
            return 0
        lo, hi = 1, len(hashes)  # hashes[:lo] are held; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def cached(self, backend: str, blocks: PromptBlocks) -> int:
        return blocks.prefix_tokens(self.match(backend, blocks.hashes))

    def routed(self, backend: str, blocks: PromptBlocks) -> None:
        if self.learn:
            self.insert(backend, blocks.hashes)

    def insert(self, backend: str, hashes: Sequence[int]) -> None:
        """`backend` holds these blocks of one prompt now, in prompt order (a placement, or
        a BlockStored event): they become the most recently used, the last one oldest."""
        held = self.blocks.setdefault(backend, OrderedDict())
        for h in reversed(hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def remove(self, backend: str, hashes: Iterable[int]) -> None:
        """`backend` dropped these blocks (a BlockRemoved event)."""
        held = self.blocks.get(backend)
        if held:
            for h in hashes:
                held.pop(h, None)

    def clear(self, backend: str | None = None) -> None:
        """`backend` dropped every block (AllBlocksCleared), or forget every backend."""
        if backend is None:
            self.blocks.clear()
        else:
            self.blocks.pop(backend, None)

    def size(self, backend: str) -> int:
        return len(self.blocks.get(backend, ()))
