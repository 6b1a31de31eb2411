"""Probed node facts: typed records of what each node runs, and how they override the inventory."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetctl.fleet.inventory import Inventory
from fleetctl.model.catalog import Catalog

# 1: the untyped dicts of the first probe; 2: the same keys, read through these types. A
# format-1 file reads as format 2 (no key changed meaning), so probing again is never forced.
FACTS_FORMAT = 2
READS_FORMATS = (1, 2)


class FactsError(ValueError):
    """A facts document that is not one: the message says which field and why."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int | None
    used_memory_mib: int | None = None
    process_name: str | None = None  # NVML gives no name; nvidia-smi does


@dataclass(frozen=True)
class GpuFacts:
    index: int | None
    name: str | None = None
    uuid: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    compute_cap: str | None = None
    ecc_uncorrected_volatile: int | None = None
    retired_pages_pending: bool | None = None
    processes: tuple[GpuProcess, ...] = ()

    @property
    def identity(self) -> str:
        """What tells this GPU apart across probes: its UUID, else its index."""
        return self.uuid or str(self.index)


@dataclass(frozen=True)
class Problem:
    """Why a node (`NodeFacts.error`) or its GPU driver (`gpu_error`) gave no facts."""

    kind: str
    message: str
    line: str | None = None  # the one line an operator reads: node (address): what: what to do
    where: str | None = None

    @property
    def text(self) -> str:
        return self.line or self.message


@dataclass(frozen=True)
class NodeFacts:
    host: str | None = None
    probed_at: str | None = None
    error: Problem | None = None  # unreachable: nothing else below is known
    hostname: str | None = None
    os: str | None = None
    kernel: str | None = None
    cpus: int | None = None
    mem_total_kib: int | None = None
    disk_free_kib: int | None = None
    # Processes of servers `fleetctl apply` started; None in facts from before apply existed.
    fleetctl_pids: tuple[int, ...] | None = None
    python: str | None = None
    vllm: str | None = None
    gpu_source: str | None = None  # "nvml" or "nvidia-smi"
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: tuple[GpuFacts, ...] = ()
    gpu_error: Problem | None = None
    interconnect: str | None = None  # "nvlink", "pcie", or None below two GPUs

    @property
    def reached(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return _node_json(self)

    def version(self, what: str) -> str | None:
        """A version a node class should agree on: driver_version, cuda_version or vllm."""
        value = getattr(self, what)
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Facts:
    nodes: Mapping[str, NodeFacts] = field(default_factory=dict)
    probed_at: str | None = None
    inventory: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FACTS_FORMAT,
            "probed_at": self.probed_at,
            "inventory": self.inventory,
            "nodes": {name: n.to_json() for name, n in self.nodes.items()},
        }

    @classmethod
    def from_json(cls, raw: object) -> Facts:
        """Facts from a parsed document; FactsError names the field that is wrong."""
        if not isinstance(raw, dict):
            raise FactsError("not a JSON object")
        fmt = raw.get("format", 1)
        if fmt not in READS_FORMATS:
            newer = isinstance(fmt, int) and fmt > FACTS_FORMAT
            raise FactsError(
                f"format {fmt!r} was written by a {'newer' if newer else 'different'} fleetctl "
                f"(this one reads {', '.join(map(str, READS_FORMATS))})"
            )
        nodes = raw.get("nodes")
        if not isinstance(nodes, dict):
            raise FactsError("no 'nodes' mapping")
        return cls(
            nodes={str(k): _node(v, f"nodes.{k}") for k, v in nodes.items()},
            probed_at=_opt(raw, "probed_at", str, ""),
            inventory=_opt(raw, "inventory", str, ""),
        )


# --- JSON in and out ---------------------------------------------------------------------------


def _node_json(n: NodeFacts) -> dict[str, Any]:
    if n.error is not None:  # an unreachable node keeps only where and when it was tried
        error = _problem_json(n.error, "detail")
        return {"host": n.host, "probed_at": n.probed_at, "error": error}
    out = {f.name: getattr(n, f.name) for f in dataclasses.fields(n)}
    out.pop("error")
    out["fleetctl_pids"] = list(n.fleetctl_pids) if n.fleetctl_pids is not None else None
    out["gpus"] = [
        {
            **{f.name: getattr(g, f.name) for f in dataclasses.fields(g)},
            "processes": [dataclasses.asdict(p) for p in g.processes],
        }
        for g in n.gpus
    ]
    out["gpu_error"] = _problem_json(n.gpu_error, "message") if n.gpu_error else None
    return out


def _problem_json(p: Problem, text_key: str) -> dict[str, Any]:
    """A node's error says `detail` (the README's {kind, detail, where, line}); nvidia-smi's
    says `message`, as it always did."""
    out = {"kind": p.kind, text_key: p.message, "where": p.where, "line": p.line}
    return {k: v for k, v in out.items() if v is not None}


def _opt(raw: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = raw.get(key)
    if value is None:
        return None
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise FactsError(f"{where}{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _map(raw: object, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise FactsError(f"{where}: expected an object, got {type(raw).__name__}")
    return raw


def _problem(raw: object, where: str) -> Problem:
    r = _map(raw, where)
    w = where + "."
    message = _opt(r, "message", str, w) or _opt(r, "detail", str, w) or ""
    return Problem(
        kind=_opt(r, "kind", str, w) or "error",
        message=message,
        line=_opt(r, "line", str, w),
        where=_opt(r, "where", str, w),
    )


def _gpu(raw: object, where: str) -> GpuFacts:
    r = _map(raw, where)
    w = where + "."
    procs = r.get("processes") or []
    if not isinstance(procs, list):
        raise FactsError(f"{w}processes: expected a list")
    return GpuFacts(
        index=_opt(r, "index", int, w),
        name=_opt(r, "name", str, w),
        uuid=_opt(r, "uuid", str, w),
        memory_total_mib=_opt(r, "memory_total_mib", int, w),
        memory_used_mib=_opt(r, "memory_used_mib", int, w),
        compute_cap=_opt(r, "compute_cap", str, w),
        ecc_uncorrected_volatile=_opt(r, "ecc_uncorrected_volatile", int, w),
        retired_pages_pending=_opt(r, "retired_pages_pending", bool, w),
        processes=tuple(_process(p, f"{w}processes[{i}]") for i, p in enumerate(procs)),
    )


def _process(raw: object, where: str) -> GpuProcess:
    r = _map(raw, where)
    w = where + "."
    return GpuProcess(
        pid=_opt(r, "pid", int, w),
        used_memory_mib=_opt(r, "used_memory_mib", int, w),
        process_name=_opt(r, "process_name", str, w),
    )


def _node(raw: object, where: str) -> NodeFacts:
    r = _map(raw, where)
    w = where + "."
    gpus = r.get("gpus") or []
    if not isinstance(gpus, list):
        raise FactsError(f"{w}gpus: expected a list")
    pids = r.get("fleetctl_pids")
    if pids is not None and (
        not isinstance(pids, list) or not all(isinstance(p, int) for p in pids)
    ):
        raise FactsError(f"{w}fleetctl_pids: expected a list of process ids")
    return NodeFacts(
        host=_opt(r, "host", str, w),
        probed_at=_opt(r, "probed_at", str, w),
        error=_problem(r["error"], w + "error") if r.get("error") else None,
        hostname=_opt(r, "hostname", str, w),
        os=_opt(r, "os", str, w),
        kernel=_opt(r, "kernel", str, w),
        cpus=_opt(r, "cpus", int, w),
        mem_total_kib=_opt(r, "mem_total_kib", int, w),
        disk_free_kib=_opt(r, "disk_free_kib", int, w),
        fleetctl_pids=tuple(pids) if pids is not None else None,
        python=_opt(r, "python", str, w),
        vllm=_opt(r, "vllm", str, w),
        gpu_source=_opt(r, "gpu_source", str, w),
        driver_version=_opt(r, "driver_version", str, w),
        cuda_version=_opt(r, "cuda_version", str, w),
        gpus=tuple(_gpu(g, f"{w}gpus[{i}]") for i, g in enumerate(gpus)),
        gpu_error=_problem(r["gpu_error"], w + "gpu_error") if r.get("gpu_error") else None,
        interconnect=_opt(r, "interconnect", str, w),
    )


# --- what the planner takes from them ------------------------------------------------------------


def apply_facts(inv: Inventory, facts: Facts, catalog: Catalog) -> tuple[Inventory, list[str]]:
    """Probed GPUs win over declared ones; every disagreement becomes a warning."""
    warnings: list[str] = []
    nodes = []
    for node in inv.nodes:
        probed = facts.nodes.get(node.name)
        if probed is None or not probed.gpus:
            nodes.append(node)
            continue
        names = Counter(g.name or "" for g in probed.gpus)
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
