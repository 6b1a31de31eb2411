"""`fleetctl status`: each recorded server as its node and its HTTP endpoints see it now."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from fleetctl.apply.execute import ApplyOptions, node_targets, ready
from fleetctl.apply.node import Live, NodeAgent, server_id
from fleetctl.base.names import natural_key
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.ssh import NodeError, SshSession
from fleetctl.fleet.state import State
from fleetctl.planner.diff import parse_flags

Condition = Literal[
    "running",
    "unhealthy",
    "dead",
    "missing",
    "port-taken",
    "restarted-by-hand",
    "unrecorded",
    "unreachable",
]


@dataclass(frozen=True)
class ServerStatus:
    node: str
    model: str
    gpus: tuple[int, ...]
    port: int | None
    condition: Condition
    detail: str

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["gpus"] = list(self.gpus)
        return d


def status_fleet(
    inv: Inventory, state: State, opts: ApplyOptions
) -> tuple[list[ServerStatus], dict[str, Any]]:
    """Each recorded server as the node and its HTTP endpoints see it now.

    The summary's `unreachable` lists every node that could not be checked, one error each,
    servers recorded there or not: a node nobody could ask is not a node known to be fine.
    """
    by_node: dict[str, list[Deployment]] = {}
    for d in state.deployments:
        by_node.setdefault(d.node, []).append(d)
    targets = node_targets(inv, state.deployments)

    def one(name: str) -> tuple[str, list[ServerStatus], NodeError | None]:
        recorded = by_node.get(name, [])
        try:
            with SshSession(targets[name], opts.ssh) as session:
                live = NodeAgent(session, opts.vllm_command, opts.ssh.command_timeout_s).inspect()
        except NodeError as e:
            rows = [
                ServerStatus(name, d.model, d.gpu_indices, d.port, "unreachable", e.line(name))
                for d in recorded
            ]
            return name, rows, e
        return name, node_status(name, recorded, live, opts.api_key), None

    with ThreadPoolExecutor(max_workers=max(1, min(opts.parallel, len(targets) or 1))) as pool:
        done = list(pool.map(one, sorted(targets, key=natural_key)))
    rows = [r for _, rs, _ in done for r in rs]
    unreachable = [
        {"node": name, **e.to_json(), "line": e.line(name)} for name, _, e in done if e is not None
    ]
    summary = {
        "serial": state.serial,
        "servers": len(state.deployments),
        "nodes": len(targets),
        "unreachable": unreachable,
    }
    return rows, summary


def node_status(
    node: str, recorded: list[Deployment], live: list[Live], api_key: str | None
) -> list[ServerStatus]:
    out = []
    by_sid = {s.sid: s for s in live}
    for d in recorded:
        s = by_sid.pop(server_id(d), None)
        cond, detail = _condition(d, s, api_key)
        out.append(ServerStatus(node, d.model, d.gpu_indices, d.port, cond, detail))
    for s in by_sid.values():
        m = s.manifest
        out.append(
            ServerStatus(
                node,
                str(m.get("model", "?")),
                tuple(m.get("gpu_indices", ())),
                m.get("port"),
                "unrecorded",
                f"{s.sid}: started by fleetctl but not in state ({'alive' if s.alive else 'dead'});"
                " `fleetctl apply` adopts or stops it",
            )
        )
    return out


def _condition(d: Deployment, s: Live | None, api_key: str | None) -> tuple[Condition, str]:
    if s is None:
        return "missing", "no server folder on the node: it was removed or never started"
    if s.alive and s.args_hash != d.args_hash:
        return "restarted-by-hand", "its flags differ from the plan's"
    if not s.alive:
        foreign = s.foreign_holder
        # vLLM's own flags mark a vLLM (or stand-in) started by hand, e.g. to try a flag.
        if foreign and ("vllm" in foreign or "--max-model-len" in foreign):
            changed = _changed_flags(d.vllm_args, foreign.split())
            return "restarted-by-hand", f"a vLLM fleetctl did not start holds the port: {changed}"
        if foreign:
            return "port-taken", f"port {d.port} is held by: {foreign[:120]}"
        return "dead", f"{s.sid} is not running (killed or crashed; pid was {s.pid})"
    ok, why = ready(d, api_key)
    return ("running", "healthy") if ok else ("unhealthy", why)


def _changed_flags(planned: Sequence[str], found: Sequence[str]) -> str:
    def after_serve(args: Sequence[str]) -> list[str]:
        args = list(args)
        return args[args.index("serve") + 1 :] if "serve" in args else args

    a, b = parse_flags(after_serve(planned)), parse_flags(after_serve(found))
    diffs = [
        f"{k} {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}"
        for k in sorted(a.keys() | b.keys())
        if k != "(arguments)" and a.get(k) != b.get(k)
    ]
    return "; ".join(diffs[:4]) or "same flags, other process"
