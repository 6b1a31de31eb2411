"""A routing policy is its class and one registration (routing/registry.py): every name the
daemon, the simulator and `simulate --policies` know comes from that one table."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator, Sequence

import pytest

import fleetctl.routing
from fleetctl.routing.policy import Policy
from fleetctl.routing.prefix import PrefixIndex, PrefixView
from fleetctl.routing.registry import (
    REGISTRY,
    compared_policies,
    make_policy,
    policy_class,
    policy_names,
    register,
)
from fleetctl.routing.sessions import SessionTable
from fleetctl.routing.types import Backend, Decision, Request
from fleetctl.sim.fleet import simulate
from fleetctl.sim.workload import Synthetic
from tests.routing.test_policy import _mixed


class FirstBackend(Policy):
    """The least a policy can be: the first eligible backend, by name."""

    name = "first-backend"

    def __init__(self, seed: int, prefix: PrefixView | None = None) -> None:
        super().__init__(prefix)
        self.seed = seed

    def choose(self, req: Request, backends: Sequence[Backend]) -> Decision:
        return Decision(min(backends, key=lambda b: b.name), self.name)


@pytest.fixture
def first_backend() -> Iterator[None]:
    register(FirstBackend, lambda c: FirstBackend(c.seed, c.prefix))
    try:
        yield
    finally:
        del REGISTRY[FirstBackend.name]


def test_one_registration_makes_a_policy_known_everywhere(first_backend, catalog):
    """Registered once, a policy is a name route-serve and `simulate` accept, is built with
    what its registration takes from the context, and routes in the simulator."""
    assert "first-backend" in policy_names()
    assert policy_class("first-backend") is FirstBackend
    index = PrefixIndex()
    built = make_policy("first-backend", seed=7, prefix=index)
    assert isinstance(built, FirstBackend) and built.seed == 7 and built.prefix is index
    assert "first-backend" not in compared_policies()  # compared when named, not by default
    servers = _mixed(catalog)
    items = Synthetic(model="llama-3-8b", rate=2, duration=20, max_context=8192).generate(1)
    result = simulate(servers, items, "first-backend")
    first = min(s.name for s in servers)
    assert result.outcomes and {o.backend for o in result.outcomes} == {first}


def test_a_name_is_registered_once(first_backend):
    with pytest.raises(ValueError, match="'first-backend' is registered twice"):
        register(FirstBackend)


def test_every_policy_class_is_registered_under_its_own_name():
    """Each policy class of routing/ (ours and the peers', in any of its modules) is in the one
    table under its `name`, and its registration builds that class with the context it is
    given."""
    modules = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(fleetctl.routing.__path__, "fleetctl.routing.")
    ]
    classes = [
        cls
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, Policy) and cls is not Policy and cls.__module__ == module.__name__
    ]
    assert {c.name for c in classes} == set(REGISTRY)
    sessions, index = SessionTable(), PrefixIndex()
    for cls in classes:
        assert REGISTRY[cls.name].cls is cls
        built = make_policy(cls.name, seed=3, prefix=index, sessions=sessions)
        assert type(built) is cls and built.prefix is index, cls.name
    assert make_policy("hardware-aware", sessions=sessions).sessions is sessions  # type: ignore[attr-defined]
    with pytest.raises(KeyError):
        make_policy("no-such-policy")


def test_each_policy_is_a_module_of_its_own():
    """Every module of routing/policies/ defines one Policy subclass, registered under its
    name, and every registered policy lives in such a module of its own, hardware-aware
    alone excepted (its class builds on the base's eligibility in routing/policy.py)."""
    package = importlib.import_module("fleetctl.routing.policies")
    homes = {}
    for m in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{m.name}")
        own = [
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, Policy) and cls.__module__ == module.__name__
        ]
        assert len(own) == 1, f"{m.name} defines {[c.__name__ for c in own]}"
        assert REGISTRY[own[0].name].cls is own[0], m.name
        homes[own[0].name] = m.name
    assert set(REGISTRY) - set(homes) == {"hardware-aware"}
    assert all(module == name.replace("-", "_") for name, module in homes.items()), homes


def test_simulate_compares_the_registered_defaults():
    """`simulate --policies`' default (a literal, so the command line loads no routing code
    to show its help) names the policies registered as compared, in their order."""
    from fleetctl.cli.plan_cmds import simulate as command

    default = inspect.signature(command).parameters["policies"].default.default
    assert tuple(default.split(",")) == compared_policies()
    assert compared_policies() == (
        "round-robin",
        "least-outstanding",
        "power-of-two",
        "kv-aware",
        "hardware-aware",
    )
