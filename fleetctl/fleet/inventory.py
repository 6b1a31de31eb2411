"""The inventory: YAML schema, node-range expansion, and cross-checks against the profiles.

Kept whole because the schema, its range expansion and its cross-checks read top-down as the one
definition of the file; split, a field's bounds and its check would live apart.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, field_validator

from fleetctl.base import names
from fleetctl.base.errors import UserError, shown, what_and_fix
from fleetctl.base.limits import (
    MAX_ADAPTERS,
    MAX_CONNECT_TIMEOUT_S,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    MAX_HOST,
    MAX_MODEL_NAME,
    MAX_MODELS,
    MAX_NAME,
    MAX_NETWORK_GBPS,
    MAX_NODES,
    MAX_RATE,
    MAX_REPLICAS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    MAX_USER,
    SURGE_PORT_OFFSET,
)
from fleetctl.base.text import plural
from fleetctl.base.validation import Strict, validate
from fleetctl.base.yamlsrc import Source, load_yaml
from fleetctl.model.catalog import Catalog, FormatProfile, GpuProfile, ModelProfile
from fleetctl.vllm.flags import LORA_PINNED, check_args

# --- the schema, as written in YAML ------------------------------------------------------------

# Variables fleetctl sets in every server's environment itself.
RESERVED_ENV = {
    "CUDA_VISIBLE_DEVICES": "the plan picks each server's GPUs: limit them with 'placement'",
    "FLEETCTL_SERVER_TOKEN": "apply sets it to find the server's processes: remove it",
}


def _env_key(key: str) -> str:
    names.env_key(key)
    if key in RESERVED_ENV:
        raise ValueError(f"{key} is set by fleetctl | {RESERVED_ENV[key]}")
    return key


def _variant(key: str) -> str:
    return names.name(key, "variant")


def _schema_max(length: int, description: str | None = None) -> Any:
    """The longest value a validator of base/names.py takes, as the schema (and so the
    generated reference) shows it: the schema alone would say the bound of any text."""
    return Field(json_schema_extra={"maxLength": length}, description=description)


User = Annotated[str, AfterValidator(names.user), _schema_max(MAX_USER)]
Labels = dict[
    Annotated[str, AfterValidator(lambda v: names.name(v, "label"))],
    Annotated[str, AfterValidator(lambda v: names.name(v, "label value"))],
]


class SshSpec(Strict):
    user: User | None = None
    identity_file: str | None = None
    port: int = Field(22, ge=1, le=65535)
    proxy_jump: str | None = None
    connect_timeout_s: float = Field(10.0, gt=0, le=MAX_CONNECT_TIMEOUT_S)

    @field_validator("proxy_jump")
    @classmethod
    def _jump(cls, v: str | None) -> str | None:
        if v is not None:
            names.jump(v)  # parsed now, so a bad hop fails here and not after confirmation
        return v


class GpuSpec(Strict):
    type: str = Field(min_length=1, max_length=MAX_NAME * 2)
    count: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE)


class NetworkSpec(Strict):
    """The node's network for moving KV caches between servers (disaggregated serving)."""

    gbps: float = Field(gt=0, le=MAX_NETWORK_GBPS)  # the NIC's line rate, Gb/s
    rdma: bool = False  # RoCE or InfiniBand: transfers bypass the kernel's TCP stack


class NodeSpec(Strict):
    # A name or a range, checked once expanded; a host likewise.
    name: Annotated[
        str, Field(min_length=1), _schema_max(MAX_NAME, "each name once a range is expanded")
    ]
    host: Annotated[str, _schema_max(MAX_HOST)] | None = None
    port: int | None = Field(None, ge=1, le=65535)
    user: User | None = None
    gpus: GpuSpec
    labels: Labels = Field(default_factory=dict)
    # The price of one node of this entry (all its GPUs) per hour, in the fleet's currency;
    # null: gpus.count x the GPU profile's cost_per_hour, if it has one (fleetctl/fleet/prices.py).
    cost_per_hour: float | None = Field(None, ge=0, le=1e6)
    # null: what `fleetctl probe` read (/sys/class/net/*/speed, /sys/class/infiniband), else
    # unknown, and the planner keeps such a node's servers colocated.
    network: NetworkSpec | None = None


class VariantSpec(Strict):
    source: Annotated[str, Field(min_length=1), AfterValidator(names.source)]
    revision: Annotated[str, AfterValidator(names.revision)] | None = None


class BucketSpec(Strict):
    """One slice of a workload's requests by length (`plan --workload-from` derives them):
    its share of the requests, their mean lengths and the longest one (prompt + output)."""

    share: float = Field(gt=0, le=1)
    mean_prompt_tokens: int = Field(gt=0, le=MAX_TOKENS)
    mean_output_tokens: int = Field(gt=0, le=MAX_TOKENS)
    max_tokens: int = Field(gt=0, le=MAX_TOKENS)


class WorkloadSpec(Strict):
    """A model's expected traffic: its peak rate and mean lengths; optionally its length
    quantiles and the arrivals' burstiness (variance over mean of the request count in
    windows holding 100 requests on average; 1: Poisson), which the planner's capacity is
    judged on. Unset, every request is taken as the mean shape and arrivals as Poisson."""

    requests_per_s: float = Field(gt=0, le=MAX_RATE)
    mean_prompt_tokens: int = Field(gt=0, le=MAX_TOKENS)
    mean_output_tokens: int = Field(gt=0, le=MAX_TOKENS)
    # Length slices (Melange's request sizes): the cost objective sizes each on the GPUs
    # that carry it cheapest. Empty: one mean request shape, as always.
    buckets: tuple[BucketSpec, ...] = Field((), max_length=8)
    # The length distribution and the arrivals' burstiness the planner's capacity is judged
    # on (planner/queueing.py); `plan --workload-from` derives them. Unset: every request
    # the mean shape, and Poisson arrivals (the plan says it assumed so).
    prompt_tokens_p50: int | None = Field(None, gt=0, le=MAX_TOKENS)
    prompt_tokens_p90: int | None = Field(None, gt=0, le=MAX_TOKENS)
    prompt_tokens_p99: int | None = Field(None, gt=0, le=MAX_TOKENS)
    max_prompt_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    output_tokens_p50: int | None = Field(None, gt=0, le=MAX_TOKENS)
    output_tokens_p90: int | None = Field(None, gt=0, le=MAX_TOKENS)
    output_tokens_p99: int | None = Field(None, gt=0, le=MAX_TOKENS)
    # Variance over mean of the request count in windows that hold 100 requests on average:
    # 1 for Poisson arrivals, more for traffic that comes in bursts.
    burstiness: float | None = Field(None, ge=0, le=1e6)

    @field_validator(
        "prompt_tokens_p90",
        "prompt_tokens_p99",
        "max_prompt_tokens",
        "output_tokens_p90",
        "output_tokens_p99",
    )
    @classmethod
    def _quantiles_rise(cls, v: int | None, info: ValidationInfo) -> int | None:
        name = info.field_name or ""
        kind = "output" if name.startswith("output") else "prompt"
        order = [f"{kind}_tokens_p50", f"{kind}_tokens_p90", f"{kind}_tokens_p99"]
        if kind == "prompt":
            order.append("max_prompt_tokens")
        for lower in reversed(order[: order.index(name)]):
            below = info.data.get(lower)
            if v is not None and below is not None:
                if v < below:
                    raise ValueError(
                        f"{name} {v} is below {lower} {below} | a higher quantile is "
                        "never shorter: check the figures"
                    )
                break
        return v

    @field_validator("buckets")
    @classmethod
    def _shares_add_up(cls, v: tuple[BucketSpec, ...]) -> tuple[BucketSpec, ...]:
        if v and abs(sum(b.share for b in v) - 1) > 0.01:
            raise ValueError(f"bucket shares add up to {sum(b.share for b in v):.3f}, not 1")
        return v


class SloSpec(Strict):
    """A model's latency objectives: 99th percentiles of time to first token and of time
    per output token (decode step); null means no objective on that figure (none stated at
    all: fleetctl derives both, fleetctl/fleet/slo.py). `share`: the share of requests that
    must meet both, what a capacity is judged by; 0.99, as the names say."""

    ttft_p99_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    tpot_p99_ms: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S * 1000)
    share: float = Field(0.99, gt=0, le=1)


class PlacementSpec(Strict):
    gpu_types: tuple[str, ...] = Field((), max_length=64)
    labels: Labels = Field(default_factory=dict)


# vLLM's --max-lora-rank takes only these (vllm/config/lora.py, MaxLoRARanks); an adapter of
# any rank up to the largest is served by the smallest of them that holds it.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterSpec(Strict):
    """A LoRA adapter on the model: clients ask for it by `name` as their request's model."""

    name: Annotated[str, AfterValidator(names.model_name), _schema_max(MAX_MODEL_NAME)]
    source: Annotated[
        str,
        Field(
            min_length=1,
            description="a Hugging Face id, or a path on the nodes whose parts are plain names "
            "(no '..', no shell metacharacters): it reaches a shell and a file system",
        ),
        AfterValidator(names.adapter_source),
    ]
    rank: int = Field(
        ge=1,
        le=LORA_RANKS[-1],
        description="its r (adapter_config.json); servers get the smallest --max-lora-rank "
        "vLLM takes (1, 8, 16, 32, 64, 128, 256, 320, 512) that holds their largest",
    )
    copy_from: Annotated[
        str | None,
        Field(
            description="a folder on the machine that runs apply: apply copies its files to "
            "`source` (then an absolute path) on every node whose servers may load the adapter",
        ),
        AfterValidator(lambda v: v if v is None else names.plain_path(v, "copy_from")),
    ] = None
    # Its own traffic and objectives, as the model's: its capacity is judged on them.
    workload: WorkloadSpec | None = None
    slo: SloSpec | None = None
    gpu_types: tuple[str, ...] = Field(
        (),
        max_length=64,
        description="pinned: only servers on these GPU types load it; empty: every server "
        "of the model",
    )


def _on_off(value: Any) -> Any:
    """YAML 1.1 reads a bare `on` or `off` as true or false: take them as written."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class ModelSpec(Strict):
    name: Annotated[str, AfterValidator(names.model_name), _schema_max(MAX_MODEL_NAME)]
    profile: str = Field(min_length=1, max_length=MAX_MODEL_NAME)
    variants: dict[Annotated[str, AfterValidator(_variant)], VariantSpec | None] = Field(
        min_length=1
    )
    max_context: int = Field(gt=0, le=MAX_TOKENS)
    # With it, each node class runs the longest max_model_len its KV cache holds, at least
    # this; max_context is then what the fleet serves somewhere, not what every server takes.
    min_context: int | None = Field(None, gt=0, le=MAX_TOKENS)
    workload: WorkloadSpec | None = None
    slo: SloSpec | None = None
    min_replicas: int = Field(1, ge=0, le=MAX_REPLICAS)
    max_replicas: int | None = Field(None, ge=1, le=MAX_REPLICAS)
    min_sequences: int = Field(1, ge=1, le=MAX_REPLICAS)
    gpu_memory_utilization: float | None = Field(None, gt=0.1, le=0.99)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # Prefill and decode on separate servers, the KV cache moved between them: `auto` where
    # the planner finds it serves more within the model's SLO (planner/disaggregate.py).
    disaggregation: Annotated[Literal["auto", "off", "on"], BeforeValidator(_on_off)] = "auto"
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    vllm_args: tuple[str, ...] = Field((), max_length=256)  # checked against vLLM's flags
    env: dict[Annotated[str, AfterValidator(_env_key)], str] = Field(
        default_factory=dict, max_length=256
    )
    # LoRA adapters on this base model; the plan enables LoRA on the servers that load them.
    adapters: tuple[AdapterSpec, ...] = Field((), max_length=MAX_ADAPTERS)
    max_loras: int | None = Field(
        None,
        ge=1,
        le=MAX_ADAPTERS,
        description="adapters a server batches at once (--max-loras), each slot taking GPU "
        "memory from the KV cache; null: as many as it loads, at most 4",
    )
    adapters_runtime: bool = Field(
        False,
        description="servers load and unload adapters at runtime "
        "(VLLM_ALLOW_RUNTIME_LORA_UPDATING): only the max_loras most requested load at start",
    )


class AgingSpec(Strict):
    factor: float = Field(2.0, gt=0, le=1000)
    window_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)
    enabled: bool = True


class PrefixCacheSpec(Strict):
    """vLLM's automatic prefix caching on every server, and its KV events for route-serve."""

    # vLLM V1 caches prefixes by default; false adds --no-enable-prefix-caching to every server.
    enabled: bool = True
    # Every server publishes its KV cache events (--kv-events-config) and route-serve
    # subscribes: its prefix index then holds exactly what each server has cached. The
    # events carry prompt token ids in cleartext on ports vLLM binds on every interface.
    kv_events: bool = False
    # A server on port P publishes on P + events_port_offset and answers replay requests
    # (batches a subscriber missed) on P + replay_port_offset (null: no replay socket).
    events_port_offset: int = Field(2000, ge=1, le=65535)
    replay_port_offset: int | None = Field(4000, ge=1, le=65535)
    topic: str = Field("kv", max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")


class RequestLogSpec(Strict):
    """route-serve's log of finished requests, in the state folder (daemon/request_log.py)."""

    enabled: bool = True
    max_file_mb: float = Field(64, gt=0, le=1 << 20)  # a file is rotated past this
    max_total_mb: float = Field(1024, gt=0, le=1 << 30)  # the oldest files go past this

    @field_validator("max_total_mb")
    @classmethod
    def _total(cls, v: float, info: ValidationInfo) -> float:
        if v < info.data.get("max_file_mb", 0):
            raise ValueError(
                f"max_total_mb {v:g} is below max_file_mb | make it at least max_file_mb"
            )
        return v


class RouterSpec(Strict):
    listen: str = "127.0.0.1:8080"
    long_context_tokens: int = Field(4096, gt=0, le=MAX_TOKENS)
    bandwidth_saturation: float = Field(0.85, gt=0, le=1)
    aging: AgingSpec = Field(default_factory=AgingSpec)
    # X-Priority and the body's `priority` take 0 (most urgent) to priority_classes - 1.
    priority_classes: int = Field(10, ge=1, le=1000)
    # Port of a dcgm-exporter on every node (usually 9400): the router then reads each GPU's
    # DCGM_FI_DEV_MEM_COPY_UTIL for memory-bandwidth saturation.
    dcgm_exporter_port: int | None = Field(None, ge=1, le=65535)
    prefix_cache: PrefixCacheSpec = Field(default_factory=PrefixCacheSpec)
    request_log: RequestLogSpec = Field(default_factory=RequestLogSpec)
    # Short completions route-serve sends a server that joins on a reload, once its /health
    # answers 200, before the server gets any client's traffic (fleetctl/daemon/live.py).
    warmup_requests: int = Field(0, ge=0, le=100)

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"listen address {shown(v)} is not HOST:PORT | write e.g. 127.0.0.1:8080"
            )
        names.host(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        return v


class KvTransferSpec(Strict):
    """How disaggregated servers move a prompt's KV cache: vLLM's --kv-transfer-config."""

    # NixlConnector (vLLM's default for P/D: UCX, RDMA where the NICs have it), or
    # ExampleConnector (a folder both servers share; for tests, and machines without NIXL).
    connector: Literal["NixlConnector", "ExampleConnector"] = "NixlConnector"
    # NIXL's side channel, a ZMQ socket on the node's address (cleartext): server port + this.
    side_channel_port_offset: int = Field(6000, ge=1, le=65535)
    buffer_device: Literal["auto", "cpu"] = "auto"  # "cpu" on vLLM's CPU backend
    shared_storage_path: str | None = Field(None, min_length=1)


class PlannerSpec(Strict):
    gpu_memory_utilization: float = Field(0.92, gt=0.1, le=0.99)
    target_utilization: float = Field(0.8, gt=0, le=1)
    warn_sequences_below: int = Field(8, ge=1, le=MAX_REPLICAS)
    # Every port a plan may use, the surge port (+1000) of the last GPU included, must be
    # at most 65535: checked against the largest node in _check_ports.
    port_base: int = Field(8000, ge=1024, le=65535 - SURGE_PORT_OFFSET)
    # The tokens a step carries (vLLM's --max-num-batched-tokens) on every server.
    max_num_batched_tokens: int | None = Field(
        None,
        ge=256,
        le=MAX_TOKENS,
        description="null: per candidate, the vLLM release's default for its GPU (with 0.32, "
        "2048 on an A100 or RTX 4090, 8192 on an H100) or, under a TPOT objective, a smaller "
        "one whose full step meets the objective where that costs at most 2% of its capacity "
        "(docs/concepts/planner.md, The step budget)",
    )
    enforce_eager: bool = False
    # Start every server with vLLM's sleep mode (--enable-sleep-mode, VLLM_SERVER_DEV_MODE=1),
    # so the autopilot can sleep and wake it instead of stopping and starting it; its dev
    # endpoints then answer on its port, which only route-serve and the autopilot may reach.
    sleep_mode: bool = Field(
        False,
        description="start servers with vLLM's sleep mode (--enable-sleep-mode, "
        "VLLM_SERVER_DEV_MODE=1), so the autopilot sleeps and wakes them; their dev endpoints "
        "must be reachable by route-serve and the autopilot only",
    )
    # throughput: share spare GPUs out among the models; cost: the cheapest GPUs that meet
    # every workload (needs every node's price). `plan --objective` overrides it.
    objective: Literal["throughput", "cost"] = "throughput"
    # A change of placement must be worth its disruption (fleetctl/model/startup.py): with objective
    # throughput, this much log-capacity (0.02: 2% of one model's) per server-minute of warm-up
    # and capacity missing; with objective cost, pay its GPU-hours back within payback_hours.
    change_threshold: float = Field(0.02, ge=0, le=10)
    payback_hours: float = Field(24.0, gt=0, le=24 * 365)
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)


class GateSpec(Strict):
    """`apply --gate TRACE` refuses a plan the what-if predicts worse than what runs by more
    than these: p99 TTFT's and p99 TPOT's relative rise (0.10: 10%), SLO attainment's drop
    (0.02: 2 points)."""

    max_ttft_p99_rise: float = Field(0.10, ge=0, le=100)
    max_tpot_p99_rise: float = Field(0.10, ge=0, le=100)
    max_slo_drop: float = Field(0.02, ge=0, le=1)


class ApplySpec(Strict):
    """How `fleetctl apply` runs servers on the nodes."""

    gate: GateSpec = Field(default_factory=GateSpec)

    vllm_command: str = Field("vllm", min_length=1)  # e.g. /opt/vllm/bin/vllm
    # The vLLM release the nodes run: vllm_args are checked against its `serve --help=all`
    # (profiles/vllm/VERSION.txt). Default: the newest release fleetctl has a flag list for.
    vllm_version: str | None = Field(None, max_length=64)
    supervisor: Literal["auto", "systemd", "nohup"] = "auto"
    health_timeout_s: float = Field(900.0, gt=0, le=MAX_TIMEOUT_S)  # large checkpoints load slowly
    stop_timeout_s: int = Field(30, ge=1, le=3600)
    # Names of secrets (e.g. HF_TOKEN, VLLM_API_KEY) every server gets in its 0600 env file;
    # values come from the operator's environment or `--secrets-file`, never from here.
    secrets: list[str] = Field(default_factory=list, max_length=64)

    @field_validator("vllm_command")
    @classmethod
    def _command(cls, v: str) -> str:
        try:
            words = shlex.split(v)
        except ValueError:
            raise ValueError(
                f"vllm_command {shown(v)} has unbalanced quotes | close the quote"
            ) from None
        if not words:
            raise ValueError("vllm_command is empty | write e.g. vllm or /opt/vllm/bin/vllm")
        names.command_word(words[0])
        return v

    @field_validator("secrets")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not names.ENV_KEY.fullmatch(name):
                raise ValueError(
                    f"{shown(name)} is not an environment variable name | list names only, "
                    "e.g. [HF_TOKEN]; values come from the environment or --secrets-file"
                )
            _env_key(name)
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
    cost_per_hour: float | None = None  # as written on its entry; see fleetctl/fleet/prices.py
    network: NetworkSpec | None = None  # as written, or as probed (fleet/facts.py)


@dataclass(frozen=True)
class Variant:
    format: FormatProfile
    source: str
    revision: str | None


@dataclass(frozen=True)
class Adapter:
    spec: AdapterSpec
    gpu_types: tuple[str, ...]  # canonical names of the GPU types it is pinned to; empty: any

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Model:
    spec: ModelSpec
    profile: ModelProfile
    variants: tuple[Variant, ...]
    gpu_types: tuple[str, ...]  # canonical names of allowed GPU types; empty means any
    adapters: tuple[Adapter, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Inventory:
    path: Path
    spec: InventorySpec
    nodes: tuple[Node, ...]
    models: tuple[Model, ...]
    source: Source | None = None  # where each field was written, for later errors

    def check_ssh_files(self) -> None:
        """Name a missing identity file before any connection is tried (then every node
        would fail with the same authentication error)."""
        path = self.spec.ssh.identity_file
        if path is not None and not Path(path).expanduser().is_file():
            where = self.source.at(("ssh", "identity_file")) if self.source else None
            raise UserError(
                f"identity_file {shown(path)} does not exist",
                where,
                "fix the path, or remove it to use ~/.ssh/config, the agent and default keys",
            )

    def model(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)


_RANGE = re.compile(r"\[(\d{1,9}):(\d{1,9})\]")
_MALFORMED = " has a malformed range | write a range as [FIRST:LAST], e.g. [1:8]"


def _range(text: str) -> tuple[re.Match[str] | None, int]:
    """The range in `text` and how many values it expands to, without expanding it."""
    matches = list(_RANGE.finditer(text))
    if not matches:
        if "[" in text or "]" in text:
            raise ValueError(shown(text) + _MALFORMED)
        return None, 1
    if len(matches) > 1:
        raise ValueError(
            f"{shown(text)} has more than one range | use one [FIRST:LAST] range per value"
        )
    m = matches[0]
    first, last = int(m.group(1)), int(m.group(2))
    if last < first:
        raise ValueError(
            f"range [{m.group(1)}:{m.group(2)}] runs backwards | write [{last}:{first}]"
        )
    outside = text[: m.start()] + text[m.end() :]
    if "[" in outside or "]" in outside:
        raise ValueError(shown(text) + _MALFORMED)
    return m, last - first + 1


def range_size(text: str) -> int:
    return _range(text)[1]


def expand_range(text: str) -> list[str]:
    """`rtx-[1:8]` -> rtx-1 .. rtx-8; `[01:10]` keeps the zero padding; no range -> [text]."""
    m, n = _range(text)
    if m is None:
        return [text]
    if n > MAX_NODES:
        raise ValueError(
            f"range [{m.group(1)}:{m.group(2)}] expands to {n} values, more than {MAX_NODES} "
            "| split the fleet, or raise FLEETCTL_MAX_NODES"
        )
    first = int(m.group(1))
    width = len(m.group(1)) if m.group(1).startswith("0") and len(m.group(1)) > 1 else 0
    head, tail = text[: m.start()], text[m.end() :]
    return [f"{head}{i:0{width}d}{tail}" for i in range(first, first + n)]


def load_inventory(path: str | Path, catalog: Catalog) -> Inventory:
    """Read, validate and resolve an inventory; any mistake is a UserError with file and line."""
    src = load_yaml(path, "inventory")
    if not isinstance(src.data, dict):
        raise UserError(
            "the inventory must be a mapping with 'nodes' and 'models'",
            src.at(()),
            "see the examples that `fleetctl examples` lists",
        )
    listed = src.data.get("nodes")
    if isinstance(listed, list) and len(listed) > MAX_NODES:  # before validating each one
        raise UserError(
            f"the inventory lists {len(listed)} nodes, more than the limit of {MAX_NODES}",
            src.at(("nodes",)),
            "split the fleet into several inventories, or raise FLEETCTL_MAX_NODES",
        )
    spec = validate(InventorySpec, src)
    _check_size(spec, src)
    nodes = _expand_nodes(spec, src, catalog)
    _check_ports(spec, nodes, src)
    models = _resolve_models(spec, src, catalog)
    if spec.router.prefix_cache.kv_events:
        _check_kv_events(spec, src, catalog)
    return Inventory(Path(path), spec, nodes, models, src)


def _check_size(spec: InventorySpec, src: Source) -> None:
    """Count nodes and GPUs before expanding anything: a 1 KB file of ranges can name millions."""
    nodes = gpus = 0
    for i, ns in enumerate(spec.nodes):
        n = _checked(range_size, ns.name, src, ("nodes", i, "name"))
        nodes += n
        gpus += n * ns.gpus.count
        if nodes > MAX_NODES or gpus > MAX_GPUS:
            what = f"{nodes} nodes" if nodes > MAX_NODES else f"{gpus} GPUs"
            raise UserError(
                f"the nodes up to here expand to {what}, more than the limit of {MAX_NODES} "
                f"nodes and {MAX_GPUS} GPUs",
                src.at(("nodes", i, "name")),
                "split the fleet into several inventories, or raise FLEETCTL_MAX_NODES",
            )
    if len(spec.models) > MAX_MODELS:
        raise UserError(
            f"the inventory lists {len(spec.models)} models, more than {MAX_MODELS}",
            src.at(("models",)),
            "split it into several inventories",
        )


def _check_ports(spec: InventorySpec, nodes: tuple[Node, ...], src: Source) -> None:
    """Every port a plan may give a server, its surge port included, must exist; so must
    its KV event ports, apart from every other server's ports on the node."""
    if not nodes:
        return
    base = spec.planner.port_base
    widest = max(nodes, key=lambda n: n.gpu_count)
    top = base + widest.gpu_count - 1 + SURGE_PORT_OFFSET
    if top > 65535:
        raise UserError(
            f"port_base {base} gives {widest.name}'s last GPU the replacement port {top}, "
            "past 65535",
            src.at(("planner", "port_base")),
            f"lower port_base to at most {65535 - SURGE_PORT_OFFSET - widest.gpu_count + 1}",
        )
    _check_event_ports(spec, widest, src)


def _check_event_ports(spec: InventorySpec, widest: Node, src: Source) -> None:
    """With KV events, a node's servers (port_base + first GPU, or that + the surge offset)
    publish on their port + events_port_offset and replay on + replay_port_offset; a model
    that may be disaggregated gets NIXL's side channel on + side_channel_port_offset. Each of
    those runs of ports must exist and not overlap another, nor the dcgm-exporter's port."""
    pc = spec.router.prefix_cache
    offsets: list[tuple[tuple[str, ...], int]] = []
    if pc.kv_events:
        if not pc.enabled:
            raise UserError(
                "kv_events is on but prefix caching is off: vLLM publishes no KV events without it",
                src.at(("router", "prefix_cache", "kv_events")),
                "set prefix_cache.enabled to true, or kv_events to false",
            )
        offsets.append((("router", "prefix_cache", "events_port_offset"), pc.events_port_offset))
        if pc.replay_port_offset is not None:
            where = ("router", "prefix_cache", "replay_port_offset")
            offsets.append((where, pc.replay_port_offset))
    kv = spec.planner.kv_transfer
    # `auto` needs a known network to split (planner/disaggregate.py): inventories that give
    # none keep their whole port range as before.
    networks = any(n.network is not None for n in spec.nodes)
    may_split = any(
        m.disaggregation == "on" or (m.disaggregation == "auto" and networks) for m in spec.models
    )
    if kv.connector == "NixlConnector" and may_split:
        where = ("planner", "kv_transfer", "side_channel_port_offset")
        offsets.append((where, kv.side_channel_port_offset))
    if not offsets:
        return
    base, n = spec.planner.port_base, widest.gpu_count
    runs = {"server ports": 0, "replacement server ports": SURGE_PORT_OFFSET}
    for at, off in offsets:
        field = at[-1]
        kind = field.removesuffix("_port_offset").replace("_", " ")
        for name, start in (
            (f"{kind} ports", off),
            (f"replacement {kind} ports", off + SURGE_PORT_OFFSET),
        ):
            top = base + start + n - 1
            if top > 65535:
                raise UserError(
                    f"{field} {off} gives {widest.name}'s last GPU the {name[:-1]} {top}, "
                    "past 65535",
                    src.at(at),
                    f"lower {field} to at most {65535 - base - n + 1 - (start - off)}, or "
                    "lower planner.port_base",
                )
            for other, ostart in runs.items():
                if abs(start - ostart) < n:
                    raise UserError(
                        f"{field} {off} puts {widest.name}'s {name} "
                        f"({base + start}-{top}) on its {other} "
                        f"({base + ostart}-{base + ostart + n - 1})",
                        src.at(at),
                        f"give each run of {n} ports its own range: e.g. {field} "
                        f"{_free_offset(runs, n)}",
                    )
            runs[name] = start
    dcgm = spec.router.dcgm_exporter_port
    if dcgm is not None:
        for name, start in runs.items():
            if base + start <= dcgm < base + start + n:
                raise UserError(
                    f"dcgm_exporter_port {dcgm} is one of {widest.name}'s {name}",
                    src.at(("router", "dcgm_exporter_port")),
                    "move the KV event ports with prefix_cache.events_port_offset or "
                    "replay_port_offset, or the side channel's with "
                    "planner.kv_transfer.side_channel_port_offset",
                )


def _check_kv_events(spec: InventorySpec, src: Source, catalog: Catalog) -> None:
    """The nodes' vLLM must know the flags KV events need, and no model may turn prefix
    caching off."""
    for i, ms in enumerate(spec.models):
        for j, arg in enumerate(ms.vllm_args):
            if arg.replace("_", "-").partition("=")[0] == "--no-enable-prefix-caching":
                raise UserError(
                    f"vllm_args[{j}] --no-enable-prefix-caching turns off the prefix cache "
                    "whose KV events router.prefix_cache.kv_events subscribes to",
                    src.at(("models", i, "vllm_args", j)),
                    "remove it, or set router.prefix_cache.kv_events to false",
                )
    flags = catalog.serve_flags(spec.apply.vllm_version, src.at(("apply", "vllm_version")))
    for flag in ("--enable-prefix-caching", "--kv-events-config"):
        if flags.lookup(flag) is None:
            raise UserError(
                f"vLLM {flags.version} has no {flag}, which kv_events needs",
                src.at(("router", "prefix_cache", "kv_events")),
                "set apply.vllm_version to a release that has it (0.32.0), or kv_events to false",
            )


def _free_offset(runs: dict[str, int], n: int) -> int:
    """The smallest multiple of 1000 (at least `n` apart from every taken run, and its
    surge twin) that is free."""
    step = max(1000, -(-n // 1000) * 1000)
    off = step
    while any(abs(off + d - s) < n for s in runs.values() for d in (0, SURGE_PORT_OFFSET)):
        off += step
    return off


def _expand_nodes(spec: InventorySpec, src: Source, catalog: Catalog) -> tuple[Node, ...]:
    out: list[Node] = []
    by_name: dict[str, int] = {}
    by_addr: dict[tuple[str, int], str] = {}
    for i, ns in enumerate(spec.nodes):
        gpu = catalog.gpu(ns.gpus.type, src.at(("nodes", i, "gpus", "type")))
        names_ = _checked(expand_range, ns.name, src, ("nodes", i, "name"))
        hosts = _checked(expand_range, ns.host, src, ("nodes", i, "host")) if ns.host else names_
        if len(hosts) != len(names_):
            raise UserError(
                f"name expands to {plural(len(names_), 'node')} but host to {len(hosts)}",
                src.at(("nodes", i, "host")),
                "give host a range of the same length as name",
            )
        # Checked once expanded ("rtx-[1:8]" is no name); the first and last stand for all,
        # since only the range's digits differ between them.
        for value in {names_[0], names_[-1]}:
            _checked(lambda v: names.name(v, "node name"), value, src, ("nodes", i, "name"))
        if ns.host:  # without one, the name is an alias ~/.ssh/config may resolve
            for value in {hosts[0], hosts[-1]}:
                _checked(names.host, value, src, ("nodes", i, "host"))
        port = ns.port or spec.ssh.port
        line = src.line_of(("nodes", i))
        labels = tuple(sorted(ns.labels.items()))
        for name, host in zip(names_, hosts, strict=True):
            if name in by_name:
                raise UserError(
                    f"duplicate node name '{name}' (first defined in nodes[{by_name[name]}])",
                    src.at(("nodes", i, "name")),
                    "give every node a unique name",
                )
            addr = (_same_address(host), port)
            if addr in by_addr:
                raise UserError(
                    f"duplicate address {names.host_port(host, port)} "
                    f"(also node '{by_addr[addr]}')",
                    src.at(("nodes", i, "host")),
                    "give every node its own host or SSH port",
                )
            by_name[name] = i
            by_addr[addr] = name
            out.append(
                Node(
                    name,
                    host,
                    port,
                    ns.user or spec.ssh.user,
                    gpu,
                    ns.gpus.count,
                    labels,
                    line,
                    ns.cost_per_hour,
                    ns.network,
                )
            )
    return tuple(out)


def _checked(check: Any, value: Any, src: Source, path: tuple[Any, ...]) -> Any:
    """`check(value)`, with its ValueError("what | fix") turned into a located UserError."""
    try:
        return check(value)
    except ValueError as e:
        what, fix = what_and_fix(e)
        raise UserError(what, src.at(path), fix) from None


def _resolve_models(spec: InventorySpec, src: Source, catalog: Catalog) -> tuple[Model, ...]:
    out: list[Model] = []
    seen: dict[str, int] = {}
    flags = None
    secrets = set(spec.apply.secrets)
    for i, ms in enumerate(spec.models):
        at = ("models", i)
        if ms.vllm_args:
            flags = flags or catalog.serve_flags(
                spec.apply.vllm_version, src.at(("apply", "vllm_version"))
            )
            pinned = LORA_PINNED if ms.adapters else {}
            check = partial(check_args, flags=flags, pinned_too=pinned)
            _checked(check, ms.vllm_args, src, (*at, "vllm_args"))
        for key in ms.env:
            if key in secrets:
                raise UserError(
                    f"{key} is both a secret (apply.secrets) and set in env",
                    src.at((*at, "env", key)),
                    "remove it from env: a secret's value comes from the environment or "
                    "--secrets-file, never from the inventory",
                )
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
        if ms.min_context is not None and ms.min_context > ms.max_context:
            raise UserError(
                f"min_context {ms.min_context} exceeds max_context {ms.max_context}",
                src.at((*at, "min_context")),
                f"lower min_context to at most {ms.max_context}, or raise max_context",
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
        adapters = _resolve_adapters(ms, at, gpu_types, src, catalog)
        out.append(Model(ms, profile, tuple(variants), gpu_types, adapters))
    _check_adapter_names(spec, src)
    return tuple(out)


def _resolve_adapters(
    ms: ModelSpec, at: tuple[Any, ...], allowed: tuple[str, ...], src: Source, catalog: Catalog
) -> tuple[Adapter, ...]:
    out = []
    for j, a in enumerate(ms.adapters):
        if a.copy_from is not None and not a.source.startswith("/"):
            raise UserError(
                f"adapter '{a.name}' has copy_from, so its source {shown(a.source)} is where "
                "apply copies it on the nodes, and must be an absolute path",
                src.at((*at, "adapters", j, "source")),
                "write source as /path/on/the/nodes, e.g. /srv/adapters/" + a.name.split("/")[-1],
            )
        types = []
        for k, t in enumerate(a.gpu_types):
            where = (*at, "adapters", j, "gpu_types", k)
            name = catalog.gpu(t, src.at(where)).name
            if allowed and name not in allowed:
                raise UserError(
                    f"adapter '{a.name}' is pinned to {name}, where model '{ms.name}' never "
                    f"runs (its placement.gpu_types: {', '.join(allowed)})",
                    src.at(where),
                    "pin it to one of the model's GPU types, or add this one to the model's",
                )
            types.append(name)
        out.append(Adapter(a, tuple(types)))
    return tuple(out)


def _check_adapter_names(spec: InventorySpec, src: Source) -> None:
    """An adapter's name is what a request's `model` names: it must pick one thing only."""
    models = {m.name: i for i, m in enumerate(spec.models)}
    seen: dict[str, tuple[int, int]] = {}
    for i, ms in enumerate(spec.models):
        for j, a in enumerate(ms.adapters):
            where = src.at(("models", i, "adapters", j, "name"))
            if a.name in models:
                raise UserError(
                    f"adapter name '{a.name}' is also a model's name "
                    f"(models[{models[a.name]}]): a request for it would be ambiguous",
                    where,
                    "give the adapter a name of its own",
                )
            if a.name in seen:
                mi, mj = seen[a.name]
                raise UserError(
                    f"duplicate adapter name '{a.name}' (first in models[{mi}].adapters[{mj}])",
                    where,
                    "adapter names must be unique across the inventory",
                )
            seen[a.name] = (i, j)


def _same_address(host: str) -> str:
    """One spelling per address, so fd00::2 and fd00:0::2 are seen as the same node; names are
    compared as written (case aside), since resolving them is the network's business."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()
