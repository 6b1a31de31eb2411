"""The inventory: YAML schema, node-range expansion, and cross-checks against the profiles."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from fleetctl.catalog import Catalog, FormatProfile, GpuProfile, ModelProfile
from fleetctl.errors import UserError
from fleetctl.validation import Strict, validate
from fleetctl.yamlsrc import Source, load_yaml

# --- the schema, as written in YAML ------------------------------------------------------------


class SshSpec(Strict):
    user: str | None = None
    identity_file: str | None = None
    port: int = Field(22, ge=1, le=65535)
    proxy_jump: str | None = None
    connect_timeout_s: float = Field(10.0, gt=0)


class GpuSpec(Strict):
    type: str = Field(min_length=1)
    count: int = Field(1, ge=1, le=64)


class NodeSpec(Strict):
    name: str = Field(min_length=1)
    host: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    user: str | None = None
    gpus: GpuSpec
    labels: dict[str, str] = Field(default_factory=dict)


class VariantSpec(Strict):
    source: str = Field(min_length=1)
    revision: str | None = None


class WorkloadSpec(Strict):
    requests_per_s: float = Field(gt=0)
    mean_prompt_tokens: int = Field(gt=0)
    mean_output_tokens: int = Field(gt=0)


class PlacementSpec(Strict):
    gpu_types: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)


class ModelSpec(Strict):
    name: str = Field(min_length=1)
    profile: str = Field(min_length=1)
    variants: dict[str, VariantSpec | None] = Field(min_length=1)
    max_context: int = Field(gt=0)
    workload: WorkloadSpec | None = None
    min_replicas: int = Field(1, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    min_sequences: int = Field(1, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0.1, le=0.99)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    vllm_args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _served_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:/-]*", v):
            raise ValueError(
                f"model name {v!r} is not a valid served model name | "
                "use letters, digits, '.', '_', '-', ':' or '/'"
            )
        return v


class AgingSpec(Strict):
    factor: float = Field(2.0, gt=0)
    window_s: float = Field(60.0, gt=0)
    enabled: bool = True


class RouterSpec(Strict):
    listen: str = "127.0.0.1:8080"
    long_context_tokens: int = Field(4096, gt=0)
    bandwidth_saturation: float = Field(0.85, gt=0, le=1)
    aging: AgingSpec = Field(default_factory=AgingSpec)
    # Port of a dcgm-exporter on every node (usually 9400): the router then reads each GPU's
    # DCGM_FI_DEV_MEM_COPY_UTIL for memory-bandwidth saturation.
    dcgm_exporter_port: int | None = Field(None, ge=1, le=65535)

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen address {v!r} is not HOST:PORT | write e.g. 127.0.0.1:8080")
        return v


class PlannerSpec(Strict):
    gpu_memory_utilization: float = Field(0.92, gt=0.1, le=0.99)
    target_utilization: float = Field(0.8, gt=0, le=1)
    warn_sequences_below: int = Field(8, ge=1)
    port_base: int = Field(8000, ge=1024, le=65000)
    max_num_batched_tokens: int = Field(8192, ge=256)
    enforce_eager: bool = False


class ApplySpec(Strict):
    """How `fleetctl apply` runs servers on the nodes."""

    vllm_command: str = Field("vllm", min_length=1)  # e.g. /opt/vllm/bin/vllm
    supervisor: Literal["auto", "systemd", "nohup"] = "auto"
    health_timeout_s: float = Field(900.0, gt=0)  # large checkpoints load for minutes
    stop_timeout_s: int = Field(30, ge=1)
    # Names of secrets (e.g. HF_TOKEN, VLLM_API_KEY) every server gets in its 0600 env file;
    # values come from the operator's environment or `--secrets-file`, never from here.
    secrets: list[str] = Field(default_factory=list)

    @field_validator("secrets")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(
                    f"{name!r} is not an environment variable name | list names only, "
                    "e.g. [HF_TOKEN]; values come from the environment or --secrets-file"
                )
        return v


class InventorySpec(Strict):
    ssh: SshSpec = Field(default_factory=SshSpec)
    nodes: list[NodeSpec] = Field(min_length=1)
    models: list[ModelSpec] = Field(default_factory=list)
    router: RouterSpec = Field(default_factory=RouterSpec)
    planner: PlannerSpec = Field(default_factory=PlannerSpec)
    apply: ApplySpec = Field(default_factory=ApplySpec)


# --- the loaded inventory, with ranges expanded and names resolved ----------------------------


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    port: int
    user: str | None
    gpu: GpuProfile
    gpu_count: int
    labels: tuple[tuple[str, str], ...]
    line: int | None = None


@dataclass(frozen=True)
class Variant:
    format: FormatProfile
    source: str
    revision: str | None


@dataclass(frozen=True)
class Model:
    spec: ModelSpec
    profile: ModelProfile
    variants: tuple[Variant, ...]
    gpu_types: tuple[str, ...]  # canonical names of allowed GPU types; empty means any

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Inventory:
    path: Path
    spec: InventorySpec
    nodes: tuple[Node, ...]
    models: tuple[Model, ...]

    @property
    def state_dir(self) -> Path:
        return self.path.parent / ".fleetctl"

    def model(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)


_RANGE = re.compile(r"\[(\d+):(\d+)\]")
_MALFORMED = "{!r} has a malformed range | write a range as [FIRST:LAST], e.g. [1:8]"


def expand_range(text: str) -> list[str]:
    """`rtx-[1:8]` -> rtx-1 .. rtx-8; `[01:10]` keeps the zero padding; no range -> [text]."""
    matches = list(_RANGE.finditer(text))
    if not matches:
        if "[" in text or "]" in text:
            raise ValueError(
                f"{text!r} has a malformed range | write a range as [FIRST:LAST], e.g. [1:8]"
            )
        return [text]
    if len(matches) > 1:
        raise ValueError(f"{text!r} has more than one range | use one [FIRST:LAST] range per value")
    m = matches[0]
    first, last = int(m.group(1)), int(m.group(2))
    if last < first:
        raise ValueError(
            f"range [{m.group(1)}:{m.group(2)}] runs backwards | write [{last}:{first}]"
        )
    if last - first >= 100_000:
        raise ValueError(f"range [{first}:{last}] is too large | split it into ranges under 100000")
    width = len(m.group(1)) if m.group(1).startswith("0") and len(m.group(1)) > 1 else 0
    rest = text[m.end() :]
    if "[" in rest or "]" in rest or "[" in text[: m.start()] or "]" in text[: m.start()]:
        raise ValueError(
            f"{text!r} has a malformed range | write a range as [FIRST:LAST], e.g. [1:8]"
        )
    return [f"{text[: m.start()]}{i:0{width}d}{rest}" for i in range(first, last + 1)]


def load_inventory(path: str | Path, catalog: Catalog) -> Inventory:
    """Read, validate and resolve an inventory; any mistake is a UserError with file and line."""
    src = load_yaml(path, "inventory")
    if not isinstance(src.data, dict):
        raise UserError(
            "the inventory must be a mapping with 'nodes' and 'models'",
            src.at(()),
            "see the examples that `fleetctl examples` lists",
        )
    spec = validate(InventorySpec, src)
    nodes = _expand_nodes(spec, src, catalog)
    models = _resolve_models(spec, src, catalog)
    return Inventory(Path(path), spec, nodes, models)


def _expand_nodes(spec: InventorySpec, src: Source, catalog: Catalog) -> tuple[Node, ...]:
    out: list[Node] = []
    by_name: dict[str, int] = {}
    by_addr: dict[tuple[str, int], str] = {}
    for i, ns in enumerate(spec.nodes):
        gpu = catalog.gpu(ns.gpus.type, src.at(("nodes", i, "gpus", "type")))
        names = _expand(ns.name, src, ("nodes", i, "name"))
        hosts = _expand(ns.host, src, ("nodes", i, "host")) if ns.host else names
        if len(hosts) != len(names):
            raise UserError(
                f"name expands to {len(names)} node(s) but host to {len(hosts)}",
                src.at(("nodes", i, "host")),
                "give host a range of the same length as name",
            )
        port = ns.port or spec.ssh.port
        line = src.line_of(("nodes", i))
        labels = tuple(sorted(ns.labels.items()))
        for name, host in zip(names, hosts, strict=True):
            if name in by_name:
                raise UserError(
                    f"duplicate node name '{name}' (first defined in nodes[{by_name[name]}])",
                    src.at(("nodes", i, "name")),
                    "give every node a unique name",
                )
            addr = (host, port)
            if addr in by_addr:
                raise UserError(
                    f"duplicate address {host}:{port} (also node '{by_addr[addr]}')",
                    src.at(("nodes", i, "host")),
                    "give every node its own host or SSH port",
                )
            by_name[name] = i
            by_addr[addr] = name
            out.append(
                Node(name, host, port, ns.user or spec.ssh.user, gpu, ns.gpus.count, labels, line)
            )
    return tuple(out)


def _expand(value: str, src: Source, path: tuple[Any, ...]) -> list[str]:
    try:
        return expand_range(value)
    except ValueError as e:
        what, _, fix = str(e).partition(" | ")
        raise UserError(what, src.at(path), fix) from None


def _resolve_models(spec: InventorySpec, src: Source, catalog: Catalog) -> tuple[Model, ...]:
    out: list[Model] = []
    seen: dict[str, int] = {}
    for i, ms in enumerate(spec.models):
        at = ("models", i)
        if ms.name in seen:
            raise UserError(
                f"duplicate model name '{ms.name}' (first in models[{seen[ms.name]}])",
                src.at((*at, "name")),
                "served model names must be unique",
            )
        seen[ms.name] = i
        profile = catalog.model(ms.profile, src.at((*at, "profile")))
        if ms.max_context > profile.max_context:
            raise UserError(
                f"max_context {ms.max_context} exceeds {profile.name}'s {profile.max_context}",
                src.at((*at, "max_context")),
                f"lower it to at most {profile.max_context}, or use a longer-context model profile",
            )
        if ms.max_replicas is not None and ms.max_replicas < ms.min_replicas:
            raise UserError(
                f"max_replicas {ms.max_replicas} is below min_replicas {ms.min_replicas}",
                src.at((*at, "max_replicas")),
                "raise max_replicas or lower min_replicas",
            )
        variants = []
        for fmt_name, vs in ms.variants.items():
            vat = (*at, "variants", fmt_name)
            fmt = catalog.format(fmt_name, src.at(vat))
            if vs is None:
                raise UserError(
                    f"variant '{fmt_name}' has no source",
                    src.at(vat),
                    "add 'source: <Hugging Face id or path>' to it",
                )
            variants.append(Variant(fmt, vs.source, vs.revision))
        gpu_types = tuple(
            catalog.gpu(t, src.at((*at, "placement", "gpu_types", j))).name
            for j, t in enumerate(ms.placement.gpu_types)
        )
        out.append(Model(ms, profile, tuple(variants), gpu_types))
    return tuple(out)
