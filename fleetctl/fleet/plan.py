"""The Plan: deployments on concrete GPUs, models that could not be placed, warnings, actions."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field

# A replacement that fits beside the server it replaces starts on the slot's other port
# (port +/- SURGE_PORT_OFFSET), so both run until the new one is healthy (apply/steps.py);
# base/limits.py holds it because validation checks every such port exists.
from fleetctl.base import documents, names
from fleetctl.base.errors import shown
from fleetctl.base.limits import MAX_GPUS_PER_NODE
from fleetctl.base.names import http_url
from fleetctl.fleet.prices import per_million_tokens, total
from fleetctl.fleet.slo import Slo, SloRecord

Op = Literal["create", "replace", "delete", "keep"]
# What a server does: both phases of a request (colocated), or one of them (disaggregated).
Role = Literal["both", "prefill", "decode"]


def fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields, shallow: dataclasses.asdict deep-copies and is 10x slower."""
    return {f: getattr(obj, f) for f in obj.__dataclass_fields__}


PLAN_FORMAT = 1


@dataclass(frozen=True)
class KvEvents:
    """A server's --kv-events-config, from its own port (the inventory's
    router.prefix_cache): vLLM's ZMQ publisher binds tcp://*:(port + events_offset), on
    every interface (vLLM binds only so), and its replay socket tcp://*:(port +
    replay_offset). route-serve connects to both at the server's host."""

    events_offset: int
    replay_offset: int | None
    topic: str

    def args(self, port: int) -> tuple[str, ...]:
        config: dict[str, Any] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port + self.events_offset}",
        }
        if self.replay_offset is not None:
            config["replay_endpoint"] = f"tcp://*:{port + self.replay_offset}"
        config["topic"] = self.topic
        # No spaces: one word in ps output, as `status` compares a foreign server's flags.
        return ("--kv-events-config", json.dumps(config, separators=(",", ":")))


@dataclass(frozen=True)
class KvTransfer:
    """A disaggregated server's --kv-transfer-config (vLLM's), and NIXL's side channel: a
    ZMQ socket on the node's address at the server's port + `side_channel_offset`, through
    which a decode server asks the prefill server where the KV cache is."""

    role: Role
    connector: str
    side_channel_offset: int | None = None  # NIXL's; None for connectors without one
    buffer_device: str | None = None  # None: the platform's (GPU memory on a GPU)
    shared_storage_path: str | None = None  # ExampleConnector's folder, shared by both

    def args(self) -> tuple[str, ...]:
        config: dict[str, Any] = {"kv_connector": self.connector}
        if self.connector == "NixlConnector":
            # vLLM 0.32 deprecates kv_both for NIXL: the producer prefills, the consumer
            # decodes (each request's kv_transfer_params say which it does).
            config["kv_role"] = "kv_producer" if self.role == "prefill" else "kv_consumer"
        else:
            config["kv_role"] = "kv_both"
        if self.buffer_device is not None:
            config["kv_buffer_device"] = self.buffer_device
        if self.shared_storage_path is not None:
            config["kv_connector_extra_config"] = {"shared_storage_path": self.shared_storage_path}
        return ("--kv-transfer-config", json.dumps(config, separators=(",", ":")))

    def env(self, host: str, port: int) -> tuple[tuple[str, str], ...]:
        """NIXL's side channel: the address it binds is the one it tells decode servers."""
        if self.side_channel_offset is None:
            return ()
        return (
            ("VLLM_NIXL_SIDE_CHANNEL_HOST", host),
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port + self.side_channel_offset)),
        )


@dataclass(frozen=True)
class Server:
    """What one vLLM server runs and what the model predicts for it: shared by every replica
    of the same candidate, so a plan for 10,000 nodes stores each of these once."""

    model: str
    variant: str
    source: str
    gpu_type: str
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
    predicted_decode_tok_s: float
    capacity_rps: float
    reasons: tuple[str, ...]
    args_head: tuple[str, ...]  # `vllm serve` arguments before --host/--port
    args_tail: tuple[str, ...]  # and after
    env: tuple[tuple[str, str], ...]  # besides CUDA_VISIBLE_DEVICES
    # Why max_model_len is what it is: "131072 = max_context", or with the model's
    # min_context the KV budget that made it shorter. Not a flag: it never restarts a server.
    max_model_len_reason: str = ""
    # Its KV events' ports follow each deployment's port, so they are added per deployment
    # (at the end of its arguments); a Server read back from state has them in args_tail.
    kv_events: KvEvents | None = None
    # Its GPUs' share of its node's price per hour (fleetctl/fleet/prices.py); None: no price known.
    # Not a flag either; state written before fleetctl knew prices has none.
    cost_per_hour: float | None = None
    # What the one calibrated model says of it at the reference shapes (KV tokens, decode
    # tokens/s at batch 1, 8 and 32, prefill tokens/s, the source of each), as estimate,
    # simulate and status print them: fleetctl.model.calibration.Calibrated.figures.
    perf: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    role: Role = "both"
    # Its KV transfer's side channel follows each deployment's address and port, so it is
    # added to the environment per deployment; a Server read back from state has it in env.
    kv_transfer: KvTransfer | None = None


@dataclass(frozen=True, slots=True)
class Deployment:
    """One vLLM server: a Server on a tensor-parallel group of GPUs of one node."""

    node: str
    host: str
    gpu_indices: tuple[int, ...]
    port: int
    server: Server

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """Identity of a deployment slot: the node and the GPUs it holds."""
        return (self.node, self.gpu_indices)

    @property
    def model(self) -> str:
        return self.server.model

    @property
    def variant(self) -> str:
        return self.server.variant

    @property
    def gpu_type(self) -> str:
        return self.server.gpu_type

    @property
    def tensor_parallel_size(self) -> int:
        return self.server.tensor_parallel_size

    @property
    def capacity_rps(self) -> float:
        return self.server.capacity_rps

    def url(self, path: str = "") -> str:
        """Where the server answers HTTP, as the router and health checks reach it."""
        return http_url(self.host, self.port, path)

    @property
    def vllm_args(self) -> tuple[str, ...]:
        s = self.server
        kv = s.kv_events.args(self.port) if s.kv_events is not None else ()
        return (*s.args_head, "--host", self.host, "--port", str(self.port), *s.args_tail, *kv)

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        devices = ("CUDA_VISIBLE_DEVICES", ",".join(map(str, self.gpu_indices)))
        kv = self.server.kv_transfer
        side = kv.env(self.host, self.port) if kv is not None else ()
        return tuple(sorted((devices, *self.server.env, *side)))

    @property
    def args_hash(self) -> str:
        """Hash of everything that, if changed, needs the server restarted."""
        parts = [*self.vllm_args, "\0env", *(f"{k}={v}" for k, v in self.env)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]

    def record(self) -> DeploymentRecord:
        """This deployment as the files hold it."""
        s = self.server
        return DeploymentRecord(
            node=self.node,
            host=self.host,
            gpu_type=s.gpu_type,
            gpu_indices=self.gpu_indices,
            model=s.model,
            variant=s.variant,
            role=s.role,
            source=s.source,
            tensor_parallel_size=s.tensor_parallel_size,
            max_model_len=s.max_model_len,
            max_model_len_reason=s.max_model_len_reason,
            gpu_memory_utilization=s.gpu_memory_utilization,
            kv_cache_dtype=s.kv_cache_dtype,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            kv_budget_bytes=s.kv_budget_bytes,
            kv_budget_tokens=s.kv_budget_tokens,
            max_sequences_at_max_len=s.max_sequences_at_max_len,
            weights_bytes=s.weights_bytes,
            port=self.port,
            vllm_args=self.vllm_args,
            env=dict(self.env),
            predicted_decode_tok_s=round(s.predicted_decode_tok_s, 1),
            capacity_rps=round(s.capacity_rps, 3),
            cost_per_hour=_money(s.cost_per_hour),
            perf=s.perf,
            reasons=s.reasons,
            args_hash=self.args_hash,
        )

    @classmethod
    def of(cls, r: DeploymentRecord) -> Deployment:
        """The deployment a record describes (as state.json or a saved plan holds it)."""
        # Split the arguments around --host/--port, as the planner builds them.
        args = r.vllm_args
        host_at, port_at = args.index("--host"), args.index("--port")
        server = Server(
            model=r.model,
            variant=r.variant,
            source=r.source,
            gpu_type=r.gpu_type,
            tensor_parallel_size=r.tensor_parallel_size,
            max_model_len=r.max_model_len,
            gpu_memory_utilization=r.gpu_memory_utilization,
            kv_cache_dtype=r.kv_cache_dtype,
            max_num_batched_tokens=r.max_num_batched_tokens,
            max_num_seqs=r.max_num_seqs,
            kv_budget_bytes=r.kv_budget_bytes,
            kv_budget_tokens=r.kv_budget_tokens,
            max_sequences_at_max_len=r.max_sequences_at_max_len,
            weights_bytes=r.weights_bytes,
            predicted_decode_tok_s=r.predicted_decode_tok_s,
            capacity_rps=r.capacity_rps,
            reasons=r.reasons,
            args_head=args[:host_at],
            args_tail=args[max(host_at, port_at) + 2 :],
            env=tuple(sorted((k, v) for k, v in r.env.items() if k != "CUDA_VISIBLE_DEVICES")),
            max_model_len_reason=r.max_model_len_reason,
            cost_per_hour=r.cost_per_hour,
            perf=r.perf,
            role=r.role,
        )
        return cls(r.node, r.host, r.gpu_indices, r.port, server)

    def to_json(self) -> dict[str, Any]:
        return documents.data(self.record())

    @classmethod
    def from_json(cls, raw: object) -> Deployment:
        """Raises DocumentError naming the field that is wrong."""
        return cls.of(documents.parse_part(raw, DeploymentRecord))


def _text(value: str) -> str:
    """A word of a command line or an environment value: no control character, so none
    reaches the node's shell or unit file from an edited file."""
    bad = names.control_char(value)
    if bad is not None:
        raise ValueError(f"{shown(value)} holds the control character {ord(bad):#04x}")
    return value


# A file's fields checked with the inventory's own grammars (base/names.py): a saved plan or
# state.json is a file anyone could have edited, and what it names reaches SSH, a shell and URLs.
_Node = Annotated[str, AfterValidator(names.name)]
_Host = Annotated[str, AfterValidator(names.host)]
_Model = Annotated[str, AfterValidator(names.model_name)]
_Variant = Annotated[str, AfterValidator(lambda v: names.name(v, "variant"))]
_Source = Annotated[str, AfterValidator(names.source)]
_EnvKey = Annotated[str, AfterValidator(names.env_key)]
_Text = Annotated[str, AfterValidator(_text)]
_Port = Annotated[int, Field(ge=1, le=65535)]
_GpuIndex = Annotated[int, Field(ge=0, lt=MAX_GPUS_PER_NODE)]
_Count = Annotated[int, Field(ge=1)]
_Size = Annotated[int, Field(ge=0)]


@dataclass(frozen=True, kw_only=True)
class DeploymentRecord:
    """One deployment as `plan --json`, a saved plan and state.json hold it: its server's
    fields inline, its whole `vllm serve` command line and environment, and their hash."""

    node: _Node
    host: _Host
    gpu_type: _Text
    gpu_indices: Annotated[tuple[_GpuIndex, ...], Field(min_length=1)]
    model: _Model
    variant: _Variant
    role: Role = "both"  # absent from plans and state written before disaggregated serving
    source: _Source
    tensor_parallel_size: _Count
    max_model_len: _Count
    max_model_len_reason: str = ""
    gpu_memory_utilization: float
    kv_cache_dtype: _Text
    max_num_batched_tokens: _Count
    max_num_seqs: _Count
    kv_budget_bytes: _Size
    kv_budget_tokens: _Size
    max_sequences_at_max_len: _Size
    weights_bytes: _Size
    port: _Port
    vllm_args: tuple[_Text, ...]
    env: dict[_EnvKey, _Text] = field(default_factory=dict)
    predicted_decode_tok_s: float
    capacity_rps: float
    cost_per_hour: float | None = None  # absent from state written before fleetctl knew prices
    perf: dict[str, Any] | None = None
    reasons: tuple[str, ...] = ()
    args_hash: str = ""

    def __post_init__(self) -> None:
        if "--host" not in self.vllm_args or "--port" not in self.vllm_args:
            raise ValueError("vllm_args has no --host or --port")
        if len(set(self.gpu_indices)) != len(self.gpu_indices):
            raise ValueError(f"gpu_indices {list(self.gpu_indices)} name a GPU twice")


@dataclass(frozen=True, kw_only=True)
class SavedPlan:
    """What apply reads back of a plan saved with `plan -o`: where it came from and its
    deployments (the rest of the file is for people)."""

    inventory: str
    state_serial: int | None = None
    deployments: tuple[DeploymentRecord, ...] = ()
    # Each model's SLO, the one it was planned by (absent from plans saved before it was).
    slo: dict[_Model, SloRecord] = field(default_factory=dict)


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
        d = fields_of(self)
        d["gpu_indices"] = list(self.gpu_indices)
        return d


def _money(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass(frozen=True)
class BucketUse:
    """One length bucket of a model's workload (objective cost with `buckets`): its rate
    at the workload's peak, its mean request, and the requests/s each GPU type, format and
    TP size carries of it, as the planner sized them."""

    mean_prompt_tokens: int
    mean_output_tokens: int
    max_tokens: int
    requests_per_s: float
    served_by: tuple[tuple[str, float], ...]  # ("H100-SXM-80GB fp8 TP=1", req/s)

    def to_json(self) -> dict[str, Any]:
        return {
            "mean_prompt_tokens": self.mean_prompt_tokens,
            "mean_output_tokens": self.mean_output_tokens,
            "max_tokens": self.max_tokens,
            "requests_per_s": round(self.requests_per_s, 3),
            "served_by": {k: round(v, 3) for k, v in self.served_by},
        }


@dataclass(frozen=True)
class Disaggregation:
    """The planner's choice for a model's servers, colocated or in prefill and decode pools,
    and the figures it chose by (planner/disaggregate.py): requests/s within the SLO, and a
    request's first token (s) and decode token (ms) at light load, each way."""

    chosen: bool
    reason: str
    colocated_rps: float
    colocated_ttft_s: float
    colocated_tpot_ms: float
    split_rps: float | None = None
    split_ttft_s: float | None = None
    split_tpot_ms: float | None = None
    transfer_s: float | None = None
    prefill_servers: int = 0
    decode_servers: int = 0

    def to_json(self) -> dict[str, Any]:
        d = fields_of(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 4) if math.isfinite(v) else None
        return d


@dataclass(frozen=True)
class LoraUse:
    """LoRA on a model's servers of one GPU type: the slots vLLM is started with, the memory
    they take from each GPU's KV cache, and the adapters loaded at start, most requested
    first (planner/lora.py)."""

    gpu_type: str
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    slot_bytes_per_gpu: int
    kv_tokens_given_up: int  # per server: what the slots' memory would have held of KV
    preloaded: tuple[str, ...]
    runtime_loading: bool

    def to_json(self) -> dict[str, Any]:
        d = fields_of(self)
        d["preloaded"] = list(self.preloaded)
        return d


@dataclass(frozen=True)
class AdapterUse:
    """One LoRA adapter in the plan: where it is loaded at start, its demand, and the
    requests/s its servers serve within its SLO on its own lengths (the promise-keeping
    planner's goodput, as if they served it alone: the base model's traffic shares them)."""

    name: str
    rank: int
    gpu_types: tuple[str, ...]  # pinned to these; empty: any of the model's
    servers: int  # servers that load it at start
    demand_rps: float | None
    capacity_rps: float | None  # None: no workload or SLO of its own, or no server
    capacity_basis: str

    def to_json(self) -> dict[str, Any]:
        d = fields_of(self)
        d["gpu_types"] = list(self.gpu_types)
        if self.capacity_rps is not None:
            d["capacity_rps"] = round(self.capacity_rps, 3)
        return d


@dataclass(frozen=True)
class ModelSummary:
    """Planned capacity against the workload, per model, and what its GPUs cost."""

    model: str
    replicas: int
    gpus: int
    capacity_rps: float
    demand_rps: float | None
    # Workload not covered at the planner's target utilization (None without a workload).
    shortfall_rps: float | None = None
    cost_per_hour: float | None = None  # None: some GPU of it has no price
    # Output tokens/s the cost is spread over: the workload's (what capacity x target
    # utilization covers of it), or capacity x target utilization without a workload.
    output_tokens_per_s: float = 0.0
    # Objective cost with length buckets: which GPUs carry which requests.
    buckets: tuple[BucketUse, ...] = ()
    # Where the planner weighed prefill/decode pools against colocated servers; None where
    # it did not (disaggregation off, or auto with no network known).
    disaggregation: Disaggregation | None = None
    # What capacity_rps is: "goodput" (the rate at which the servers meet the SLO's share on
    # the workload's lengths and bursts), "saturation" (no SLO: the mean request's
    # throughput) or "split" (prefill and decode pools, planner/disaggregate.py); and what
    # the workload left to assume (Poisson arrivals, the mean length).
    capacity_basis: str = "saturation"
    assumed: tuple[str, ...] = ()
    # The SLO it was planned by: stated, else derived once from every candidate server
    # (fleetctl/fleet/slo.py); None where no server could hold the model. Plan.to_json
    # writes it under `slo`.
    slo: Slo | None = None
    # LoRA per GPU type and per adapter; empty for a model without adapters, whose JSON
    # then has neither key (plans without adapters read as before).
    lora: tuple[LoraUse, ...] = ()
    adapters: tuple[AdapterUse, ...] = ()

    @property
    def cost_per_million_output_tokens(self) -> float | None:
        return per_million_tokens(self.cost_per_hour, self.output_tokens_per_s)

    def to_json(self) -> dict[str, Any]:
        d = fields_of(self)
        del d["slo"], d["lora"], d["adapters"]
        if self.adapters:
            d["lora"] = [u.to_json() for u in self.lora]
            d["adapters"] = [a.to_json() for a in self.adapters]
        d["buckets"] = [b.to_json() for b in self.buckets]
        d["disaggregation"] = self.disaggregation.to_json() if self.disaggregation else None
        d["capacity_rps"] = round(self.capacity_rps, 3)
        if self.shortfall_rps is not None:
            d["shortfall_rps"] = round(self.shortfall_rps, 3)
        d["cost_per_hour"] = _money(self.cost_per_hour)
        d["output_tokens_per_s"] = round(self.output_tokens_per_s, 1)
        d["cost_per_million_output_tokens"] = _money(self.cost_per_million_output_tokens)
        return d


@dataclass(frozen=True)
class SloCheck:
    """A model's SLO against the p99 tails the simulator found on the plan
    (fleetctl/whatif/slo_check.py):
    `headroom` is the capacity the planner was asked for over the workload to get there."""

    model: str
    slo_ttft_p99_s: float | None
    slo_tpot_p99_ms: float | None
    ttft_p99_s: float | None  # simulated; None: no request finished
    tpot_p99_ms: float | None
    requests: int
    headroom: float = 1.0
    traffic: str = "synthetic"  # what was simulated: "synthetic" (from the workload) or "trace"

    @property
    def misses(self) -> tuple[str, ...]:
        """Each objective missed, with its simulated figure and by how much."""
        out = []
        for name, got, want, unit in (
            ("TTFT p99", self.ttft_p99_s, self.slo_ttft_p99_s, "s"),
            ("TPOT p99", self.tpot_p99_ms, self.slo_tpot_p99_ms, "ms"),
        ):
            if want is None:
                continue
            if got is None:
                out.append(f"{name}: no request finished (objective {want:g} {unit})")
            elif got > want:
                out.append(
                    f"{name} {got:.3g} {unit} against {want:g} {unit} (+{got / want - 1:.0%})"
                )
        return tuple(out)

    @property
    def met(self) -> bool:
        return not self.misses

    def to_json(self) -> dict[str, Any]:
        d = fields_of(self)
        for k in ("ttft_p99_s", "tpot_p99_ms"):
            d[k] = None if d[k] is None else round(d[k], 4)
        d["headroom"] = round(self.headroom, 3)
        d["met"] = self.met
        d["misses"] = list(self.misses)
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
    objective: str = "throughput"
    # Each SLO model's simulated tails, where the plan was checked (objective cost).
    slo_checks: tuple[SloCheck, ...] = ()

    @property
    def cost_per_hour(self) -> float | None:
        """The price per hour of every GPU a deployment uses; None if any has no price."""
        return total(d.server.cost_per_hour for d in self.deployments)

    @property
    def cost_per_million_output_tokens(self) -> float | None:
        tokens = sum(m.output_tokens_per_s for m in self.models)
        return per_million_tokens(self.cost_per_hour, tokens)

    @property
    def changes(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.op != "keep")

    @property
    def slos(self) -> dict[str, Slo]:
        """Each model's SLO, the one it was planned by (ModelSummary.slo)."""
        return {m.model: m.slo for m in self.models if m.slo is not None}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "inventory": self.inventory,
            "state_serial": self.state_serial,
            "objective": self.objective,
            "cost_per_hour": _money(self.cost_per_hour),
            "cost_per_million_output_tokens": _money(self.cost_per_million_output_tokens),
            "deployments": [d.to_json() for d in self.deployments],
            "unplaced": [fields_of(u) for u in self.unplaced],
            "warnings": list(self.warnings),
            "actions": [a.to_json() for a in self.actions],
            "models": [m.to_json() for m in self.models],
            "slo": {name: slo.to_json() for name, slo in self.slos.items()},
            "slo_checks": [c.to_json() for c in self.slo_checks],
            "solver": self.solver,
        }
