"""The peers' prefix-cache-aware routing policies, as their own sources define them.

Each reads `Request.blocks` and the policy's `prefix` view (or keeps its own approximate
index, as the peer does). Azure-style requests without hashes fall back to each peer's load
balancing.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetctl.routing.policy import Policy, RoutingConfig

# name -> factory(seed, config); filled in by the peers' policies below.
PEER_POLICIES: dict[str, Callable[[int, RoutingConfig | None], Policy]] = {}
