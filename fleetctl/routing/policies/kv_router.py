"""`kv-router`: NVIDIA Dynamo's KV router, as its source has it."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.types import Backend, Decision, Request

# The engine's KV block size when a request carries no hashes to take it from (vLLM's default).
VLLM_BLOCK_TOKENS = 16


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
            overlap = min(blocks.full_blocks(), self.prefix.cached(b.name, blocks) // bs)
            new_blocks = blocks.full_blocks() - overlap
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
