"""Each placed server's role: colocated (both phases), or prefill or decode where the planner
splits a model's servers into pools (planner/disaggregate.py decides; this gives the servers
their roles, vLLM flags and reasons)."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, defaultdict
from collections.abc import Iterable

from fleetctl.base.names import natural_key
from fleetctl.fleet.inventory import Inventory, KvTransferSpec, Node
from fleetctl.fleet.plan import Deployment, Disaggregation, KvTransfer, Role, Server
from fleetctl.planner.candidates import Candidate, model_attainment, model_goodput, request_shape
from fleetctl.planner.disaggregate import (
    Choice,
    Goodput,
    Link,
    Pool,
    decide,
    decode_rate,
    prefill_rate,
)
from fleetctl.planner.queueing import traffic_of


def assign_roles(
    inv: Inventory,
    deployments: list[Deployment],
    candidate_of: dict[int, Candidate],
    prefilling: Iterable[tuple[str, tuple[int, ...]]] = (),
) -> tuple[list[Deployment], dict[str, Disaggregation]]:
    """The deployments with their roles, and per model weighed, the choice in figures.
    `candidate_of` maps each Server (by id) to its candidate; `prefilling` lists the slots
    that prefill now, kept prefilling where a split still wants that many there."""
    nodes = {n.name: n for n in inv.nodes}
    now = set(prefilling)
    by_model: dict[str, list[Deployment]] = defaultdict(list)
    for d in deployments:
        by_model[d.model].append(d)
    changed: dict[tuple[str, tuple[int, ...]], Deployment] = {}
    choices: dict[str, Disaggregation] = {}
    for m in inv.models:
        placed = by_model[m.name]
        groups: dict[int, list[Deployment]] = defaultdict(list)
        for d in placed:
            groups[id(d.server)].append(d)
        if not placed or not _weighed(m.spec.disaggregation, placed, nodes):
            continue
        pools = [_pool(key, group, candidate_of[key], nodes) for key, group in groups.items()]
        prompt, output = request_shape(m)
        gpus = {candidate_of[key].cls.gpu.name for key in groups}
        slo = candidate_of[next(iter(groups))].slo
        # Weighed by the figure `plan` prints as the colocated servers' capacity (their
        # goodput on the model's lengths and bursts), and the split by the same model.
        placed_as = [(candidate_of[key], len(g)) for key, g in groups.items()]
        colocated = model_goodput(m, placed_as)
        weigh = None
        if colocated is not None:
            weigh = Goodput(
                traffic_of(m, (prompt, output)),
                colocated,
                functools.partial(model_attainment, m, placed_as),
            )
        choice = decide(m, pools, prompt, output, len(gpus), slo, weigh)
        choices[m.name] = _summary(choice, pools)
        if not choice.disaggregate or choice.split is None:
            continue
        kv = inv.spec.planner.kv_transfer
        for pool in pools:
            group = sorted(
                groups[pool.key], key=lambda d: (d.key not in now, natural_key(d.node), d.key)
            )
            n_prefill = choice.split.prefill.get(pool.key, 0)
            server = group[0].server
            roles = {
                role: _as(server, role, pool, prompt, output, choice, kv)
                for role in ("prefill", "decode")
            }
            for i, d in enumerate(group):
                role: Role = "prefill" if i < n_prefill else "decode"
                changed[d.key] = dataclasses.replace(d, server=roles[role])
    return [changed.get(d.key, d) for d in deployments], choices


def _weighed(mode: str, placed: list[Deployment], nodes: dict[str, Node]) -> bool:
    """Whether the planner weighs a split at all: `on`, or `auto` once every server's node
    has a known network (without one, nothing changes from a plan made before)."""
    if mode == "off":
        return False
    return mode == "on" or all(nodes[d.node].network is not None for d in placed)


def _pool(key: int, group: list[Deployment], k: Candidate, nodes: dict[str, Node]) -> Pool:
    links = [_link(nodes[d.node]) for d in group]
    known = [x for x in links if x is not None]
    link = None
    if known and len(known) == len(links):
        link = Link(min(x.gbps for x in known), all(x.rdma for x in known))
    per_node = max(Counter(d.node for d in group).values())
    label = f"{k.cls.gpu.name} {k.variant.format.name} TP={k.tp}"
    return Pool(
        key,
        label,
        len(group),
        k.perf,
        k.budget.kv_tokens,
        k.max_num_seqs,
        link,
        per_node,
        k.max_model_len,
        k.max_num_batched_tokens,
    )


def _link(node: Node) -> Link | None:
    return None if node.network is None else Link(node.network.gbps, node.network.rdma)


def _as(
    server: Server,
    role: Role,
    pool: Pool,
    prompt: int,
    output: int,
    choice: Choice,
    kv: KvTransferSpec,
) -> Server:
    """`server` as one of the model's `role` pool: its flags, its rate and why."""
    assert choice.split is not None
    nixl = kv.connector == "NixlConnector"
    transfer = KvTransfer(
        role,
        kv.connector,
        kv.side_channel_port_offset if nixl else None,
        None if kv.buffer_device == "auto" else kv.buffer_device,
        kv.shared_storage_path,
    )
    split = choice.split.figures
    assert split is not None
    if role == "prefill":
        rate = prefill_rate(pool, prompt)
        why = (
            f"prefill server of {server.model}'s split: {rate:.2f} req/s of {prompt}-token "
            f"prompts each, their KV cache sent to the decode servers "
            f"({split.transfer_s * 1000:.0f} ms a prompt over the network)"
        )
    else:
        rate = decode_rate(pool, prompt, output, choice.tpot_objective_s, held=choice.held)
        why = (
            f"decode server of {server.model}'s split: {rate:.2f} req/s of {output}-token "
            "answers each, no prompt stalling its steps"
        )
    return dataclasses.replace(
        server,
        role=role,
        kv_transfer=transfer,
        args_tail=(*server.args_tail, *transfer.args()),
        capacity_rps=rate,
        reasons=(*server.reasons, why, f"split because {choice.reason}"),
    )


def _summary(choice: Choice, pools: list[Pool]) -> Disaggregation:
    split = choice.split.figures if choice.split is not None else None
    n_prefill = sum(choice.split.prefill.values()) if choice.split is not None else 0
    total = sum(p.servers for p in pools)
    return Disaggregation(
        choice.disaggregate,
        choice.reason,
        choice.colocated.rate,
        choice.colocated.ttft_s,
        choice.colocated.tpot_s * 1000,
        split.rate if split else None,
        split.ttft_s if split else None,
        split.tpot_s * 1000 if split else None,
        split.transfer_s if split else None,
        n_prefill if choice.disaggregate else 0,
        total - n_prefill if choice.disaggregate else 0,
    )
