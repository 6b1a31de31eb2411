"""The peers' prefix-cache-aware routing policies, as their own sources define them.

Each reads `Request.blocks` and the policy's `prefix` view (or keeps its own approximate
index, as the peer does). Azure-style requests without hashes fall back to each peer's load
balancing.

Pure: no clock, no I/O; where a peer breaks ties at random, the policy's own seeded generator
does. Where a peer reads a quantity we do not have, the docstring names the closest snapshot
field used instead.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixIndex, PrefixView, PromptBlocks
from fleetctl.routing.types import Backend, Decision, Request

# The engine's KV block size when a request carries no hashes to take it from (vLLM's default).
VLLM_BLOCK_TOKENS = 16


def _full_blocks(blocks: PromptBlocks) -> int:
    """Whole blocks of the prompt: the peers hash (and engines cache) only full blocks."""
    return blocks.tokens // blocks.block_tokens


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


class PrefixKv(Policy):
    """llm-d's inference scheduler with the precise prefix-cache scorer (KV-event fed).

    Source: github.com/llm-d/llm-d-inference-scheduler at
    520af47896e5f06e43d09aca281a1149187b0ffd: the scheduling profile of
    deploy/config/epp-precise-prefix-cache-config.yaml (precise-prefix-cache-scorer weight
    2.0, kv-cache-utilization-scorer 1.0, queue-scorer 1.0, max-score-picker), scorers in
    pkg/epp/framework/plugins/scheduling/scorer/{preciseprefixcache,kvcacheutilization,
    queuedepth}, the weighted sum in pkg/epp/scheduling/scheduler_profile.go (each score
    clipped to [0, 1] times its weight) and pkg/epp/framework/plugins/scheduling/picker/
    maxscore/picker.go.

    - prefix: matched leading blocks / the prompt's blocks, clipped to [0, 1]
      (`absoluteScoredPods`); no blocks: 0 everywhere. The match is `self.prefix.cached`,
      the engines' cache contents (llm-d's index is fed by vLLM's KV events), counted in
      whole blocks of the request's block size.
    - kv-cache-utilization: 1 - kv_usage (vllm:kv_cache_usage_perc).
    - queue: min-max over the candidates of the engine's waiting queue
      (`WaitingQueueSize` = vllm:num_requests_waiting, our `Backend.waiting`: nothing
      queued router-side), (max - q) / (max - min), 1.0 for all when equal.
    - max-score picker: the highest weighted sum; ties at random (it shuffles the candidates,
      then sorts stably), here with the policy's seeded generator.
    """

    name = "prefix-kv"
    reads_prefix = True
    PREFIX_WEIGHT = 2.0
    KV_UTILIZATION_WEIGHT = 1.0
    QUEUE_WEIGHT = 1.0

    def __init__(
        self,
        seed: int = 0,
        prefix_weight: float = PREFIX_WEIGHT,
        kv_utilization_weight: float = KV_UTILIZATION_WEIGHT,
        queue_weight: float = QUEUE_WEIGHT,
        prefix: PrefixView | None = None,
    ) -> None:
        super().__init__(prefix)
        self.rng = random.Random(seed)
        self.prefix_weight = prefix_weight
        self.kv_utilization_weight = kv_utilization_weight
        self.queue_weight = queue_weight

    def prefix_score(self, req: Request, b: Backend) -> float:
        blocks = req.blocks
        if blocks is None or _full_blocks(blocks) <= 0:
            return 0.0
        matched = self.prefix.cached(b.name, blocks) // blocks.block_tokens
        return min(1.0, matched / _full_blocks(blocks))

    def scores(self, req: Request, backends: Sequence[Backend]) -> dict[str, float]:
        """Each backend's weighted score, by name."""
        lo = min(b.waiting for b in backends)
        hi = max(b.waiting for b in backends)
        out = {}
        for b in backends:
            queue = 1.0 if hi == lo else (hi - b.waiting) / (hi - lo)
            kv = min(1.0, max(0.0, 1.0 - b.kv_usage))
            out[b.name] = (
                self.prefix_weight * self.prefix_score(req, b)
                + self.kv_utilization_weight * kv
                + self.queue_weight * queue
            )
        return out

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        scores = self.scores(req, backends)
        pool = list(backends)
        self.rng.shuffle(pool)
        best = max(pool, key=lambda b: scores[b.name])  # the first of the best: a random tie
        hit = self.prefix_score(req, best)
        note = "prefix:none" if req.blocks is None else "prefix:hit" if hit > 0 else "prefix:miss"
        return Decision(
            best, self.name, (note,), detail=f"(score {scores[best.name]:.2f}, prefix {hit:.2f})"
        )


class KvRouter(Policy):
    """NVIDIA Dynamo's KV router (`DefaultWorkerSelector`), temperature 0.

    Source: github.com/ai-dynamo/dynamo, lib/llm/src/kv_router/scheduler.rs at
    db19bd2a659d4cb04998fb4101cd0dbfbbeba9d4 (`select_worker`, `softmax_sample`); defaults
    from lib/llm/src/kv_router/config.rs at 79a21ca4f5200e76a2bcc19580eb6176298c7e59
    (`overlap_score_weight` 1.0, `router_temperature` 0.0, `router_track_active_blocks` true,
    `router_track_output_blocks` false, `router_assume_kv_reuse` true,
    `router_queue_threshold` None); the potential loads as in
    lib/llm/src/kv_router/sequence.rs (`potential_blocks_and_tokens`).

    cost = overlap_score_weight * potential_prefill_blocks + potential_decode_blocks, lowest
    wins, where with block size `bs` and `overlap` the worker's cached leading blocks:

    - potential_prefill_blocks = (isl - overlap * bs + the worker's active prefill tokens)
      / bs. Dynamo's active prefill tokens are the uncached prompt tokens of requests it
      routed there that have not finished prefill; the closest field is `pending_prefill`
      (the whole prompts of ours that have not produced a token).
    - potential_decode_blocks = the request's blocks not among the worker's active blocks +
      the worker's active blocks. Dynamo counts the prompt blocks of the requests it routed
      there (output blocks not tracked by default; a prefix shared by several requests
      counted once, as it assumes KV reuse). The closest field is the engine's KV in use,
      kv_usage * kv_tokens / bs, which shares prefixes the same way (`reserved_tokens` would
      count every shared prefix once per request, plus all expected output); the request's
      new blocks are its whole blocks less the cached ones (a cached prefix taken as active).
      The daemon scrapes kv_usage, so it lags Dynamo's own bookkeeping between scrapes.
    - overlap from `self.prefix.cached` (Dynamo's indexer is fed by KV events), in whole
      blocks of the request's block size; `bs` is that size, or vLLM's 16 without hashes
      (then no overlap and no new blocks, as Dynamo without a token sequence).

    Temperature 0 takes every worker at the minimum cost; on a tie the smaller indexer tree
    (`self.prefix.size(name)` where the view has it), then one at random (seeded here).
    """

    name = "kv-router"
    reads_prefix = True
    OVERLAP_SCORE_WEIGHT = 1.0

    def __init__(
        self,
        seed: int = 0,
        overlap_score_weight: float = OVERLAP_SCORE_WEIGHT,
        prefix: PrefixView | None = None,
    ) -> None:
        super().__init__(prefix)
        self.rng = random.Random(seed)
        self.overlap_score_weight = overlap_score_weight

    def cost(self, req: Request, b: Backend) -> tuple[float, int]:
        """(cost, overlap blocks) of sending `req` to `b`."""
        blocks = req.blocks
        bs = blocks.block_tokens if blocks is not None else VLLM_BLOCK_TOKENS
        overlap = 0
        new_blocks = 0
        if blocks is not None:
            overlap = min(_full_blocks(blocks), self.prefix.cached(b.name, blocks) // bs)
            new_blocks = _full_blocks(blocks) - overlap
        new_tokens = max(0, req.prompt_tokens - overlap * bs)
        prefill_blocks = (new_tokens + b.pending_prefill) / bs
        decode_blocks = new_blocks + b.kv_usage * b.kv_tokens / bs
        return self.overlap_score_weight * prefill_blocks + decode_blocks, overlap

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        costs = {b.name: self.cost(req, b) for b in backends}
        low = min(c for c, _ in costs.values())
        tied = [b for b in backends if costs[b.name][0] == low]
        if len(tied) > 1:
            size = getattr(self.prefix, "size", None)
            if callable(size):
                smallest = min(size(b.name) for b in tied)
                tied = [b for b in tied if size(b.name) == smallest]
        best = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        cost, overlap = costs[best.name]
        note = "prefix:none" if req.blocks is None else "prefix:hit" if overlap else "prefix:miss"
        return Decision(best, self.name, (note,), detail=f"(cost {cost:.1f}, cached {overlap})")
