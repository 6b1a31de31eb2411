"""Each model's workload derived from its traffic (`plan --workload-from`), and its requests
read from a trace at their own times (what-if, the gate, the cost plan's SLO check)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fleetctl.base.errors import Location, UserError
from fleetctl.fleet.inventory import Inventory
from fleetctl.sim.workload import (
    WorkItem,
    derive_workload,
    length_buckets,
    load_trace,
    trace_files,
    workload_spec,
)

# Length buckets per model derived from traffic: 2 prompt-length halves x 2 output-length
# halves, what the cost objective sizes separately (sim/workload.py length_buckets).
BUCKETS = 4


def workloads_from(
    inv: Inventory, path: Path, buckets: int = BUCKETS
) -> tuple[Inventory, dict[str, dict[str, Any]]]:
    """`inv` with each model's workload derived from the traffic at `path`, where it has any,
    split into at most `buckets` length buckets (objective cost sizes each apart; 0 or 1:
    the mean request only), and the workloads as `plan --json` shows them (`source`: log or
    inventory)."""
    need_model_names(inv, path)
    long_tokens = inv.spec.router.long_context_tokens
    models = []
    shown: dict[str, dict[str, Any]] = {}
    for m in inv.models:
        items = load_trace(path, m.name)
        derived = derive_workload(items, long_tokens)
        w = m.spec.workload
        if derived is None:
            shown[m.name] = {
                "requests_per_s": w.requests_per_s if w else None,
                "mean_prompt_tokens": w.mean_prompt_tokens if w else None,
                "mean_output_tokens": w.mean_output_tokens if w else None,
                "source": "inventory",
            }
            models.append(m)
            continue
        spec = workload_spec(derived, length_buckets(items, buckets))
        shown[m.name] = {**derived.to_json(), "source": "log"}
        shown[m.name]["buckets"] = [b.model_dump() for b in spec.buckets]
        if w is not None:
            shown[m.name]["inventory"] = w.model_dump(exclude=set() if w.buckets else {"buckets"})
        models.append(dataclasses.replace(m, spec=m.spec.model_copy(update={"workload": spec})))
    return dataclasses.replace(inv, models=tuple(models)), shown


def traces_from(inv: Inventory, path: Path) -> dict[str, list[WorkItem]]:
    """Each inventory model's requests in the traffic at `path`, at the trace's own times
    (`plan --what-if`, `apply --gate`, and the cost plan's SLO check)."""
    need_model_names(inv, path)
    if not inv.models:
        raise UserError(
            "the inventory serves no model", Location(str(inv.path)), "add one under models:"
        )
    traffic = {m.name: load_trace(path, m.name) for m in inv.models}
    if not any(traffic.values()):
        names = ", ".join(m.name for m in inv.models)
        raise UserError(
            f"the trace has no request for the inventory's models ({names})",
            Location(str(path)),
            "give a trace or request log of this fleet's traffic",
        )
    return traffic


def need_model_names(inv: Inventory, path: Path) -> None:
    """A trace whose rows name no model (Azure, Mooncake) is one model's: the inventory's
    only; refuse it for a fleet of several."""
    if len(inv.models) > 1 and not _names_models(path):
        raise UserError(
            "this trace does not say which model each request was for",
            Location(str(path)),
            "give route-serve's request log, or an inventory with one model",
        )


def _names_models(path: Path) -> bool:
    """Whether the trace's rows name their model (route-serve's log does; the public
    traces do not): its first row, read from the first file."""
    try:
        with trace_files(path)[0].open(encoding="utf-8") as f:
            line = f.readline()
        return "model" in json.loads(line)
    except (OSError, ValueError, TypeError, UserError):
        return False
