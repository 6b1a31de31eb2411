"""Probed node facts (`.fleetctl/facts.json`) and how they override the declared GPUs."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

from fleetctl.catalog import Catalog
from fleetctl.errors import Location, UserError
from fleetctl.inventory import Inventory

FACTS_FORMAT = 1


def load_facts(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(
            "no such facts file", Location(str(path)), "run `fleetctl probe` first"
        ) from None
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot read facts: {e}", Location(str(path)), "re-run `fleetctl probe`"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("nodes"), dict):
        raise UserError(
            "facts file has no 'nodes' mapping", Location(str(path)), "re-run `fleetctl probe`"
        )
    return raw


def apply_facts(
    inv: Inventory, facts: dict[str, Any], catalog: Catalog
) -> tuple[Inventory, list[str]]:
    """Probed GPUs win over declared ones; every disagreement becomes a warning."""
    warnings: list[str] = []
    nodes = []
    for node in inv.nodes:
        probed = facts["nodes"].get(node.name)
        gpus = probed.get("gpus") if isinstance(probed, dict) else None
        if not gpus:
            nodes.append(node)
            continue
        names = Counter(str(g.get("name", "")) for g in gpus)
        if len(names) > 1:
            warnings.append(
                f"{node.name}: probed mixed GPU types ({', '.join(sorted(names))}); "
                "using the declared type"
            )
            nodes.append(node)
            continue
        ((name, count),) = names.items()
        gpu = catalog.find_gpu(name)
        if gpu is None:
            warnings.append(
                f"{node.name}: probed GPU '{name}' has no profile; using the declared "
                f"{node.gpu.name} (add a profile with that alias)"
            )
            nodes.append(node)
            continue
        if gpu.name != node.gpu.name or count != node.gpu_count:
            warnings.append(
                f"{node.name}: inventory declares {node.gpu_count}x {node.gpu.name}, "
                f"probed {count}x {gpu.name}; planning with the probed GPUs"
            )
        nodes.append(dataclasses.replace(node, gpu=gpu, gpu_count=count))
    return dataclasses.replace(inv, nodes=tuple(nodes)), warnings
