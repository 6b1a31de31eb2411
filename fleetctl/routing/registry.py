"""Every routing policy by name: ours (routing/policy.py) and the peers' (routing/peers.py)."""

from __future__ import annotations

from collections.abc import Callable

from fleetctl.routing.peers import PEER_POLICIES
from fleetctl.routing.policy import (
    HardwareAware,
    KvAware,
    LeastOutstanding,
    Policy,
    PowerOfTwo,
    RoundRobin,
    RoutingConfig,
)
from fleetctl.routing.prefix import PrefixView

POLICIES: dict[str, Callable[..., Policy]] = {
    "round-robin": RoundRobin,
    "least-outstanding": LeastOutstanding,
    "power-of-two": PowerOfTwo,
    "kv-aware": KvAware,
    "hardware-aware": HardwareAware,
}


def policy_names() -> list[str]:
    """Every policy's name: ours, then the peers' prefix-aware ones."""
    return [*POLICIES, *PEER_POLICIES]


def make_policy(
    name: str,
    seed: int = 0,
    config: RoutingConfig | None = None,
    prefix: PrefixView | None = None,
) -> Policy:
    """A fresh policy by name; `prefix` is what it may know of each backend's prefix cache."""
    policy: Policy
    if name == "power-of-two":
        policy = PowerOfTwo(seed)
    elif name == "hardware-aware":
        policy = HardwareAware(config)
    elif name in POLICIES:
        policy = POLICIES[name]()
    elif name in PEER_POLICIES:
        policy = PEER_POLICIES[name](seed, config)
    else:
        raise KeyError(name)
    if prefix is not None:
        policy.prefix = prefix
    return policy
