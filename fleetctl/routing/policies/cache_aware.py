"""`cache-aware`: sgl-router's and vllm-router's `cache_aware` policy, as their source has it."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixIndex, PrefixView
from fleetctl.routing.types import Backend, Decision, Request


class CacheAware(Policy):
    """sgl-router / vllm-router's `cache_aware` policy.

    Source: github.com/vllm-project/router (the Rust router adapted from sgl-router),
    src/policies/cache_aware.rs at 2f2db0d9a6d075496b8327dfd1aac56d57eb27e7
    (`select_worker_with_headers`); defaults from the CLI, src/main.rs at
    03e9af5c1982f7568d79021d80d812edecb2d702 (`--cache-threshold 0.3`,
    `--balance-abs-threshold 64`, `--balance-rel-threshold 1.5`, `--eviction-interval 120`,
    `--max-tree-size 2^26`), the same as sglang-router's launcher. (The library's
    `CacheAwareConfig::default()` in src/policies/mod.rs says 0.5 / 32 / 1.1 / 30 s / 10000,
    but a router started from the command line runs the CLI's.)

    Per worker, `load` is the router's count of requests in flight there (`outstanding`).

    1. Imbalanced when both `max - min > balance_abs_threshold` and
       `max > min * balance_rel_threshold`: the least-loaded worker (the first one on a tie,
       as Rust's `min_by_key`), whatever the prefix.
    2. Otherwise the approximate tree: match rate = matched / input length of the worker with
       the longest match; above `cache_threshold` (strictly) that worker, else the
       least-loaded one. (The file's header comment still says "smallest tree" for the low
       match case; the code, in vllm-router and in current sgl-router, takes min load.)
    3. An empty prompt matches nothing (rate 0): least load. Requests without hashes go so.

    The peer's tree is a radix tree over the request TEXT, one per model, whose nodes record
    which workers ("tenants") were sent that text, with per-tenant LRU eviction. Here it is a
    `PrefixIndex` over the prompt's chained block hashes: hash j names the whole prompt up to
    block j, so "the leading hashes a backend holds" is exactly how deep a radix-tree walk gets
    on that tenant's branches, at block rather than character granularity. It learns from our
    own placements only (`placed`), never from `self.prefix`: the peer has no KV events.
    Where several backends match equally deep, the peer returns the node's cached
    `last_tenant`, else the first tenant of the node's hash map (an arbitrary but sticky
    order per node, src/tree.rs `match_prefix_with_counts`); here a seeded hash of (node, name)
    gives such an order. Bound: `max_tree_size` characters per tenant, at
    `CHARS_PER_TOKEN` characters a token, in blocks of the request's size; the peer evicts
    LRU leaves every `eviction_interval` seconds (so it may overshoot in between), this index
    evicts on insert.
    """

    name = "cache-aware"
    reads_prefix = True
    own_index = True  # its tree, fed by its placements, as the peer keeps one
    CACHE_THRESHOLD = 0.3
    BALANCE_ABS_THRESHOLD = 64
    BALANCE_REL_THRESHOLD = 1.5
    MAX_TREE_SIZE = 1 << 26  # characters per tenant
    CHARS_PER_TOKEN = 4  # the peer matches characters; a token of English text is ~4

    def __init__(
        self,
        seed: int = 0,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        max_tree_size: int = MAX_TREE_SIZE,
        prefix: PrefixView | None = None,
    ) -> None:
        super().__init__(prefix)
        self.seed = seed
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.tree = PrefixIndex(capacity=max_tree_size)  # in blocks once a block size is seen
        self._sized = False

    def imbalanced(self, backends: Sequence[Backend]) -> bool:
        loads = [b.outstanding for b in backends]
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        least = min(backends, key=lambda b: b.outstanding)  # first of the least loaded
        if self.imbalanced(backends):
            lo, hi = least.outstanding, max(b.outstanding for b in backends)
            return Decision(least, self.name, ("balance",), detail=f"(load {lo}..{hi})")
        blocks = req.blocks
        if blocks is None or not blocks.hashes or blocks.tokens <= 0:
            return Decision(least, self.name, ("prefix:none",), detail=f"({least.outstanding})")
        depth = {b.name: self.tree.match(b.name, blocks.hashes) for b in backends}
        deepest = max(depth.values())
        rate = blocks.prefix_tokens(deepest) / blocks.tokens
        if deepest and rate > self.cache_threshold:
            node = blocks.hashes[deepest - 1]
            tied = [b for b in backends if depth[b.name] == deepest]
            best = min(tied, key=lambda b: self._order(node, b.name))
            return Decision(best, self.name, ("prefix:hit",), detail=f"(match {rate:.2f})")
        return Decision(least, self.name, ("prefix:miss",), detail=f"(match {rate:.2f})")

    def _order(self, node: int, name: str) -> int:
        """The tenants' arbitrary but fixed order at one tree node (a seeded hash)."""
        return zlib.crc32(f"{self.seed}:{node}:{name}".encode())

    def placed(self, req: Request, backend: Backend, decision: Decision | None = None) -> None:
        super().placed(req, backend, decision)
        if req.blocks is None:
            return
        if not self._sized:
            per_block = self.CHARS_PER_TOKEN * req.blocks.block_tokens
            self.tree.resize(max(1, self.max_tree_size // per_block))
            self._sized = True
        self.tree.insert(backend.name, req.blocks.hashes)
