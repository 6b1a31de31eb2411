"""`prefix-kv`: llm-d's scheduler with its precise prefix-cache scorer, as its source has it."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.types import Backend, Decision, Request


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
        if blocks is None or blocks.full_blocks() <= 0:
            return 0.0
        matched = self.prefix.cached(b.name, blocks) // blocks.block_tokens
        return min(1.0, matched / blocks.full_blocks())

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
