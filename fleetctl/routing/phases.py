"""Where a disaggregated request's two phases go: its prompt to the prefill server that
finishes it soonest, then its decode to the decode server it slows least among those with
room for it. The simulator and route-serve call the same functions.

A model is served split when some of its eligible servers have a role (`Backend.role`
"prefill" or "decode", from the plan); its colocated servers ("both") then take no new
requests of it. Prefill is compute-bound: a server's cost is the prompt tokens queued on it
(pending_prefill) plus this prompt's, less what its prefix cache holds of it, at its prefill
speed. Decode is bandwidth-bound and holds the KV cache for the whole answer: a server's cost
is the decode step it would run with this request added, stretched past the bandwidth
saturation threshold as the seed routes decode, and a server whose KV budget cannot take the
request ranks last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fleetctl.routing.policy import Pool, is_split
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.types import DECODE, PREFILL, Backend, Decision, Request

__all__ = ["DECODE", "PREFILL", "choose_decode", "choose_prefill", "in_role", "is_split"]
# Past this share of its memory bandwidth a server's decode steps slow (the router's
# bandwidth_saturation default; policy.py's saturation term, applied to decode alone).
SATURATION = 0.85


def in_role(pool: Pool, role: str) -> Pool:
    return pool.narrowed(b for b in pool if b.role == role)


def prefill_seconds(req: Request, b: Backend, cached: int) -> float:
    """Seconds until `b` has prefilled this prompt: what is queued there, then its own
    tokens not in `b`'s prefix cache, at `b`'s prefill speed (alone at its size)."""
    todo = max(1, req.prompt_tokens - cached)
    if b.perf is None:
        return float(b.outstanding + 1)  # speed unknown: fewest in flight first
    rate = todo / b.perf.prefill_time(todo)
    return (max(0, b.pending_prefill) + todo) / rate


def choose_prefill(req: Request, pool: Pool, prefix: PrefixView) -> Decision:
    """The prefill server that finishes this prompt soonest."""
    best: tuple[float, Backend, int] | None = None
    for b in pool:
        cached = prefix.cached(b.name, req.blocks) if req.blocks is not None else 0
        cost = prefill_seconds(req, b, cached)
        if best is None or cost < best[0]:
            best = (cost, b, cached)
    assert best is not None, "choose_prefill needs a server"
    cost, b, cached = best
    note = "prefix:hit" if cached else "prefix:miss" if req.blocks is not None else "prefix:none"
    return Decision(
        b,
        PREFILL,
        (note,),
        detail=f"(queued {b.pending_prefill} tokens)",
        ttft_s=cost,
        cached_tokens=cached,
        looked_up=req.blocks is not None,
    )


def decode_step(req: Request, b: Backend) -> float:
    """The decode step `b` would run with this request added (its context half generated),
    stretched where its memory bandwidth is past SATURATION; infinite without room."""
    if b.reserved_tokens + req.total_tokens > b.kv_tokens and b.outstanding > 0:
        return math.inf
    n = max(b.running, b.outstanding) + 1
    if b.perf is None:
        return float(n)
    ctx = req.prompt_tokens + req.output_tokens / 2
    step = b.perf.step_time(n, n * ctx)
    excess = b.bandwidth_util - SATURATION
    return step / max(0.1, 1 - excess / (1 - SATURATION)) if excess > 0 else step


def choose_decode(req: Request, backends: Sequence[Backend]) -> Decision | None:
    """The decode server this request slows least, among `backends` with room; None when
    none has room now (the caller waits, or falls back)."""
    best: tuple[float, int, str, Backend] | None = None
    for b in backends:
        step = decode_step(req, b)
        if not math.isfinite(step):
            continue
        key = (step, b.outstanding, b.name, b)
        if best is None or key[:3] < best[:3]:
            best = key
    if best is None:
        return None
    step, _, _, b = best
    return Decision(b, DECODE, (), detail=f"({b.outstanding} decoding)", tpot_s=step)
