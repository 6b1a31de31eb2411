"""`power-of-two`: the less loaded of two at random, as vllm-router's and sgl-router's."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.types import Backend, Decision, Request


class PowerOfTwo(Policy):
    name = "power-of-two"

    def __init__(self, seed: int = 0, prefix: PrefixView | None = None) -> None:
        super().__init__(prefix)
        self.rng = random.Random(seed)

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        if len(backends) == 1:
            return Decision(backends[0], self.name, ("(only one)",))
        a, b = self.rng.sample(list(backends), 2)
        pick = a if (a.outstanding, a.name) <= (b.outstanding, b.name) else b
        return Decision(pick, self.name)
