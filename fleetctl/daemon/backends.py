"""The daemon's backends: fleetctl's applied state, or a YAML file of servers it did not launch."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from fleetctl.base import names
from fleetctl.base.errors import Location, UserError
from fleetctl.base.limits import MAX_TOKENS
from fleetctl.base.validation import Strict, validate
from fleetctl.base.yamlsrc import load_yaml
from fleetctl.daemon.adapters import lora_modules, lora_rank
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import server_name
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import Calibration, calibrated
from fleetctl.model.catalog import Catalog
from fleetctl.model.perf import EnginePerf, kv_budget, vllm_batch_defaults, weights_bytes
from fleetctl.model.startup import wake_seconds
from fleetctl.routing.types import ASLEEP, DRAINING, Backend

log = logging.getLogger("fleetctl.router")


class BackendEntry(Strict):
    url: str = Field(pattern=r"^https?://[^/\s]+(/.*)?$")
    node: Annotated[str, AfterValidator(lambda v: names.name(v, "node name"))] | None = None
    gpu_type: str
    model: str
    variant: str = "bf16"
    profile: str | None = None  # model profile; default: the inventory model's, or `model`
    tensor_parallel_size: int = Field(1, ge=1)
    kv_budget_tokens: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    # Its --max-num-batched-tokens (prefill tokens a step carries); unset: vLLM's default.
    max_num_batched_tokens: int | None = Field(None, gt=0, le=MAX_TOKENS)
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)
    # Its --max-model-len: requests longer than it go elsewhere. Unset: not filtered by length.
    max_model_len: int | None = Field(None, gt=0, le=MAX_TOKENS)
    gpus: tuple[int, ...] = ()  # GPU indices on its node, to read them from DCGM
    dcgm_url: str | None = Field(None, pattern=r"^https?://[^/\s]+(/.*)?$")
    # The name the server serves the model under (vLLM's --served-model-name) when it is not
    # `model`: the router renames the request's model to it (README, route-serve).
    served_name: str | None = Field(None, min_length=1)
    # One phase of a disaggregated model (routing/phases.py), or both.
    role: Literal["both", "prefill", "decode"] = "both"
    # Started with --enable-sleep-mode (and VLLM_SERVER_DEV_MODE=1): route-serve may wake it
    # when it finds it asleep and its model has no awake server. Off: a sleeper is not used.
    sleep_mode: bool = False


def served_name(b: Backend) -> str:
    """The model name `b` serves: its backends-file `served_name`, else the inventory's."""
    return b.served_name or b.model


def host_port(b: Backend) -> str:
    """Where `b` listens, as `host:port` (its URL without the scheme)."""
    return b.name.split("://", 1)[-1].rstrip("/")


def body_for(b: Backend, raw: bytes) -> bytes:
    """The request body to send `b`: the client's, with `model` renamed to the name `b` serves
    when that differs. Parsed again only then (the rare case): `raw` is a JSON object the
    router already checked."""
    name = served_name(b)
    if name == b.model:
        return raw
    body = json.loads(raw)
    if body.get("model") != b.model:  # an adapter's name: vLLM routes by it, keep it
        return raw
    body["model"] = name
    return json.dumps(body, ensure_ascii=False).encode()


def model_problem(b: Backend, listed: list[str]) -> str:
    """Why `b` cannot serve its model, from the names its /v1/models lists; "" when it can.
    One line with the fix."""
    want = served_name(b)
    if want in listed:
        return ""
    serves = ", ".join(f'"{m}"' for m in listed) or "no model"
    if want != b.model:  # a served_name that does not match either
        return (
            f'{b.node} serves {serves}, not "{want}" (its served_name for "{b.model}"): set '
            f"served_name in the backends file to the name it serves, or start vLLM with "
            f"--served-model-name {want}"
        )
    return (
        f'{b.node} serves {serves}, not "{want}": start vLLM with --served-model-name {want}, '
        f"or set served_name in the backends file"
    )


def load_backends_file(path: Path, inv: Inventory, catalog: Catalog) -> list[Backend]:
    """`backends:` followed by a list of servers (or just the list)."""
    src = load_yaml(path, "backends file")
    wrapped = isinstance(src.data, dict) and set(src.data) == {"backends"}
    items = src.data["backends"] if wrapped else src.data
    if not isinstance(items, list) or not items:
        raise UserError(
            "the backends file must list servers",
            src.at(()),
            "write `backends:` and '- url: ...' entries",
        )
    out: list[Backend] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        at: tuple[str | int, ...] = ("backends", i) if wrapped else (i,)
        e = validate(BackendEntry, src, item, at)
        where = src.at(at)
        url = e.url.rstrip("/")
        if url in seen:
            raise UserError(f"duplicate backend url {url}", where, "list each server once")
        seen.add(url)
        gpu = catalog.gpu(e.gpu_type, where)
        profile_name = e.profile or _inventory_profile(inv, e.model) or e.model
        model = catalog.model(profile_name, where)
        fmt = catalog.format(e.variant, where)
        default_tokens, default_seqs = vllm_batch_defaults(
            gpu, max_model_len=e.max_model_len or 8192
        )
        seqs = e.max_num_seqs or default_seqs
        kv = (
            e.kv_budget_tokens
            or kv_budget(
                gpu,
                model,
                fmt,
                e.tensor_parallel_size,
                e.gpu_memory_utilization,
                max_model_len=e.max_model_len,
            ).kv_tokens
        )
        perf = EnginePerf(gpu, model, fmt, e.tensor_parallel_size)
        node = e.node or url.split("//", 1)[1].split("/")[0]
        b = Backend(url, node, gpu.name, e.model, fmt.name, kv, seqs, perf, e.max_model_len or 0)
        b.served_name = e.served_name if e.served_name and e.served_name != e.model else ""
        b.gpus, b.dcgm_url = e.gpus, e.dcgm_url or ""
        b.max_num_batched_tokens = e.max_num_batched_tokens or default_tokens
        b.role = e.role
        b.wakeable = e.sleep_mode
        b.wake_s = wake_seconds(gpu, weights_bytes(model, fmt), e.tensor_parallel_size, 1)
        out.append(b)
    return out


def class_tags(state_dir: StateDir, nodes: list[str]) -> list[str]:
    """Per node: its own class tag when `fleetctl health` found it not equivalent, else ""."""
    equivalent = state_dir.load_health().equivalent
    return [f"nonequivalent:{n}" if equivalent.get(n) is False else "" for n in nodes]


def _inventory_profile(inv: Inventory, served: str) -> str | None:
    return next((m.profile.name for m in inv.models if m.name == served), None)


def backends_from_state(inv: Inventory, state_dir: StateDir) -> list[Backend]:
    """Every server `fleetctl apply` recorded, at http://host:port: the awake ones (those
    listed as draining in that state), then the asleep ones at their sleep level."""
    state = state_dir.load_state()
    out = [_state_backend(inv, d) for d in state.deployments]
    for b, d in zip(out, state.deployments, strict=True):
        if server_name(d) in state.draining:
            b.state = DRAINING
    for s in state.asleep:
        b = _state_backend(inv, s.deployment, s.level)
        b.state, b.sleep_level = ASLEEP, s.level
        out.append(b)
    return out


SLEEP_MODE_FLAG = "--enable-sleep-mode"


def _state_backend(inv: Inventory, d: Deployment, level: int = 1) -> Backend:
    """One recorded server; its wake's seconds from `level` where its class is known."""
    s = d.server
    model = next((m for m in inv.models if m.name == d.model), None)
    gpu = next((n.gpu for n in inv.nodes if n.name == d.node), None)
    perf = None
    wake_s = None
    if model is not None and gpu is not None:
        fmt = next((v.format for v in model.variants if v.format.name == d.variant), None)
        if fmt is not None:
            perf = EnginePerf(gpu, model.profile, fmt, s.tensor_parallel_size, s.kv_cache_dtype)
            size = weights_bytes(model.profile, fmt)
            wake_s = wake_seconds(gpu, size, s.tensor_parallel_size, level)
    b = Backend(
        d.url(),
        d.node,
        d.gpu_type,
        d.model,
        d.variant,
        s.kv_budget_tokens,
        s.max_num_seqs,
        perf,
        max_model_len=s.max_model_len,
        gpus=d.gpu_indices,
        dcgm_url=dcgm_url(inv, d.host),
        max_num_batched_tokens=s.max_num_batched_tokens,
        role=s.role,
        adapters=lora_modules(d.vllm_args),
        lora_rank=lora_rank(d.vllm_args),
    )
    b.wake_s, b.sleep_level = wake_s, level
    b.wakeable = SLEEP_MODE_FLAG in d.vllm_args
    return b


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """Where route-serve reads one server's KV events (fleetctl.daemon.kv_events.KvSource,
    without importing pyzmq): `endpoint` to connect to (or, with `bind`, to bind: vLLM
    connects), `replay` its replay socket if it has one, and the topic."""

    endpoint: str
    topic: str = ""
    replay: str | None = None
    bind: bool = False


# vLLM's publisher binds where its endpoint's host is one of these (kv_events.py), else it
# connects to that address, and the subscriber binds it.
_BIND_HOSTS = ("*", "::", "[::]")


def _tcp(host: str, port: int) -> str:
    return "tcp://" + names.host_port(host, port)


def _reach(endpoint: object, host: str) -> tuple[str, bool] | None:
    """(what to reach `endpoint` of a vLLM on `host` at, whether to bind it), or None if it is
    not a tcp://HOST:PORT endpoint."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    where, sep, port = endpoint[6:].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if where in _BIND_HOSTS:
        return _tcp(host, int(port)), False
    return endpoint, True


def kv_endpoint(args: tuple[str, ...] | list[str], host: str) -> KvEndpoint | None:
    """The KV event publisher a server's recorded `vllm serve` arguments configure
    (--kv-events-config, as the plan writes it), reached at `host`; None without one."""
    config = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name.replace("_", "-") == "--kv-events-config":
            config = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    if config is None:
        return None
    try:
        c = json.loads(config)
    except ValueError:
        return None
    if not isinstance(c, dict) or not c.get("enable_kv_cache_events"):
        return None
    if c.get("publisher", "null") != "zmq":
        return None
    found = _reach(c.get("endpoint", "tcp://*:5557"), host)
    if found is None:
        return None
    replay = _reach(c.get("replay_endpoint"), host)
    topic = c.get("topic", "")
    return KvEndpoint(
        found[0],
        topic if isinstance(topic, str) else "",
        replay[0] if replay is not None else None,
        found[1],
    )


def kv_events_from_state(state_dir: StateDir) -> dict[str, KvEndpoint]:
    """Per backend (its URL, as backends_from_state names it), where it publishes KV events,
    from the flags `fleetctl apply` started it with; servers without them are left out."""
    out = {}
    for d in state_dir.load_state().deployments:
        found = kv_endpoint(d.vllm_args, d.host)
        if found is not None:
            out[d.url()] = found
    return out


def dcgm_url(inv: Inventory, host: str) -> str:
    """The node's dcgm-exporter page when the inventory says every node runs one."""
    port = inv.spec.router.dcgm_exporter_port
    if port is None:
        return ""
    return names.http_url(host, port, "/metrics")


def apply_calibration(
    backends: list[Backend], calibration: Calibration, vllm_version: str | None = None
) -> list[str]:
    """Give each backend whose class has a calibration entry (GPU, model, format, TP) the KV
    tokens and speed its servers measured, in place; one line per calibrated class, saying
    from what (`RTX-4090/llama-3-8b/bf16: calibrated from 3 servers, ...`)."""
    lines: dict[str, str] = {}
    for b in backends:
        if b.perf is None:
            continue
        p = b.perf
        engine = calibrated(
            calibration,
            p,
            b.kv_tokens,
            vllm_version=vllm_version,
            max_model_len=b.max_model_len or None,
        )
        if not engine.provenance:
            continue
        b.kv_tokens, b.perf = engine.kv_tokens, engine.perf
        tp = f"/tp{p.tp}" if p.tp > 1 else ""
        lines.setdefault(f"{b.gpu_type}/{p.model.name}/{b.variant}{tp}", engine.provenance)
    return [f"{cls}: {text}" for cls, text in sorted(lines.items())]


def load_backends(
    inv: Inventory,
    catalog: Catalog,
    backends_file: Path | None,
    state_dir: StateDir,
    calibrated: bool = False,
) -> list[Backend]:
    """The backends to route to; with `calibrated`, the state folder's calibration replaces
    the model's KV and speed where it matches, logged one line per class."""
    found = (
        load_backends_file(backends_file, inv, catalog)
        if backends_file
        else backends_from_state(inv, state_dir)
    )
    for b, tag in zip(found, class_tags(state_dir, [b.node for b in found]), strict=True):
        b.class_tag = tag
    if not found:
        raise UserError(
            "no backends to route to",
            Location(str(state_dir.state_path)),
            "run `fleetctl apply`, or pass --backends FILE for servers fleetctl did not launch",
        )
    if calibrated:
        version = inv.spec.apply.vllm_version
        for line in apply_calibration(found, state_dir.load_calibration(), version):
            log.info("%s", line)
    return found
