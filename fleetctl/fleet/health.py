"""Fleet health: pure checks over probed facts, the plan's state and the servers' answers."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal

from fleetctl.base.text import plural
from fleetctl.fleet import http
from fleetctl.fleet.facts import Facts
from fleetctl.fleet.http import HttpError
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.vllm.metrics import parse_metrics

Status = Literal["ok", "warn", "fail"]
KV_SATURATED = 0.95
FOREIGN_MIB = 1024  # GPU memory a process must hold to count as eating the KV budget


@dataclass(frozen=True)
class Check:
    check: str
    node: str
    status: Status
    detail: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def node_classes(inv: Inventory) -> dict[str, str]:
    """Node -> class key: nodes of a class should be interchangeable."""
    return {n.name: f"{n.gpu_count}x {n.gpu.name}" for n in inv.nodes}


def check_reachability(facts: Facts) -> list[Check]:
    out = []
    for name, f in sorted(facts.nodes.items()):
        if f.error is not None:  # the one line an operator reads: node (address): what: what to do
            out.append(Check("reachable", name, "fail", f.error.text))
        elif f.gpu_error is not None:
            out.append(Check("reachable", name, "fail", f"GPU driver: {f.gpu_error.message}"))
        else:
            out.append(Check("reachable", name, "ok", plural(len(f.gpus), "GPU")))
    return out


SKEW_FIELDS = ("driver_version", "cuda_version", "vllm")


def check_skew(inv: Inventory, facts: Facts) -> tuple[list[Check], dict[str, bool]]:
    """Driver, CUDA and vLLM versions within each node class: the majority is the norm, and
    nodes that differ are not equivalent (their kernels may not give the same outputs)."""
    classes = node_classes(inv)
    members: dict[str, list[str]] = defaultdict(list)
    for name, f in facts.nodes.items():
        if name in classes and f.reached:
            members[classes[name]].append(name)
    out: list[Check] = []
    equivalent = {name: True for name in facts.nodes}
    for cls, names in sorted(members.items()):
        for field in SKEW_FIELDS:
            seen = Counter(facts.nodes[n].version(field) for n in names)
            if len(seen) < 2:
                continue
            norm, _ = seen.most_common(1)[0]
            for n in sorted(names):
                got = facts.nodes[n].version(field)
                if got != norm:
                    equivalent[n] = False
                    out.append(
                        Check(
                            f"skew:{field}",
                            n,
                            "fail",
                            f"{field} {got} differs from {norm} on the other {cls} nodes: "
                            "not equivalent to its class",
                        )
                    )
    for name in sorted(equivalent):
        if equivalent[name] and facts.nodes[name].reached:
            out.append(Check("equivalent", name, "ok", "driver, CUDA and vLLM match its class"))
    return out, equivalent


def check_changes(before: Facts | None, now: Facts) -> list[Check]:
    """GPUs that went missing or changed since the saved facts."""
    if before is None:
        return []
    out = []
    for name, f in sorted(now.nodes.items()):
        old = before.nodes.get(name)
        if old is None or not f.reached or not old.reached:
            continue
        was = {g.identity for g in old.gpus}
        is_ = {g.identity for g in f.gpus}
        missing, added = sorted(was - is_), sorted(is_ - was)
        if missing or added:
            detail = f"GPUs gone: {', '.join(missing) or 'none'}; new: {', '.join(added) or 'none'}"
            out.append(Check("gpus-changed", name, "fail", detail))
    return out


def check_gpus(facts: Facts, deployments: Sequence[Deployment]) -> list[Check]:
    """ECC errors, pending page retirements, and foreign processes on GPUs the plan uses."""
    planned: dict[tuple[str, int], Deployment] = {}
    for d in deployments:
        for i in d.gpu_indices:
            planned[(d.node, i)] = d
    out = []
    for name, f in sorted(facts.nodes.items()):
        for g in f.gpus:
            idx = g.index
            if g.ecc_uncorrected_volatile:
                out.append(
                    Check(
                        "ecc",
                        name,
                        "fail",
                        f"GPU {idx}: {g.ecc_uncorrected_volatile} uncorrected ECC errors",
                    )
                )
            if g.retired_pages_pending:
                out.append(
                    Check("ecc", name, "warn", f"GPU {idx}: page retirement pending (reboot)")
                )
            owner = planned.get((name, idx)) if idx is not None else None
            if owner is None:
                continue
            ours = f.fleetctl_pids
            for p in g.processes:
                used = p.used_memory_mib or 0
                pname = p.process_name or ""
                if ours is not None:  # the probe knows fleetctl's servers: match by pid
                    foreign = p.pid not in ours
                else:  # facts from before apply existed: a name is all there is
                    foreign = "vllm" not in pname.lower() and "python" not in pname.lower()
                if used >= FOREIGN_MIB and foreign:
                    out.append(
                        Check(
                            "foreign-process",
                            name,
                            "fail",
                            f"GPU {idx}: pid {p.pid} ({pname or '?'}) holds {used} MiB that "
                            f"the plan gave to {owner.model}'s KV cache",
                        )
                    )
    return out


def check_servers(
    deployments: Sequence[Deployment], timeout: float = 5.0, parallel: int = 32
) -> list[Check]:
    """Each planned server's /health, /v1/models (model and max_model_len) and KV saturation."""

    def one(d: Deployment) -> list[Check]:
        base = d.url()
        where = f"{d.model} on {base}"
        try:
            status, _ = _get(base + "/health", timeout)
            if status != 200:
                return [Check("server", d.node, "fail", f"{where}: /health answered {status}")]
            _, body = _get(base + "/v1/models", timeout)
            models = {m.get("id"): m for m in json.loads(body).get("data", [])}
        except (HttpError, ValueError) as e:
            return [Check("server", d.node, "fail", f"{where}: {e}")]
        if d.model not in models:
            served = ", ".join(sorted(str(k) for k in models)) or "nothing"
            return [Check("server", d.node, "fail", f"{where}: serves {served}, not {d.model}")]
        out = [Check("server", d.node, "ok", f"{where}: healthy")]
        max_len = models[d.model].get("max_model_len")
        if max_len is not None and max_len != d.server.max_model_len:
            out.append(
                Check(
                    "server",
                    d.node,
                    "fail",
                    f"{where}: max_model_len {max_len}, planned {d.server.max_model_len}",
                )
            )
        try:
            _, text = _get(base + "/metrics", timeout)
            usage = parse_metrics(text).kv_usage
        except HttpError:
            usage = None
        if usage is not None and usage >= KV_SATURATED:
            out.append(
                Check("kv-saturation", d.node, "warn", f"{where}: KV cache {usage:.0%} full")
            )
        return out

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(deployments) or 1))) as pool:
        return [c for checks in pool.map(one, deployments) for c in checks]


def _get(url: str, timeout: float) -> tuple[int, str]:
    reply = http.get(url, timeout)
    return reply.status, reply.text
