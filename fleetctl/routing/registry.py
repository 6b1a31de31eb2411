"""Every routing policy by name: ours (routing/policy.py) and the peers' (routing/peers.py)."""

from __future__ import annotations

from collections.abc import Callable

from fleetctl.routing.peers import PEER_POLICIES, CacheAware, KvRouter, PrefixKv
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
from fleetctl.routing.sessions import SessionTable

POLICIES: dict[str, Callable[..., Policy]] = {
    "round-robin": RoundRobin,
    "least-outstanding": LeastOutstanding,
    "power-of-two": PowerOfTwo,
    "kv-aware": KvAware,
    "hardware-aware": HardwareAware,
}


# The class behind each name, whose declarations (`reads_prefix`, `own_index`) say what to
# build it with before it is built.
CLASSES: dict[str, type[Policy]] = {
    "round-robin": RoundRobin,
    "least-outstanding": LeastOutstanding,
    "power-of-two": PowerOfTwo,
    "kv-aware": KvAware,
    "hardware-aware": HardwareAware,
    CacheAware.name: CacheAware,
    PrefixKv.name: PrefixKv,
    KvRouter.name: KvRouter,
}


def policy_class(name: str) -> type[Policy]:
    """The policy class `name` makes, to read what it declares it needs (KeyError: unknown)."""
    return CLASSES[name]


def policy_names() -> list[str]:
    """Every policy's name: ours, then the peers' prefix-aware ones."""
    return [*POLICIES, *PEER_POLICIES]


def make_policy(
    name: str,
    seed: int = 0,
    config: RoutingConfig | None = None,
    prefix: PrefixView | None = None,
    sessions: SessionTable | None = None,
) -> Policy:
    """A fresh policy by name, built with what it may know of each backend's prefix cache
    (`prefix`) and, for hardware-aware, the session pins it shares (`sessions`)."""
    if name == "power-of-two":
        return PowerOfTwo(seed, prefix)
    if name == "hardware-aware":
        return HardwareAware(config, sessions, prefix)
    if name in POLICIES:
        return POLICIES[name](prefix)
    if name in PEER_POLICIES:
        return PEER_POLICIES[name](seed, config, prefix)
    raise KeyError(name)
