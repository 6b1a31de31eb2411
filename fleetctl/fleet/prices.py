"""What GPUs cost: a node's price per hour, a deployment's share of it, cost per output token."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from fleetctl.base.errors import UserError
from fleetctl.fleet.inventory import Inventory, Node

OBJECTIVES = ("throughput", "cost")

# Where a price comes from, as shown beside it.
FROM_NODE = "inventory"  # the node entry's cost_per_hour
FROM_PROFILE = "profile"  # gpus.count x the GPU profile's default cost_per_hour


def node_cost_per_hour(node: Node) -> float | None:
    """The node's price per hour: its inventory entry's cost_per_hour, else its GPU count
    times the GPU profile's default, else None (no price known)."""
    if node.cost_per_hour is not None:
        return node.cost_per_hour
    if node.gpu.cost_per_hour is not None:
        return node.gpu_count * node.gpu.cost_per_hour
    return None


def node_cost_source(node: Node) -> str | None:
    """Where node_cost_per_hour's figure comes from (FROM_NODE, FROM_PROFILE), None without one."""
    if node.cost_per_hour is not None:
        return FROM_NODE
    if node.gpu.cost_per_hour is not None:
        return FROM_PROFILE
    return None


def gpus_cost_per_hour(node: Node, gpu_count: int) -> float | None:
    """The share of the node's price for `gpu_count` of its GPUs (its GPUs cost alike);
    None where the node has no price."""
    whole = node_cost_per_hour(node)
    if whole is None:
        return None
    return whole * gpu_count / node.gpu_count


def total(costs: Iterable[float | None]) -> float | None:
    """The sum of prices, or None if any is unknown: a partial sum would understate the
    cost and read as a real figure."""
    out = 0.0
    for c in costs:
        if c is None:
            return None
        out += c
    return out


def per_million_tokens(cost_per_hour: float | None, tokens_per_s: float | None) -> float | None:
    """Cost of a million output tokens at `tokens_per_s` output tokens a second:
    cost_per_hour / (tokens_per_s x 3600) x 1e6. None without a price or a positive rate."""
    if cost_per_hour is None or tokens_per_s is None or tokens_per_s <= 0:
        return None
    return cost_per_hour * 1e6 / (tokens_per_s * 3600.0)


def with_objective(inv: Inventory, objective: str) -> Inventory:
    """`inv` planned for `objective` (plan --objective) instead of its planner.objective."""
    if objective not in OBJECTIVES:
        raise UserError(
            f"unknown objective {objective!r}",
            None,
            f"use --objective {' or '.join(OBJECTIVES)}",
        )
    planner = inv.spec.planner.model_copy(update={"objective": objective})
    return dataclasses.replace(inv, spec=inv.spec.model_copy(update={"planner": planner}))
