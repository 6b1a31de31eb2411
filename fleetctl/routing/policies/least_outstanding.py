"""`least-outstanding`: the backend with the fewest requests in flight from this router."""

from __future__ import annotations

from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.types import Backend, Decision, Request


class LeastOutstanding(Policy):
    name = "least-outstanding"

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        b = min(backends, key=lambda b: (b.outstanding, b.name))
        return Decision(b, self.name, detail=f"({b.outstanding})")
