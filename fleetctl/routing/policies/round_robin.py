"""`round-robin`: each backend in turn, as vllm-router's and sgl-router's `round_robin`."""

from __future__ import annotations

from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.types import Backend, Decision, Request


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, prefix: PrefixView | None = None) -> None:
        super().__init__(prefix)
        self.turn = 0

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        b = backends[self.turn % len(backends)]
        self.turn += 1
        return Decision(b, self.name)
