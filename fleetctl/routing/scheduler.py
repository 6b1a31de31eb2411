"""The admission queue: priority classes, KV-derived per-backend caps, and aging.

Pure: time is passed in. A request waits router-side when every backend that may serve it is
at its cap, so priorities mean something: classes are served strictly in order, except that a
request that has waited longer than `factor` x the median TTFT of the last `window_s` seconds
is boosted to the top class (the seed's aging rule), so low-priority requests cannot starve.
The TTFT fed to that median is the backends' (dispatch to first token): TTFT as clients see
it includes router queueing, so under sustained overload the threshold would grow with the
backlog and never fire.
Within a class, requests go in arrival order; a request that cannot be placed does not stop
others of its class (they may fit other backends), but it does stop lower classes.
Baseline policies (no admission) forward everything at once, as the peer routers do.
A retry is an ordinary entry: the same request (priority, arrival) submitted again with the
backends that failed it in `Request.exclude`, so it keeps its place and obeys the caps.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fleetctl.routing.goodput import prompt_prefill_s
from fleetctl.routing.phases import (
    DECODE,
    PREFILL,
    choose_decode,
    choose_prefill,
    in_role,
    is_split,
)
from fleetctl.routing.policy import Policy, warm_pool
from fleetctl.routing.types import (
    ASLEEP,
    AWAKE,
    WAKING,
    Backend,
    Decision,
    Request,
    can_serve,
)

TOP = 0
# Seconds over which the prompt tokens sent to each backend are averaged into its prefill
# rate: about one request's decode, the span whose prompts will share its steps. Azure's
# bursts outrun a longer window (20 s: the estimated TPOT of the A100s fell to a fifth of
# what they did in a burst of 4K-token prompts; benchmarks/results/goodput.md).
PREFILL_WINDOW_S = 5.0
# After the first request of a class that must wait, look this many further for smaller ones
# that fit elsewhere (backfill); deeper requests wait for the next dispatch. Bounds the work
# per dispatch when thousands queue.
BACKFILL_SCAN = 32


@dataclass
class Aging:
    factor: float = 2.0
    window_s: float = 60.0
    enabled: bool = True


class RollingMedian:
    """Median of the values observed in the last `window` seconds."""

    def __init__(self, window: float):
        self.window = window
        self.events: deque[tuple[float, float]] = deque()
        self.sorted: list[float] = []

    def add(self, now: float, value: float) -> None:
        self.events.append((now, value))
        bisect.insort(self.sorted, value)
        self.expire(now)

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] < now - self.window:
            _, v = self.events.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, v)]

    def median(self, now: float) -> float | None:
        self.expire(now)
        n = len(self.sorted)
        if not n:
            return None
        mid = n // 2
        return self.sorted[mid] if n % 2 else (self.sorted[mid - 1] + self.sorted[mid]) / 2


@dataclass
class Dispatch:
    request: Request
    decision: Decision


@dataclass
class Scheduler:
    policy: Policy
    aging: Aging = field(default_factory=Aging)
    kv_overcommit: float = 1.0
    boosts: int = 0
    # The backends' recent TTFTs the aging threshold is the median of: this scheduler's own
    # window unless given one (route-serve's replicas share theirs through Redis).
    ttft_window: RollingMedian | None = None
    # Whether requests queue router-side within KV-derived caps; None: as the policy
    # declares (Policy.admission). The simulator may turn it on or off for any policy.
    admission: bool | None = None

    def __post_init__(self) -> None:
        self.ttft = self.ttft_window or RollingMedian(self.aging.window_s)
        self.admits = self.policy.admission if self.admission is None else self.admission
        # One FIFO per priority class; the top class is kept sorted by arrival because
        # boosted requests join it from below.
        self.classes: dict[int, deque[Request]] = {}
        # Servers a dispatch chose while they slept, now marked waking: the caller asks each
        # for its wake (route-serve: POST /wake_up) and takes them from here.
        self.woken: list[Backend] = []
        # Requests held for a server's warm-up, by id: the warm-up they waited for ("wake"
        # when theirs was asked, else "waking"), noted on their decision once placed.
        self.held_for: dict[object, str] = {}

    @property
    def queue(self) -> list[Request]:
        return [r for prio in sorted(self.classes) for r in self.classes[prio]]

    def __len__(self) -> int:
        return sum(len(q) for q in self.classes.values())

    def submit(self, req: Request) -> None:
        prio = TOP if req.boosted else max(TOP, req.priority)
        q = self.classes.setdefault(prio, deque())
        if q and q[-1].arrival > req.arrival:
            bisect.insort(q, req, key=lambda r: r.arrival)
        else:
            q.append(req)

    def observe_ttft(self, now: float, ttft: float) -> None:
        self.ttft.add(now, ttft)

    def remove(self, req: Request) -> None:
        """Take a queued request out (its client gave up)."""
        self.held_for.pop(req.id, None)
        for prio, q in list(self.classes.items()):
            if req in q:
                q.remove(req)
                if not q:
                    del self.classes[prio]
                return

    def aging_threshold(self, now: float) -> float | None:
        """Seconds of waiting after which a request is boosted, or None (no TTFT seen yet)."""
        if not self.aging.enabled:
            return None
        median = self.ttft.median(now)
        return None if median is None else self.aging.factor * median

    def _age(self, now: float) -> None:
        """Move requests that waited past the threshold into the top class (oldest first)."""
        threshold = self.aging_threshold(now)
        if threshold is None:
            return
        for prio in sorted(p for p in self.classes if p > TOP):
            q = self.classes[prio]
            while q and now - q[0].arrival > threshold:
                req = q.popleft()
                req.boosted = True
                self.boosts += 1
                self.submit(req)

    def has_room(self, b: Backend, req: Request) -> bool:
        if not self.admits:
            return True
        if b.outstanding >= b.max_num_seqs:
            return False
        # Always admit into an empty backend, or a request bigger than the cache never runs.
        fits = b.reserved_tokens + req.total_tokens <= b.kv_tokens * self.kv_overcommit
        return fits or b.outstanding == 0

    def dispatch(
        self, now: float, backends: Sequence[Backend]
    ) -> tuple[list[Dispatch], list[Dispatch]]:
        """Place what can be placed now: (dispatched, rejected). Each dispatched request is
        already accounted on its backend (outstanding, reserved tokens, pending prefill)."""
        sent: list[Dispatch] = []
        rejected: list[Dispatch] = []
        if not self.classes:
            return sent, rejected
        for b in backends:
            decay(b, now)
        self._age(now)
        for prio in sorted(self.classes):
            q = self.classes[prio]
            keep: deque[Request] = deque()
            blocked = False
            # A request that found no room rules out later ones that are no smaller and ask
            # for the same thing, so a long queue is not re-examined request by request.
            no_room: dict[tuple[object, ...], int] = {}
            # Likewise a request that chose to wait for a warm-up: in a burst past the awake
            # servers, thousands queue for the servers being woken or started, and weighing
            # each of them against every backend at every event stalled a simulated hour of
            # the dynamo burst for over fifteen minutes.
            warming: dict[tuple[object, ...], int] = {}
            # Backends a blocked request waits for when only some of its model's backends may
            # take it (a prompt too long for the others, a strict format, a session's class):
            # later ones backfill elsewhere, never into the room it waits for, or it would
            # wait for ever while requests with a choice take each bit of room as it frees
            # (EASY backfilling's reservation). One that could go anywhere holds nothing:
            # backfilling around it is what keeps the mean low.
            held: set[str] = set()
            scan = BACKFILL_SCAN
            while q:
                if blocked:
                    scan -= 1
                    if scan < 0:
                        break
                if self.admits and not any(b.outstanding < b.max_num_seqs for b in backends):
                    blocked = True
                    break
                req = q.popleft()
                sig = (req.model, req.adapter, req.precision, req.strict, req.session, req.exclude)
                if req.total_tokens >= no_room.get(sig, 1 << 62):
                    keep.append(req)
                    continue
                if req.total_tokens >= warming.get(sig, 1 << 62):
                    self.held_for.setdefault(req.id, "waking")
                    keep.append(req)
                    continue
                ok = [b for b in backends if b.name not in req.exclude] if req.exclude else backends
                pool, why = self.policy.eligible(req, ok)
                if not pool:
                    self.held_for.pop(req.id, None)
                    rejected.append(Dispatch(req, Decision.rejected(why, all_down(req, ok))))
                    continue
                pool.now = now
                serving = sum(1 for b in ok if b.model == req.model and b.healthy and can_serve(b))
                restricted = len(pool) < serving
                if held:
                    pool = pool.narrowed(b for b in pool if b.name not in held)
                    if not pool:
                        keep.append(req)
                        continue
                # The policy weighs every eligible backend, full ones too: waiting here for the
                # best one can beat taking a slower one that has room (its estimate says). A
                # disaggregated model's request goes to a prefill server first; its decode
                # server is chosen when the prompt is done (decode_for).
                if is_split(pool):
                    # By the prefill queue alone (no warm-up weighed): awake servers first.
                    prefill = in_role(pool, PREFILL)
                    prefill = prefill.narrowed(warm_pool(list(prefill), weighs=False))
                    decision = choose_prefill(req, prefill, self.policy.prefix)
                else:
                    decision = self.policy.choose(req, pool)
                assert decision.backend is not None
                if decision.backend.state != AWAKE:
                    # It waits here, not on the server, for the warm-up to end: a request
                    # never reaches a sleeping engine (vLLM would park it, and hold it for
                    # ever if the wake failed). Others go on: they may have awake servers.
                    self._warm_up(decision.backend, now, req)
                    warming[sig] = min(warming.get(sig, 1 << 62), req.total_tokens)
                    keep.append(req)
                    continue
                if not self.has_room(decision.backend, req):
                    blocked = True
                    no_room[sig] = min(no_room.get(sig, 1 << 62), req.total_tokens)
                    if restricted:
                        held.add(decision.backend.name)
                    keep.append(req)
                    continue
                chosen = decision.backend
                waited = self.held_for.pop(req.id, None)
                if waited is not None:
                    decision = replace(decision, notes=(*decision.notes, f"after:{waited}"))
                self.policy.placed(req, chosen, decision)
                account(chosen, req, now)
                sent.append(Dispatch(req, decision))
            keep.extend(q)
            if keep:
                self.classes[prio] = keep
            else:
                del self.classes[prio]
            if blocked:
                break  # strict priority: lower classes wait while this one is blocked
        return sent, rejected

    def _warm_up(self, b: Backend, now: float, req: Request) -> None:
        """`req` waits for `b`'s warm-up; an asleep `b` is marked waking until about
        `wake_s` from now, and listed in `woken` for its wake to be asked."""
        if b.state == ASLEEP:
            b.state, b.ready_at = WAKING, now + (b.wake_s or 0.0)
            self.woken.append(b)
            self.held_for[req.id] = "wake"
        else:
            self.held_for.setdefault(req.id, "waking")

    def take_woken(self) -> list[Backend]:
        """The servers to wake that dispatches chose since the last call."""
        out, self.woken = self.woken, []
        return out

    def decode_for(
        self, req: Request, backends: Sequence[Backend], force: bool = False
    ) -> Decision | None:
        """The decode server for a request a prefill server has prefilled: a rejection where
        none may serve it, None while none has room (ask again when one frees; with `force`,
        the one with fewest requests, whose vLLM queues it). The chosen one holds the
        request's KV from now (its transfer starts) until release()."""
        decoders = [b for b in backends if b.role == DECODE]
        pool, why = self.policy.eligible(req, decoders)
        if not pool:
            why = why or f"no decode server serves {req.model}"
            return Decision.rejected(why, all_down(req, decoders))
        # The KV moves at once: only an awake decode server (the router wakes none for it).
        pool = pool.narrowed(b for b in pool if b.state == AWAKE)
        if not pool:
            return Decision.rejected(f"no awake decode server serves {req.model}", True)
        decision = choose_decode(req, pool)
        if decision is None and force:
            least = min(pool, key=lambda b: (b.outstanding, b.name))
            decision = Decision(least, DECODE, ("full",), detail=f"({least.outstanding} decoding)")
        if decision is not None and decision.backend is not None:
            decision.backend.outstanding += 1
            decision.backend.reserved_tokens += req.total_tokens
            self.policy.decoding(req, decision.backend)
        return decision


def account(b: Backend, req: Request, now: float) -> None:
    b.outstanding += 1
    b.reserved_tokens += req.total_tokens
    b.pending_prefill += req.prefill_tokens
    b.pending_prefill_s += prompt_prefill_s(b, req)
    b.cached_sent += req.cached_tokens
    decay(b, now)
    b.prefill_rate += req.prefill_tokens / PREFILL_WINDOW_S


def decay(b: Backend, now: float) -> None:
    """Age `b`'s prefill rate to `now`: an exponentially weighted average over
    PREFILL_WINDOW_S, so each prompt counts once, spread over the window after it was sent."""
    if now > b.rate_at:
        b.prefill_rate *= math.exp((b.rate_at - now) / PREFILL_WINDOW_S)
    b.rate_at = max(b.rate_at, now)


def first_token(b: Backend, req: Request) -> None:
    b.pending_prefill -= req.prefill_tokens
    b.pending_prefill_s = max(0.0, b.pending_prefill_s - prompt_prefill_s(b, req))


def release(b: Backend, req: Request, first_token_seen: bool = True) -> None:
    b.outstanding -= 1
    b.reserved_tokens -= req.total_tokens
    if not first_token_seen:
        b.pending_prefill -= req.prefill_tokens
        b.pending_prefill_s = max(0.0, b.pending_prefill_s - prompt_prefill_s(b, req))


def all_down(req: Request, backends: Sequence[Backend]) -> bool:
    """Whether `req`'s model has servers here and every one is out of routing (ejected,
    warming up): no fault of the request's, so the client hears 503, not 400."""
    mine = [b for b in backends if b.model == req.model]
    if req.adapter:  # an adapter's: the servers that have it loaded
        mine = [b for b in mine if req.adapter in b.adapters]
    return bool(mine) and not any(b.healthy and can_serve(b) for b in mine)
