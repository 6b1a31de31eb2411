"""Probed node facts: typed records of what each node runs, and how they override the inventory."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AliasChoices, Field

from fleetctl.base import documents
from fleetctl.base.limits import MAX_GPUS_PER_NODE
from fleetctl.fleet.inventory import Inventory, NetworkSpec
from fleetctl.model.catalog import Catalog

# 1: the untyped dicts of the first probe; 2: the same keys, read through these types. A
# format-1 file reads as format 2 (no key changed meaning), so probing again is never forced.
FACTS_FORMAT = 2
READS_FORMATS = (1, 2)


@dataclass(frozen=True)
class GpuProcess:
    pid: int | None
    used_memory_mib: int | None = None
    process_name: str | None = None  # NVML gives no name; nvidia-smi does


# What a probe can find: GPU indices a node may have, no negative size. A facts file out of
# these bounds was edited, and is refused rather than planned on.
_GpuIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)]
_Mib = Annotated[int, Field(ge=0)]


@dataclass(frozen=True)
class GpuFacts:
    index: _GpuIndex | None
    name: str | None = None
    uuid: str | None = None
    memory_total_mib: _Mib | None = None
    memory_used_mib: _Mib | None = None
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

    kind: str = "error"
    # Written as `detail` (the README's {kind, detail, where, line}); nvidia-smi's problems
    # were written as `message` before, and still read.
    message: Annotated[
        str, Field(validation_alias=AliasChoices("detail", "message"), serialization_alias="detail")
    ] = ""
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
    # Its fastest physical NIC that is up (Gb/s), and whether it has RDMA devices
    # (/sys/class/infiniband); None: not said (and facts from before they were read).
    network_gbps: float | None = None
    rdma: bool | None = None

    @property
    def reached(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        # A node's facts list what was learned: a field not known (no error, no GPU driver) is
        # absent, as readers (`jq 'has("error")'`, older fleetctl) expect.
        out: dict[str, Any] = documents.data(self, omit_unknown=True)
        return out

    def version(self, what: str) -> str | None:
        """A version a node class should agree on: driver_version, cuda_version or vllm."""
        value = getattr(self, what)
        return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Facts:
    nodes: dict[str, NodeFacts] = field(default_factory=dict)
    probed_at: str | None = None
    inventory: str | None = None

    def to_json(self) -> dict[str, Any]:
        return documents.dump(self, FACTS_FORMAT, omit_unknown=True)

    @classmethod
    def from_json(cls, raw: object) -> Facts:
        """Facts from a parsed document; DocumentError names the field that is wrong."""
        return documents.parse(raw, cls, reads=READS_FORMATS, default_format=1)


# --- what the planner takes from them ------------------------------------------------------------


def apply_facts(inv: Inventory, facts: Facts, catalog: Catalog) -> tuple[Inventory, list[str]]:
    """Probed GPUs win over declared ones; every disagreement becomes a warning."""
    warnings: list[str] = []
    nodes = []
    for node in inv.nodes:
        probed = facts.nodes.get(node.name)
        if probed is not None and node.network is None and probed.network_gbps:
            # The inventory's network wins; else what the node's NICs say.
            network = NetworkSpec(gbps=probed.network_gbps, rdma=bool(probed.rdma))
            node = dataclasses.replace(node, network=network)
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
