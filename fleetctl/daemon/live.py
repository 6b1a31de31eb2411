"""Live backend state: /metrics scrapes, memory-bandwidth utilization (DCGM, else vLLM's
read-byte counter, else the perf model), ejection, the model name each backend serves, and each
backend's speed as measured online from its own counters.

Kept whole because scraping, ejection and the online fit act on the same per-backend state at
each scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from fleetctl.base.limits import MAX_TOKENS
from fleetctl.daemon.adapters import learn_from_metrics, learn_from_models
from fleetctl.daemon.backends import model_problem, served_name
from fleetctl.daemon.dcgm import parse_dcgm_mem_copy
from fleetctl.fleet.http import Client, HttpError, HttpTimeout
from fleetctl.model.calibration import (
    EngineFit,
    Key,
    Sample,
    engine_fit,
    entry_for,
    window,
)
from fleetctl.model.perf import weights_bytes
from fleetctl.model.startup import SLEEP_LEVELS, wake_seconds
from fleetctl.routing.types import ASLEEP, AWAKE, DRAINING, WAKING, Backend
from fleetctl.vllm.metrics import Scrape, parse_metrics

log = logging.getLogger("fleetctl.router")
MODELS_EVERY_S = 10.0  # between /v1/models reads of a backend that serves the right name
MODELS_RETRY_S = 2.0  # ... of one that does not, or gave no answer
BUSY_GRACE_S = 10.0  # a /metrics timeout is a busy server's if a request went through since
FIT_WINDOWS = 120  # decode windows (consecutive scrapes) the online fit keeps per backend
FIT_EVERY = 5  # new windows between refits
# The prefix trust is updated once the router has counted on this many cached prompt tokens
# at a backend since the last update (a few long prompts), moving this far toward the share.
PREFIX_WINDOW_TOKENS = 16_384
PREFIX_TRUST_ALPHA = 0.3
SPEED_LOG_CHANGE = 0.10  # a learned speed is logged again when it moves by more than this


def where(b: Backend) -> str:
    """How logs name a backend: its node and port (`rtx-3:8000`)."""
    port = urlsplit(b.name).port
    return b.node if port is None or b.node.endswith(f":{port}") else f"{b.node}:{port}"


@dataclass
class Liveness:
    """What the router knows about one backend's health and freshness."""

    failures: int = 0  # consecutive
    ejected_until: float = 0.0
    backoff: float = 1.0
    scraped_at: float = 0.0
    read_bytes: float | None = None
    read_at: float = 0.0
    ejections: int = 0
    answered_at: float = 0.0  # when a request through the router last went through
    last_error: str = ""  # the latest failure's reason, for the ejection log and /health
    # Why it is out of routing while it serves another model (one line with the fix), or "".
    wrong_model: str = ""
    models_due: float = 0.0  # when to read its /v1/models next
    # The Backend that reading was for: a reload makes new ones, which are checked at once.
    checked: Backend | None = None
    # The online fit: the last page's counters, the newest decode windows, what they are for
    # (GPU, model, format, TP: a reload may put another class behind the URL) and the factor.
    counters: Scrape | None = None
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=FIT_WINDOWS))
    since_fit: int = 0
    fit_key: Key | None = None
    fit: EngineFit | None = None  # the measured step terms, once trusted
    logged_step: float | None = None
    block_size: int | None = None  # its KV block size, read while on_block_size is set
    # Prefix trust: the last page's cached-prompt counter and the router's expectation then,
    # and what both grew by since the last update.
    cached_seen: float | None = None
    cached_sent: int = 0
    window_found: float = 0.0
    window_expected: float = 0.0
    # A server that joined on a reload stays out of routing until its /health answers 200
    # and it served the warm-up requests: why it is still out ("" once admitted).
    warming: str = ""
    warmed: int = 0  # warm-up requests it answered
    # When the router last set its sleep state itself (a wake it asked answered): a scrape
    # sent before then reports what was, and is not taken.
    state_set_at: float = 0.0
    wake_asked: bool = False  # the router's own /wake_up to it is under way


@dataclass
class LiveState:
    """Scrapes every backend's /metrics on an interval and keeps Backend snapshots current.

    A scrape never blocks routing: decisions read whatever is in the snapshot, and metrics
    older than `stale_after` are cleared so that routing falls back to the router's own
    counts of outstanding requests.
    """

    backends: list[Backend]
    interval: float = 0.25
    timeout: float = 1.0
    stale_after: float = 2.0
    eject_after: int = 3
    max_backoff: float = 30.0
    live: dict[str, Liveness] = field(default_factory=dict)
    # dcgm-exporter URL -> (when scraped, memory-copy utilization % by GPU index)
    dcgm: dict[str, tuple[float, dict[int, float]]] = field(default_factory=dict)
    api_key: str | None = None  # for a backend's /v1/models (vLLM's --api-key guards it)
    online_fit: bool = True  # learn each backend's speed from its scrapes (learn below)
    # Called with a backend and its KV block size when a scrape first reports it or it
    # changes (the router hashes prompts for KV events with it); None: not read.
    on_block_size: Callable[[Backend, int], None] | None = None
    # Short completions a joining server answers before it gets clients' traffic
    # (router.warmup_requests), each within warmup_timeout seconds.
    warmup_requests: int = 0
    warmup_timeout: float = 60.0
    # Called with a backend whose sleep state a scrape changed (the router looks at its
    # queue again); None: nobody is told.
    on_state: Callable[[Backend], None] | None = None
    _warmups: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def reloaded(self, backends: list[Backend]) -> None:
        """Scrape these backends from now on (route-serve's reload)."""
        self.backends = backends

    def report_block_sizes(self, to: Callable[[Backend, int], None]) -> None:
        """Call `to` with a backend and its KV block size when a scrape first reports it or
        it changes."""
        self.on_block_size = to

    def state(self, b: Backend) -> Liveness:
        return self.live.setdefault(b.name, Liveness())

    # --- joining: health first, then warm-up requests --------------------------------------------

    def joining(self, b: Backend) -> None:
        """`b` is a server that joins while the router runs (a reload: apply started it, or
        is replacing one): no traffic until its /health answers 200 and it has answered
        `warmup_requests` warm-up completions."""
        s = self.state(b)
        s.warming, s.warmed = "joining: /health not checked yet", 0
        b.healthy = False

    async def _join(self, client: Client, b: Backend) -> None:
        """One step of a joining server: its /health, then (in a task of its own, so that
        scraping the others does not wait) the warm-up requests; admitted after them."""
        s = self.state(b)
        if b.name in self._warmups:
            return  # its warm-up requests are under way
        try:
            r = await client.get(f"{b.name}/health")
            up = r.status == 200
            why = "" if up else f"/health answered {r.status}"
        except HttpError as e:
            up, why = False, f"/health: {e}"
        if not up:
            s.warming = f"joining: {why}"
            return
        if s.wrong_model:
            return  # check_model says why and readmits it once it serves the right name
        # A sleeper joins without warm-up requests: they would wait on its paused engine
        # (vLLM parks them until a wake), and its process warmed up before it slept.
        if s.warmed >= self.warmup_requests or b.state != AWAKE:
            self._admit(b)
            return
        s.warming = f"warming up: {s.warmed} of {self.warmup_requests} warm-up requests"
        task = asyncio.create_task(self._warm(b))
        self._warmups[b.name] = task
        task.add_done_callback(lambda _: self._warmups.pop(b.name, None))

    async def _warm(self, b: Backend) -> None:
        """The warm-up completions, one at a time; a failure waits for the next scrape."""
        s = self.state(b)
        while s.warmed < self.warmup_requests and s.warming:
            ok, why = await warmup_request(b, self.api_key, self.warmup_timeout)
            if not ok:
                s.warming = f"warming up: warm-up request {s.warmed + 1} failed: {why}"
                return
            s.warmed += 1
            if s.warming and s.warmed < self.warmup_requests:  # /health says how far it is
                s.warming = f"warming up: {s.warmed} of {self.warmup_requests} warm-up requests"
        if s.warming:
            self._admit(b)

    def _admit(self, b: Backend) -> None:
        s = self.state(b)
        s.warming, s.failures, s.backoff = "", 0, 1.0
        # A reload while it warmed up may have made a new Backend of the same name.
        for x in [b, *(x for x in self.backends if x.name == b.name)]:
            x.healthy = not s.wrong_model
        log.info(
            "admitted %s: /health answered 200%s",
            where(b),
            f" and it served {s.warmed} warm-up requests" if s.warmed else "",
        )

    # --- failures and ejection ---------------------------------------------------------------

    def failed(self, b: Backend, now: float, reason: str = "requests failed") -> bool:
        """Count a failure; returns True when this one ejects the backend (logged once)."""
        s = self.state(b)
        s.failures += 1
        s.last_error = reason
        if s.failures >= self.eject_after and b.healthy:
            b.healthy = False
            s.ejected_until = now + s.backoff
            log.warning(
                "ejected %s for %g s after %d failures: %s",
                where(b),
                s.backoff,
                s.failures,
                reason,
            )
            s.backoff = min(self.max_backoff, s.backoff * 2)
            s.ejections += 1
            return True
        if not b.healthy:
            s.ejected_until = now + s.backoff
        return False

    def succeeded(self, b: Backend) -> None:
        """A request went through: the backend is good."""
        s = self.state(b)
        s.answered_at = time.monotonic()
        s.failures = 0
        s.backoff = 1.0
        if not b.healthy and not s.wrong_model and not s.warming:
            b.healthy = True
            log.info("readmitted %s: a request went through", where(b))

    def busy(self, b: Backend, now: float) -> bool:
        """Whether a slow /metrics is a busy server's, not a failing one's: requests are in
        flight on it and one went through within BUSY_GRACE_S. A loaded vLLM answers /metrics
        late (its front end is streaming); ejecting it then sends its load to the others. A
        hung one stops answering requests too, and its timeouts count again."""
        return b.outstanding > 0 and now - self.state(b).answered_at < BUSY_GRACE_S

    def last_up(self, b: Backend) -> bool:
        """Whether `b` is the last of its model's awake servers in its role still in routing
        (a sleeper does not serve in its place without a wake). A slow
        /metrics does not eject that one (as a proxy's panic threshold routes to all hosts
        when too few are healthy): better a late answer than none; a refused connection or a
        failed request still does."""
        return b.healthy and not any(
            o is not b
            and o.healthy
            and o.state == AWAKE
            and o.model == b.model
            and o.role == b.role
            for o in self.backends
        )

    def probed(self, b: Backend, now: float) -> None:
        """A /metrics scrape went through. That proves less than a served request (a server can
        answer /metrics and still fail requests), so it only lets an ejected backend back in
        once its backoff has passed, half-open: its next failure ejects it again."""
        s = self.state(b)
        if not b.healthy and now >= s.ejected_until and not s.wrong_model and not s.warming:
            b.healthy = True
            s.failures = self.eject_after - 1
            log.info(
                "readmitted %s: /metrics answered (its next failure ejects it again)", where(b)
            )

    def unhealthy(self) -> dict[str, str]:
        """Each backend out of routing, and why (for route-serve's /health)."""
        out = {}
        for b in self.backends:
            if not b.healthy:
                s = self.state(b)
                out[where(b)] = (
                    s.wrong_model
                    or s.warming
                    or (
                        f"ejected after {s.failures} failures: {s.last_error}"
                        if s.last_error
                        else "ejected"
                    )
                )
        return out

    # --- the served model ----------------------------------------------------------------------

    async def check_model(self, client: Client, b: Backend) -> None:
        """Read `b`'s /v1/models: a backend that does not serve its model's name is left out of
        routing (vLLM would answer 404 to every request), with one log line that says the fix;
        it comes back once it does. An answer that is not vLLM's list gives no verdict."""
        s = self.state(b)
        s.checked = b
        want = served_name(b)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        listed: list[str] | None = None
        try:
            r = await client.get(f"{b.name}/v1/models", headers)
            if r.status == 200:
                data = r.json()["data"]
                listed = [m["id"] for m in data if isinstance(m["id"], str)]
                served_length(b, data, want)
                learn_from_models(b, data, want)
        except (HttpError, ValueError, KeyError, TypeError):
            pass
        now = time.monotonic()
        if listed is None:
            s.models_due = now + MODELS_RETRY_S
            return
        problem = model_problem(b, listed)
        s.models_due = now + (MODELS_RETRY_S if problem else MODELS_EVERY_S)
        if problem:
            if problem != s.wrong_model:
                log.error("%s; left out of routing", problem)
            b.healthy = False
        elif s.wrong_model:
            log.info('readmitted %s: it serves "%s"', where(b), want)
            b.healthy = now >= s.ejected_until and not s.warming
        s.wrong_model = problem

    # --- scraping ----------------------------------------------------------------------------

    async def read_lengths(self) -> None:
        """Each backend's /v1/models once, for those listed without a max_model_len, before
        the router listens: until it is read, length does not filter, and a request no
        server can take would reach one (vLLM's 400, not the router's). A server that does
        not answer within the timeout is read at its first scrape, as before."""
        unknown = [b for b in self.backends if not b.max_model_len]
        if not unknown:
            return
        client = Client(self.timeout)
        try:
            await asyncio.gather(*(self.check_model(client, b) for b in unknown))
        finally:
            await client.close()

    async def run(self) -> None:
        """Scrape until cancelled; every GET goes through fleetctl.fleet.http's client."""
        client = Client(self.timeout)
        try:
            while True:
                started = time.monotonic()
                backends = list(self.backends)
                dcgm_urls = {b.dcgm_url for b in backends if b.dcgm_url}
                await asyncio.gather(
                    *(self.scrape(client, b) for b in backends),
                    *(self.scrape_dcgm(client, url) for url in dcgm_urls),
                )
                self.apply_dcgm(backends, time.monotonic())
                self.expire_all(time.monotonic())
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))
        finally:
            for task in list(self._warmups.values()):
                await cancel(task)
            await client.close()

    async def scrape(self, client: Client, b: Backend) -> None:
        s = self.state(b)
        if s.checked is not b or time.monotonic() >= s.models_due:
            await self.check_model(client, b)  # at start, after a reload, then now and then
        if s.warming:
            await self._join(client, b)
        now = time.monotonic()
        if not b.healthy and now < s.ejected_until:
            return  # backing off; the next scrape after the backoff is the probe
        asked = time.monotonic()
        try:
            r = await client.get(f"{b.name}/metrics")
            if r.status != 200:
                raise HttpError(f"answered {r.status}")
        except HttpError as e:
            now = time.monotonic()
            if not (isinstance(e, HttpTimeout) and (self.busy(b, now) or self.last_up(b))):
                self.failed(b, now, f"/metrics {e}")
            self.expire(b, now)
            return
        self.apply(b, r.text, time.monotonic(), asked)
        self.probed(b, time.monotonic())

    def apply(self, b: Backend, text: str, now: float, asked: float | None = None) -> None:
        """One /metrics page (asked for at `asked`), parsed once for routing and the online
        fit alike."""
        m = replace(parse_metrics(text), at=now)
        learn_from_metrics(b, text)
        s = self.state(b)
        s.scraped_at = now
        if m.sleeping is not None and (asked is None or asked >= s.state_set_at):
            self.learn_sleep(b, m.sleeping, m.sleep_level or 0, m.waking)
        b.running = int(m.running or 0)
        b.waiting = int(m.waiting or 0)
        b.kv_usage = m.kv_usage or 0.0
        if m.kv_tokens:
            b.kv_tokens = m.kv_tokens  # the server's real capacity wins
        if m.read_bytes is not None and b.perf is not None:
            if s.read_bytes is not None and now > s.read_at and m.read_bytes >= s.read_bytes:
                rate = (m.read_bytes - s.read_bytes) / (now - s.read_at)
                peak = b.perf.gpu.memory_bandwidth_gb_s * 1e9
                b.bandwidth_util = min(1.0, rate / peak)
            s.read_bytes, s.read_at = m.read_bytes, now
        elif b.perf is not None:
            b.bandwidth_util = modelled_bandwidth(b)
        if self.on_block_size is not None:
            size = m.block_size
            if size is not None and size != s.block_size:
                s.block_size = size
                self.on_block_size(b, size)
        self.learn_prefix(b, m)
        self.learn(b, m)

    def learn_sleep(
        self, b: Backend, sleeping: bool, level: int, waking: bool | None = None
    ) -> None:
        """What its vllm:engine_sleep_state says: a server put to sleep (by hand, or before
        the state file says so) is asleep from now, so it gets no request it would park; one
        awake again serves. A wake under way (vllm:sleep_mode_operations_in_flight, whoever
        asked it: the autopilot, an operator) makes it waking, ready about its wake's seconds
        from now, so no second wake is asked and hardware-aware can weigh what is left; a
        wake someone else asked that ended asleep (out of memory) leaves it asleep."""
        before = b.state
        s = self.state(b)
        if sleeping and waking and b.state in (AWAKE, DRAINING, ASLEEP):
            b.state, b.ready_at = WAKING, time.monotonic() + (b.wake_s or 0.0)
        elif sleeping and (
            b.state in (AWAKE, DRAINING)
            or (waking is False and b.state == WAKING and not s.wake_asked)
        ):
            b.state = ASLEEP
        elif not sleeping and b.state in (ASLEEP, WAKING):
            b.state = AWAKE
        if sleeping and level != b.sleep_level and level in SLEEP_LEVELS:
            b.sleep_level = level
            b.wake_s = expected_wake_s(b, level)
        if b.state != before:
            log.info("%s is %s (its /metrics say so)", where(b), b.state)
            if self.on_state is not None:
                self.on_state(b)

    def set_state(self, b: Backend, state: str) -> None:
        """The router set `b`'s sleep state itself (its wake answered): scrapes asked for
        before now are not taken over it."""
        b.state = state
        self.state(b).state_set_at = time.monotonic()

    def learn_prefix(self, b: Backend, m: Scrape) -> None:
        """How much of the prefix the router expects a backend to hold it really finds: the
        growth of its vllm:prompt_tokens_cached_total against the cached tokens the router
        counted on for what it sent there, once PREFIX_WINDOW_TOKENS are expected, averaged
        (it becomes `b.prefix_trust`, hardware-aware's discount on its prefix term)."""
        s = self.state(b)
        found, sent = m.prompt_cached, b.cached_sent
        if found is None:
            return
        if s.cached_seen is not None and found >= s.cached_seen and sent >= s.cached_sent:
            s.window_found += found - s.cached_seen
            s.window_expected += sent - s.cached_sent
            if s.window_expected >= PREFIX_WINDOW_TOKENS:
                share = min(1.0, s.window_found / s.window_expected)
                b.prefix_trust += PREFIX_TRUST_ALPHA * (share - b.prefix_trust)
                s.window_found = s.window_expected = 0.0
        s.cached_seen, s.cached_sent = found, sent

    def learn(self, b: Backend, counters: Scrape) -> None:
        """The online fit: one window per pair of consecutive scrapes that decoded something,
        refitted every FIT_EVERY windows; once calibration's trust rules pass, `b.perf` runs
        with the measured step terms (logged when first measured and when the speed or the
        fixed step cost moves by over 10%)."""
        s = self.state(b)
        before, s.counters = s.counters, counters
        if b.perf is None or not self.online_fit:
            return
        key = Key(b.gpu_type, b.perf.model.name, b.variant, b.perf.tp)
        if key != s.fit_key:  # a new class behind this URL: what was learned is not its
            s.fit_key, s.fit, s.logged_step, s.since_fit = key, None, None, 0
            s.samples.clear()
        if s.fit is not None and s.fit.apply(b.perf) != b.perf:
            b.perf = s.fit.apply(b.perf)  # a reload's fresh Backend keeps it
        sample = window(before, counters) if before is not None else None
        if sample is None or sample.tokens <= 0:
            return
        s.samples.append(sample)
        s.since_fit += 1
        if s.since_fit < FIT_EVERY:
            return
        s.since_fit = 0
        # Measured over the model's own terms, not over terms applied earlier.
        model = replace(b.perf, speed=1.0, compute_speed=None, overhead_s=None, per_seq_s=0.0)
        entry = entry_for(key, [b.name], list(s.samples), [], "online", perf=model)
        fit = engine_fit(entry, model)
        if fit is None:
            return
        # Decode speed only: a prefill compute factor from live windows came out biased (the
        # skewed fleet replay kept 4-59% of hardware-aware's p99 lead with it, 91% without;
        # benchmarks/results/fleet_replay.md). `fleetctl calibrate` and the start-up
        # calibration keep it.
        fit = replace(fit, compute_speed=None)
        s.fit = fit
        b.perf = fit.apply(model)
        # One number to watch for moves: the step at batch 1 with the measured terms.
        moved = b.perf.step_time(1, 512)
        last = s.logged_step
        if last is None or abs(moved / last - 1.0) > SPEED_LOG_CHANGE:
            log.info("%s: measured %s over %d windows", where(b), fit.text(), len(s.samples))
            s.logged_step = moved

    async def scrape_dcgm(self, client: Client, url: str) -> None:
        """One node's dcgm-exporter page; a failure only leaves the last reading to go stale."""
        with contextlib.suppress(HttpError):
            r = await client.get(url)
            if r.status == 200:
                self.dcgm[url] = (time.monotonic(), parse_dcgm_mem_copy(r.text))

    def apply_dcgm(self, backends: list[Backend], now: float) -> None:
        """DCGM's reading wins over vLLM's counter and the model where it is fresh: it is the
        device's own measure, and it also sees memory traffic of processes besides vLLM. A
        server on several GPUs counts as busy as its busiest one (TP steps wait for it)."""
        for b in backends:
            reading = self.dcgm.get(b.dcgm_url) if b.dcgm_url else None
            if reading is None or now - reading[0] > self.stale_after:
                continue
            values = [reading[1][g] for g in b.gpus if g in reading[1]]
            if values:
                b.bandwidth_util = min(1.0, max(values) / 100.0)

    def expire(self, b: Backend, now: float) -> None:
        """Forget scraped figures that are too old to trust."""
        if now - self.state(b).scraped_at > self.stale_after:
            b.running = b.waiting = 0
            b.kv_usage = 0.0
            b.bandwidth_util = modelled_bandwidth(b) if b.perf is not None else 0.0

    def expire_all(self, now: float) -> None:
        for b in self.backends:
            self.expire(b, now)


def served_length(b: Backend, data: list[dict[str, object]], name: str) -> None:
    """The max_model_len vLLM lists for the model `b` serves as `name` wins over what the
    state or backends file said (a backends file may leave it out): the router filters
    requests by it, and servers of different lengths are length classes."""
    for m in data:
        length = m.get("max_model_len")
        if m.get("id") == name and type(length) is int and 0 < length <= MAX_TOKENS:
            if b.max_model_len and length != b.max_model_len:  # learning an unknown one is quiet
                log.warning(
                    "%s: serves max_model_len %d, not the %d it was listed with; routing by %d",
                    where(b),
                    length,
                    b.max_model_len,
                    length,
                )
            b.max_model_len = length
            return


def modelled_bandwidth(b: Backend) -> float:
    """Bandwidth utilization from the perf model when the server reports no read-byte rate:
    the decode batch the router knows of, at a typical context."""
    if b.perf is None:
        return 0.0
    batch = max(b.running, b.outstanding)
    if not batch:
        return 0.0
    kv = batch * 1024
    step = b.perf.step_time(batch, kv)
    read = b.perf.weight_read_bytes(batch) / b.perf.tp + kv * b.perf.kv_token_bytes
    return min(1.0, read / step / (b.perf.gpu.memory_bandwidth_gb_s * 1e9))


WARMUP_PROMPT = "Hello"
WARMUP_MAX_TOKENS = 8


async def warmup_request(b: Backend, api_key: str | None, timeout: float) -> tuple[bool, str]:
    """One short completion sent to `b` by the router itself: (answered 200, why not)."""
    import aiohttp

    body = {
        "model": served_name(b),
        "prompt": WARMUP_PROMPT,
        "max_tokens": WARMUP_MAX_TOKENS,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session,
            session.post(
                f"{b.name}/v1/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as r,
        ):
            await r.read()
            return r.status == 200, f"answered {r.status}"
    except TimeoutError:
        return False, f"no answer in {timeout:g} s"
    except (aiohttp.ClientError, OSError) as e:
        return False, type(e).__name__


def expected_wake_s(b: Backend, level: int) -> float | None:
    """Seconds `b` takes to wake from `level` (model/startup.wake_seconds); None without a
    model of its class."""
    p = b.perf
    if p is None:
        return b.wake_s
    return wake_seconds(p.gpu, weights_bytes(p.model, p.fmt), p.tp, level)


async def wake_request(b: Backend, api_key: str | None, timeout: float) -> tuple[bool, str]:
    """vLLM's POST /wake_up to `b` (a dev endpoint: only route-serve and the autopilot reach
    it, never a client): (awake, why not). vLLM answers once the weights are back."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with (
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session,
            session.post(
                f"{b.name}/wake_up",
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
            ) as r,
        ):
            text = await r.text()
            if r.status != 200:
                return False, f"answered {r.status}: {text[:200]}"
            try:
                status = json.loads(text).get("status")
            except (ValueError, AttributeError):
                status = None
            return status == "awake", f"answered status {status!r}"
    except TimeoutError:
        return False, f"no answer in {timeout:g} s"
    except (aiohttp.ClientError, OSError) as e:
        return False, type(e).__name__


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
