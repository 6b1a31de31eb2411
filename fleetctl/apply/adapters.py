"""LoRA adapter files apply copies onto nodes: read once from the inventory's `copy_from`
folders, written where each adapter's `source` names on the nodes that may load it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetctl.base.errors import UserError, shown
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.planner import lora

# An adapter folder holds a config, weights and perhaps a tokenizer: its top level only, and
# only plain file names, so nothing it holds can name a path outside the folder on the node.
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
MAX_ADAPTER_BYTES = 8 << 30  # a rank-512 adapter of a 70B model is about 6 GiB in BF16


@dataclass(frozen=True)
class Upload:
    """One adapter's files and where they go on a node."""

    name: str
    dest: str
    files: tuple[tuple[str, bytes], ...]


def read_uploads(inv: Inventory) -> dict[str, Upload]:
    """Every adapter with copy_from, its files read (by adapter name); a missing or empty
    folder, or one without adapter_config.json, is a UserError before any node is touched."""
    out = {}
    for i, m in enumerate(inv.models):
        for j, a in enumerate(m.adapters):
            if a.spec.copy_from is None:
                continue
            where = inv.source.at(("models", i, "adapters", j, "copy_from")) if inv.source else None
            folder = Path(a.spec.copy_from).expanduser()
            if not (folder / "adapter_config.json").is_file():
                raise UserError(
                    f"copy_from {shown(a.spec.copy_from)} of adapter '{a.name}' holds no "
                    "adapter_config.json",
                    where,
                    "point it at the adapter's folder (adapter_config.json and its weights)",
                )
            files = [f for f in sorted(folder.iterdir()) if f.is_file() and _FILE.fullmatch(f.name)]
            total = sum(f.stat().st_size for f in files)
            if total > MAX_ADAPTER_BYTES:
                raise UserError(
                    f"adapter '{a.name}' is {total / 2**30:.1f} GiB, past the "
                    f"{MAX_ADAPTER_BYTES >> 30} GiB apply copies",
                    where,
                    "put its files on the nodes yourself and remove copy_from",
                )
            out[a.name] = Upload(
                a.name, a.spec.source, tuple((f.name, f.read_bytes()) for f in files)
            )
    return out


def uploads_for(inv: Inventory, d: Deployment, read: Mapping[str, Upload]) -> list[Upload]:
    """What a server needs on its node before it starts: every adapter with copy_from it may
    load (at start or, with runtime loading, later)."""
    model = next((m for m in inv.models if m.name == d.model), None)
    if model is None or not read:
        return []
    return [read[a.name] for a in lora.eligible(model, d.gpu_type) if a.name in read]
