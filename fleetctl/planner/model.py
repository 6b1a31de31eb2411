"""The Plan: deployments on concrete GPUs, models that could not be placed, warnings, actions."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Op = Literal["create", "replace", "delete", "keep"]

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Deployment:
    """One vLLM server: a model variant on a tensor-parallel group of GPUs of one node."""

    node: str
    host: str
    gpu_type: str
    gpu_indices: tuple[int, ...]
    model: str
    variant: str
    source: str
    tensor_parallel_size: int
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_budget_bytes: int
    kv_budget_tokens: int
    max_sequences_at_max_len: int
    weights_bytes: int
    port: int
    vllm_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    predicted_decode_tok_s: float
    capacity_rps: float
    reasons: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """Identity of a deployment slot: the node and the GPUs it holds."""
        return (self.node, self.gpu_indices)

    @property
    def args_hash(self) -> str:
        """Hash of everything that, if changed, needs the server restarted."""
        blob = json.dumps([self.vllm_args, self.env], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_indices"] = list(self.gpu_indices)
        d["vllm_args"] = list(self.vllm_args)
        d["env"] = dict(self.env)
        d["reasons"] = list(self.reasons)
        d["predicted_decode_tok_s"] = round(self.predicted_decode_tok_s, 1)
        d["capacity_rps"] = round(self.capacity_rps, 3)
        d["args_hash"] = self.args_hash
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Deployment:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["gpu_indices"] = tuple(d["gpu_indices"])
        fields["vllm_args"] = tuple(d["vllm_args"])
        fields["env"] = tuple(sorted(dict(d.get("env", {})).items()))
        fields["reasons"] = tuple(d.get("reasons", ()))
        return cls(**fields)


@dataclass(frozen=True)
class Unplaced:
    model: str
    reason: str


@dataclass(frozen=True)
class Action:
    op: Op
    node: str
    gpu_indices: tuple[int, ...]
    model: str
    variant: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_indices"] = list(self.gpu_indices)
        return d


@dataclass(frozen=True)
class ModelSummary:
    """Planned capacity against the workload, per model."""

    model: str
    replicas: int
    gpus: int
    capacity_rps: float
    demand_rps: float | None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["capacity_rps"] = round(self.capacity_rps, 3)
        return d


@dataclass(frozen=True)
class Plan:
    inventory: str
    deployments: tuple[Deployment, ...]
    unplaced: tuple[Unplaced, ...]
    warnings: tuple[str, ...]
    actions: tuple[Action, ...]
    models: tuple[ModelSummary, ...]
    state_serial: int | None = None
    solver: dict[str, Any] = field(default_factory=dict)

    @property
    def changes(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.op != "keep")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "inventory": self.inventory,
            "state_serial": self.state_serial,
            "deployments": [d.to_json() for d in self.deployments],
            "unplaced": [asdict(u) for u in self.unplaced],
            "warnings": list(self.warnings),
            "actions": [a.to_json() for a in self.actions],
            "models": [m.to_json() for m in self.models],
            "solver": self.solver,
        }
