"""A vLLM V1 KV block pool with automatic prefix caching, kept in runs rather than blocks.

vLLM (v1/core/block_pool.py, 0.32) keeps free blocks in one queue, least recently freed at
the head. A request that finishes or is preempted appends its blocks in reverse order, so its
last block goes first; a freed full block keeps its hash and contents until the allocator
pops it from the head for someone else (the eviction); a request whose prompt starts with
cached blocks takes them back out of the queue (or shares them, when another running
request holds them) and skips their prefill.

Here the queue holds runs: the blocks one request freed, in the order vLLM would evict them.
Blocks named by a shared prefix hash are tracked one by one (`cached`: hash -> reference
count and the run it waits in, if free); a request's other full blocks (the rest of its
prompt, its generated tokens) can only be found again by that request after a preemption,
so they stay a count on their run; partial blocks are anonymous. Requests without hashes
(the Azure traces) cost O(1) per free and per allocation, as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from fleetctl.routing.prefix import PromptBlocks

_MIX = 0x9E3779B97F4A7C15  # spreads block offsets over the hash's bits


def engine_keys(blocks: PromptBlocks, block_size: int) -> list[int]:
    """Keys of the prompt's full `block_size`-token blocks.

    Engine block b ends at token e = (b + 1) * block_size. The prompt up to e is named by the
    hash of the trace block holding token e - 1 and the offset of e inside it, so two prompts
    share a key exactly when their hashes say they share everything up to e. Trace blocks
    coarser than the engine's (Mooncake's 512 tokens) give 512 / 16 keys each.
    """
    bt, hashes = blocks.block_tokens, blocks.hashes
    full = min(blocks.tokens, len(hashes) * bt) // block_size
    if bt % block_size == 0:  # whole engine blocks per trace block: one comprehension
        offsets = [k * block_size * _MIX for k in range(1, bt // block_size + 1)]
        return [h ^ o for h in hashes for o in offsets][:full]
    out = []
    for b in range(full):
        end = (b + 1) * block_size
        c = (end - 1) // bt
        out.append(hashes[c] ^ ((end - c * bt) * _MIX))
    return out


class Run:
    """Blocks one request freed, evicted from the top (`hi`) down.

    keyed: `keys[lo:hi]` (a key still here is one whose entry points back at this run);
    otherwise `hi - lo` blocks, which only `owner` can find again (after its preemption)."""

    __slots__ = ("hi", "keys", "lo", "owner")

    def __init__(self, n: int, keys: list[int] | None = None, owner: Any = None):
        self.keys = keys
        self.owner = owner
        self.lo = 0
        self.hi = n


class KvPool:
    """`total` blocks; `free` of them not held by a running request (cached ones included)."""

    def __init__(self, total: int, events: list[tuple[str, list[int]]] | None = None):
        self.total = total
        self.free = total
        self.queue: deque[Run] = deque([Run(total)] if total else [])
        # hash -> [requests holding it, the run it waits in while free (else None)]
        self.cached: dict[int, list[Any]] = {}
        # ("stored" | "removed", keys) as they happen, for a KV event publisher; None: off.
        self.events = events

    # --- lookups ---------------------------------------------------------------------------

    def match(self, keys: Sequence[int], limit: int) -> tuple[int, int]:
        """(leading blocks of `keys` cached, how many of those are free) up to `limit`."""
        cached = self.cached
        n = free = 0
        for key in keys:
            if n >= limit:
                break
            entry = cached.get(key)
            if entry is None:
                break
            n += 1
            if not entry[0]:
                free += 1
        return n, free

    def own(self, run: Run | None, limit: int) -> int:
        """Blocks of a preempted request's own run still cached, up to `limit`."""
        return 0 if run is None else max(0, min(run.hi - run.lo, limit))

    # --- taking and giving back -------------------------------------------------------------

    def take_hits(self, keys: Sequence[int], n: int) -> None:
        """A request starts with the first `n` of `keys`, found cached: share the ones held,
        take the free ones out of the queue."""
        cached = self.cached
        for key in keys[:n]:
            entry = cached[key]
            if not entry[0]:
                entry[1] = None  # its run skips it from now on
                self.free -= 1
            entry[0] += 1

    def take_own(self, run: Run, n: int) -> None:
        """A resumed request takes back the first `n` blocks of its own run."""
        run.lo += n
        self.free -= n

    def allocate(self, n: int) -> None:
        """Hand out `n` blocks from the head of the queue, evicting what they cached."""
        if n > self.free:
            raise ValueError(f"allocating {n} KV blocks with {self.free} free")
        self.free -= n
        queue, cached, events = self.queue, self.cached, self.events
        evicted: list[int] = []
        while n:
            run = queue[0]
            if run.keys is None:
                got = min(n, run.hi - run.lo)
                run.hi -= got
                n -= got
            else:
                keys = run.keys
                while n and run.hi > run.lo:
                    run.hi -= 1
                    key = keys[run.hi]
                    entry = cached.get(key)
                    if entry is not None and entry[1] is run:
                        del cached[key]
                        n -= 1
                        if events is not None:
                            evicted.append(key)
            if run.hi <= run.lo:
                queue.popleft()
        if evicted and events is not None:
            events.append(("removed", evicted))

    def register(self, key: int) -> bool:
        """A request computed the block named `key`: it is cached from now on (held by that
        request). False when the key is cached already (the request keeps a private copy)."""
        if key in self.cached:
            return False
        self.cached[key] = [1, None]
        if self.events is not None:
            self.events.append(("stored", [key]))
        return True

    def release(self, held: Sequence[int], private: int, partial: int, owner: Any) -> Run | None:
        """A request gives back its blocks: `partial` uncached ones, `private` full blocks
        only `owner` may find again (None: nobody), and the shared `held` keys. They join the
        queue last block first, as vLLM frees them. Returns the owner's private run."""
        queue = self.queue
        anon = partial + (private if owner is None else 0)
        if anon:
            queue.append(Run(anon))
        mine = None
        if private and owner is not None:
            mine = Run(private, owner=owner)
            queue.append(mine)
        self.free += anon + (private if owner is not None else 0)
        if held:
            keys = list(held)
            run = Run(len(keys), keys)
            cached = self.cached
            back = 0
            for key in keys:
                entry = cached[key]
                entry[0] -= 1
                if not entry[0]:
                    entry[1] = run
                    back += 1
            if back:
                queue.append(run)
                self.free += back
        return mine

    def forget(self, run: Run | None) -> None:
        """The owner of a private run finished or left: its blocks are plain free blocks
        now (still in the queue, still counted free)."""
        if run is not None:
            run.owner = None

    def check(self) -> None:
        """Invariants, for tests: the queue holds exactly the free blocks."""
        queued = 0
        for run in self.queue:
            if run.keys is None:
                queued += run.hi - run.lo
            else:
                queued += sum(
                    1
                    for k in run.keys[run.lo : run.hi]
                    if (e := self.cached.get(k)) is not None and e[1] is run
                )
        held = sum(1 for e in self.cached.values() if e[0])
        assert queued == self.free, (queued, self.free)
        assert all(e[0] >= 0 for e in self.cached.values())
        assert held <= self.total - self.free, (held, self.total, self.free)
