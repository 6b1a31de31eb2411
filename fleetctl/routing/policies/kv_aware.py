"""`kv-aware`: the emptiest KV cache, as production-stack's and llm-d's KV-usage scoring."""

from __future__ import annotations

from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.types import Backend, Decision, Request


class KvAware(Policy):
    name = "kv-aware"

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        b = min(backends, key=lambda b: (b.kv_usage, b.waiting, b.outstanding, b.name))
        return Decision(b, self.name, detail=f"(usage {b.kv_usage:.2f})")
