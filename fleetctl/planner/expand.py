"""From counts per node class to deployments on concrete nodes and GPUs, keeping what runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from fleetctl.fleet.plan import Deployment
from fleetctl.planner.candidates import Candidate, NodeClass


@dataclass(frozen=True)
class Placement:
    cand: Candidate
    node_index: int  # into cls.nodes
    gpus: tuple[int, ...]
    kept: bool


def expand(
    classes: list[NodeClass],
    cands: list[Candidate],
    counts: Sequence[int],
    shapes: dict[int, list[tuple[tuple[int, ...], int]]],
    current: Sequence[Deployment],
) -> list[Placement]:
    out: list[Placement] = []
    for cls in classes:
        want = [(k, n) for k, n in zip(cands, counts, strict=True) if k.cls is cls and n]
        if not want:
            continue
        names = {node.name for node in cls.nodes}
        kept = [d for d in current if d.node in names]
        placed = _keep_then_fill(cls, want, kept) if kept else None
        if placed is None and cls.index not in shapes:
            placed = _fill_in_order(cls, want)  # power-of-two GPUs: blocks pack exactly
        if placed is None:  # the kept servers fragment the nodes: repack the class from scratch
            placed = _pack_shapes(cls, want, shapes.get(cls.index, []))
        out.extend(placed)
    return out


def _aligned_free(free: list[bool], size: int) -> tuple[int, ...] | None:
    for start in range(0, len(free) - size + 1, size):
        if all(free[start : start + size]):
            return tuple(range(start, start + size))
    return None


def _keep_then_fill(
    cls: NodeClass, want: list[tuple[Candidate, int]], current: Sequence[Deployment]
) -> list[Placement] | None:
    left: Counter[tuple[str, str, int]] = Counter()
    by_option = {}
    for cand, n in want:
        left[cand.option] += n
        by_option[cand.option] = cand
    index = {node.name: i for i, node in enumerate(cls.nodes)}
    free = [[True] * cls.gpu_count for _ in cls.nodes]
    out: list[Placement] = []
    for d in current:
        i = index.get(d.node)
        option = (d.model, d.variant, d.tensor_parallel_size)
        if i is None or left[option] <= 0 or len(d.gpu_indices) != d.tensor_parallel_size:
            continue
        if not all(g < cls.gpu_count and free[i][g] for g in d.gpu_indices):
            continue
        for g in d.gpu_indices:
            free[i][g] = False
        left[option] -= 1
        out.append(Placement(by_option[option], i, tuple(d.gpu_indices), True))
    todo = sorted(
        ((by_option[o], n) for o, n in left.items() if n > 0),
        key=lambda item: (-item[0].tp, item[0].option),
    )
    # GPUs are only ever taken, so a node with no free block of size t never gets one again:
    # one cursor per size keeps first-fit linear in the number of nodes.
    cursor: dict[int, int] = {}
    for cand, n in todo:
        i = cursor.get(cand.tp, 0)
        for _ in range(n):
            while i < len(cls.nodes):
                block = _aligned_free(free[i], cand.tp)
                if block is not None:
                    break
                i += 1
            else:
                return None
            for g in block:
                free[i][g] = False
            out.append(Placement(cand, i, block, False))
        cursor[cand.tp] = i
    return out


def _fill_in_order(cls: NodeClass, want: list[tuple[Candidate, int]]) -> list[Placement]:
    """Largest TP first, node after node: aligned and gap-free when GPU counts are powers of two."""
    out = []
    node, offset = 0, 0
    for cand, n in sorted(want, key=lambda item: (-item[0].tp, item[0].option)):
        for _ in range(n):
            if offset + cand.tp > cls.gpu_count:
                node, offset = node + 1, 0
            out.append(Placement(cand, node, tuple(range(offset, offset + cand.tp)), False))
            offset += cand.tp
    if node >= len(cls.nodes):
        raise AssertionError("more deployments than the class's GPUs")
    return out


def _pack_shapes(
    cls: NodeClass, want: list[tuple[Candidate, int]], shapes: list[tuple[tuple[int, ...], int]]
) -> list[Placement]:
    """Cut nodes into the solver's shapes, then fill the slots: always fits by construction."""
    slots: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    node = 0
    for shape, n in sorted(shapes, key=lambda s: sorted(s[0], reverse=True), reverse=True):
        for _ in range(n):
            start = 0
            for size in sorted(shape, reverse=True):  # descending powers of two stay aligned
                slots.setdefault(size, []).append((node, tuple(range(start, start + size))))
                start += size
            node += 1
    out = []
    taken: Counter[int] = Counter()
    for cand, n in sorted(want, key=lambda item: (-item[0].tp, item[0].option)):
        free = slots.get(cand.tp, [])
        first = taken[cand.tp]
        if len(free) - first < n:
            raise AssertionError("solver shapes do not hold the solver's deployments")
        for i, gpus in free[first : first + n]:
            out.append(Placement(cand, i, gpus, False))
        taken[cand.tp] += n
    return out
