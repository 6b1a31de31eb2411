"""Every routing policy by name, each registered once: its class, how it is built, whether
`simulate` compares it by default. Adding one: docs/development.md, "Adding a routing policy"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fleetctl.routing.policies.cache_aware import CacheAware
from fleetctl.routing.policies.kv_aware import KvAware
from fleetctl.routing.policies.kv_router import KvRouter
from fleetctl.routing.policies.least_outstanding import LeastOutstanding
from fleetctl.routing.policies.lora_affinity import LoraAffinity
from fleetctl.routing.policies.power_of_two import PowerOfTwo
from fleetctl.routing.policies.prefix_kv import PrefixKv
from fleetctl.routing.policies.round_robin import RoundRobin
from fleetctl.routing.policy import HardwareAware, Policy, RoutingConfig
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.sessions import SessionTable


@dataclass(frozen=True)
class Context:
    """What a policy may be built with; each takes what it uses."""

    seed: int = 0  # its own random generator's, where it breaks ties at random
    config: RoutingConfig | None = None  # the inventory's router settings and each model's SLO
    prefix: PrefixView | None = None  # what each backend has cached of a prompt
    sessions: SessionTable | None = None  # session pins, shared by router replicas


@dataclass(frozen=True)
class Registered:
    """One policy: its class (whose `name`, `reads_prefix` and `own_index` say what it is and
    what to build it with), how to build it, and whether `simulate` compares it unasked."""

    cls: type[Policy]
    build: Callable[[Context], Policy]
    compared: bool


REGISTRY: dict[str, Registered] = {}


def register(
    cls: type[Policy], build: Callable[[Context], Policy] | None = None, compared: bool = False
) -> None:
    """Make `cls` known by its `name` to `route-serve --policy`, `simulate --policies`, the
    what-if and the simulator; `build` makes one from a Context (default: `cls(prefix)`)."""
    if cls.name in REGISTRY:
        raise ValueError(f"routing policy {cls.name!r} is registered twice")
    REGISTRY[cls.name] = Registered(cls, build or (lambda c: cls(c.prefix)), compared)


# One line a policy, its class a module of routing/policies/ (hardware-aware's builds on the
# base in routing/policy.py), in the order `route-serve` and `simulate` list the names in and
# `simulate` compares the `compared` ones in: a list, so that order is this one.
# The baselines users would otherwise run, and the seed's scheduler.
register(RoundRobin, compared=True)
register(LeastOutstanding, compared=True)
register(PowerOfTwo, lambda c: PowerOfTwo(c.seed, c.prefix), compared=True)
register(KvAware, compared=True)
register(HardwareAware, lambda c: HardwareAware(c.config, c.sessions, c.prefix), compared=True)
# The peers' prefix-cache-aware policies, compared when named.
register(CacheAware, lambda c: CacheAware(c.seed, prefix=c.prefix))
register(PrefixKv, lambda c: PrefixKv(c.seed, prefix=c.prefix))
register(KvRouter, lambda c: KvRouter(c.seed, prefix=c.prefix))
register(LoraAffinity, lambda c: LoraAffinity(c.seed, prefix=c.prefix))


def policy_class(name: str) -> type[Policy]:
    """The policy class `name` makes, to read what it declares it needs (KeyError: unknown)."""
    return REGISTRY[name].cls


def policy_names() -> list[str]:
    """Every policy's name, in the order registered."""
    return list(REGISTRY)


def compared_policies() -> tuple[str, ...]:
    """The policies `simulate` compares when none are named."""
    return tuple(name for name, r in REGISTRY.items() if r.compared)


def make_policy(
    name: str,
    seed: int = 0,
    config: RoutingConfig | None = None,
    prefix: PrefixView | None = None,
    sessions: SessionTable | None = None,
) -> Policy:
    """A fresh policy by name, built with what it may know of each backend's prefix cache
    (`prefix`) and, for hardware-aware, the session pins it shares (`sessions`)."""
    return REGISTRY[name].build(Context(seed, config, prefix, sessions))
