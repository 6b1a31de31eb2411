"""State several router replicas share through Redis: session pins, the aging window (the
median TTFT over it), and what each replica's prefix index learns.

Nothing a request does waits on Redis beyond READ_WAIT_S, and most requests cost no round trip:

- Session pins live in each replica's memory (SharedSessions, at most route-serve's
  --max-sessions, least recently used first out). A pin is decided locally by the policy,
  then queued; one writer task sends the queue BATCH pins per round trip through a Lua script
  that keeps, per session, the pin with the highest version (last writer wins) and publishes
  each accepted one on the pins channel. Every replica applies what that channel carries to
  its memory, so a turn that reaches another replica finds its pin there. A session this
  replica has not seen costs one read (MGET, batched with the other requests' reads); the
  request waits for it at most READ_WAIT_S, then goes on without.
- A version is the writer's wall clock in microseconds (never below the last it issued or
  saw) and its 8-character replica id: `00001733091234567890:ab12cd34`. Versions compare as
  strings, so the Lua script, the subscribers and a replica reconciling all agree which pin
  is last.
- The aging window: each replica summarises each second of its TTFT samples (the count and
  TTFT_POINTS quantiles), keeps the summaries of the last window in one key of its own, and
  merges every replica's keys once a second into the weighted median the scheduler ages by.
- The prefix index's updates travel on a pub/sub channel (fleetctl/daemon/prefix_share.py).

In Redis: a pin is a string key `fleetctl:NS:session:ID`, ID the session's 32-character
digest (routing/sessions.py session_key), ~90 bytes plus the class and node names, that
expires SESSION_TTL_S after its last write; a replica's TTFT summaries are one key
(`ttft:ID`, ~6 KB for a 30 s window) that expires window + 10 s after its last write, listed
in the sorted set `ttft:replicas`; pub/sub messages are not stored (Redis bounds each
subscriber's backlog by its client-output-buffer-limit for pubsub: 32 MB by default).

When Redis fails, every replica goes on with its own state: pins it decides are queued (at
most PENDING_MAX, the oldest dropped past that, and counted), the scheduler ages by this
replica's own TTFT window, and the prefix index learns from its own placements. The replica
says so once in its log, `/health` reports "degraded" with the reason, and `/metrics` counts
the outage. When Redis returns (the pins channel subscribes again) the replica sends the pins
it decided meanwhile, each with its version: the script keeps the last writer's, and a replica
whose pin lost adopts the winner (counted as a conflict). Pins it held from before are
re-read once on their next use, since another replica may have changed them meanwhile; one
Redis no longer holds (restarted empty) is written back from memory.

Kept whole because the pins, the aging window and the outage handling share one connection, one
writer and one version scheme, described above.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleetctl.base.errors import UserError
from fleetctl.routing.scheduler import RollingMedian
from fleetctl.routing.sessions import SESSIONS_MAX, Pin, SessionTable

log = logging.getLogger("fleetctl.router")

PREFIX = "fleetctl:"
SESSION_TTL_S = 24 * 3600  # a pin in Redis expires this long after its last write
PENDING_MAX = 200_000  # pins waiting to be written (while Redis is away)
READ_WAIT_S = 0.05  # the longest a request waits for a pin read
BATCH = 512  # pins per write or read round trip
POOL = 16  # connections: the background tasks' (writes and reads are batched, not per request)
RETRY_S = 0.5  # while Redis is away, how often to try again
TTFT_POINTS = 16  # quantiles kept per replica per second of TTFT samples
TTFT_BUFFER = 4096  # samples kept per second for them (a uniform sample past that)
STAMP = 29  # a version's characters: 20 digits, ':', the replica id
# What happens to pins, counted (fleetctl_session_store_pins_total, telemetry.py says each).
PIN_EVENTS = (
    "written",
    "applied",
    "conflicts",
    "read",
    "read_timeout",
    "write_timeout",
    "dropped",
    "restored",
)

# Keep, per session, the pin with the highest version; publish those kept, in one message (a
# JSON list of `KEY\nSTAMP\nclass\nnode`). KEYS: the sessions' keys; ARGV: the TTL, the
# channel, then one `STAMP\nclass\nnode` per key. Returns, per key, "" when kept, else the
# value that won.
WRITE_PINS = """
local out = {}
local kept = {}
for i, key in ipairs(KEYS) do
  local new = ARGV[i + 2]
  local cur = redis.call('GET', key)
  if cur and string.sub(cur, 1, 29) >= string.sub(new, 1, 29) then
    if string.sub(cur, 1, 29) == string.sub(new, 1, 29) then
      redis.call('EXPIRE', key, ARGV[1])
      out[i] = ''
    else
      out[i] = cur
    end
  else
    redis.call('SET', key, new, 'EX', ARGV[1])
    kept[#kept + 1] = key .. '\\n' .. new
    out[i] = ''
  end
end
if #kept > 0 then
  redis.call('PUBLISH', ARGV[2], cjson.encode(kept))
end
return out
"""


@dataclass(slots=True)
class Known:
    """What a replica knows of a pin: its version and the recovery epoch it was last
    confirmed in (pins of an earlier epoch are re-read on their next use)."""

    stamp: str
    epoch: int


def encode_pin(stamp: str, pin: Pin) -> str:
    return f"{stamp}\n{pin.node_class}\n{pin.node}"


def decode_pin(raw: bytes | str) -> tuple[str, Pin]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    stamp, node_class, node = text.split("\n", 2)
    if len(stamp) != STAMP:
        raise ValueError("malformed pin")
    return stamp, Pin(node_class, node)


class SharedSessions(SessionTable):
    """The policy's session table, kept in step with the other replicas: `set` (the policy
    placing a session's turn) queues the pin for Redis; `adopt` takes another replica's."""

    def __init__(self, store: RedisShared, capacity: int = SESSIONS_MAX):
        super().__init__(capacity)
        self.known: dict[str, Known] = {}
        self.store = store

    def set(self, session: str, pin: Pin) -> None:
        stamp = self.store.stamp()
        self._put(session, pin, stamp)
        self.store.queue_pin(session, pin, stamp)

    def adopt(self, session: str, pin: Pin, stamp: str) -> bool:
        """Another replica's pin (or Redis's): kept when newer than ours."""
        self.store.saw(stamp)
        k = self.known.get(session)
        if k is not None and k.stamp >= stamp:
            if k.stamp == stamp:
                k.epoch = self.store.epoch
            return False
        self._put(session, pin, stamp)
        self.store.pending.pop(session, None)  # ours lost: no need to send it
        return True

    def touch(self, session: str) -> None:
        if session in self.pins:
            self.pins.move_to_end(session)

    def _put(self, session: str, pin: Pin, stamp: str = "") -> None:
        self.known[session] = Known(stamp, self.store.epoch)
        super()._put(session, pin)

    def forget(self, session: str) -> None:
        self.known.pop(session, None)


class SharedMedian(RollingMedian):
    """The scheduler's TTFT window: this replica's samples (as RollingMedian keeps them), and
    the median over every replica's, merged once a second, while Redis is up."""

    def __init__(self, window: float, store: RedisShared):
        super().__init__(window)
        self.store = store
        self.second: list[float] = []  # this second's samples (a uniform sample past the cap)
        self.count = 0
        self.merged: float | None = None
        self.merged_at = -1e9

    def add(self, now: float, value: float) -> None:
        super().add(now, value)
        self.count += 1
        if len(self.second) < TTFT_BUFFER:
            self.second.append(value)
        else:
            i = random.randrange(self.count)
            if i < TTFT_BUFFER:
                self.second[i] = value

    def median(self, now: float) -> float | None:
        if self.store.up and now - self.merged_at < 3.0 and self.merged is not None:
            return self.merged
        return super().median(now)

    def take_second(self) -> tuple[int, list[float]]:
        """This second's count and quantiles, and a fresh second."""
        count, values = self.count, sorted(self.second)
        self.count, self.second = 0, []
        if len(values) <= TTFT_POINTS:
            return count, values
        n = len(values)
        return count, [values[(2 * i + 1) * n // (2 * TTFT_POINTS)] for i in range(TTFT_POINTS)]


def _release(waiters: list[asyncio.Future[bool]]) -> None:
    for w in waiters:
        if not w.done():
            w.set_result(True)


def weighted_median(points: list[tuple[float, float]]) -> float | None:
    """The median of (value, weight) points."""
    if not points:
        return None
    points.sort()
    half = sum(w for _, w in points) / 2
    run = 0.0
    for i, (v, w) in enumerate(points):
        run += w
        if run > half + 1e-9:
            return v
        if abs(run - half) <= 1e-9 and i + 1 < len(points):
            return (v + points[i + 1][0]) / 2
    return points[-1][0]


class RedisShared:
    """Session pins, the TTFT window and the prefix channel in Redis (`redis://host:port/db`)."""

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        pool: int = POOL,
        max_sessions: int = SESSIONS_MAX,
    ):
        try:
            import redis.asyncio as redis
        except ImportError:
            raise UserError(
                "--session-store redis:// needs the redis package",
                None,
                "pip install 'fleetctl[redis]'",
            ) from None
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as Closed

        # A blocking pool: a task waits (at most 1 s) for a free connection, never fails for
        # want of one. Requests do not take connections: reads and writes are batched. A
        # command on a connection Redis closed (it restarted) is tried once more, on a new
        # one, at once; a timeout is not (Redis is stuck: say so).
        self.pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=pool,
            timeout=1.0,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=Retry(NoBackoff(), 1, (Closed,)),
        )
        self.client: Any = redis.Redis(connection_pool=self.pool)
        self.ns = f"{PREFIX}{namespace}:"
        self.me = uuid.uuid4().hex[:8]
        self._write = self.client.register_script(WRITE_PINS)
        self._last = 0
        # Health: None until the first contact, then whether Redis answers.
        self.up: bool | None = None
        self.reason = "not connected yet"
        self.since = time.monotonic()
        self.epoch = 0  # +1 at each recovery
        self.outages = self.errors = 0
        self.counts = dict.fromkeys(PIN_EVENTS, 0)
        self.sessions = SharedSessions(self, max_sessions)
        self.pending: OrderedDict[str, tuple[Pin, str]] = OrderedDict()
        self._reads: dict[str, list[asyncio.Future[bool]]] = {}  # reads asked, their waiters
        self._acks: dict[str, list[asyncio.Future[bool]]] = {}  # answers waiting for a write
        self._wake_writer = asyncio.Event()
        self._wake_reader = asyncio.Event()
        self.median: SharedMedian | None = None
        self._ttft_own: deque[tuple[int, int, list[float]]] = deque()
        self.subscribed = asyncio.Event()  # the pins channel is listened to
        self._sending: set[str] = set()  # the sessions of the write in flight

    # --- versions and health --------------------------------------------------------------

    def new_identity(self) -> None:
        """A new replica id (a worker forked from a router built once)."""
        self.me = uuid.uuid4().hex[:8]

    def stamp(self) -> str:
        """A new version: later than any this replica issued or saw."""
        self._last = max(time.time_ns() // 1000, self._last + 1)
        return f"{self._last:020d}:{self.me}"

    def saw(self, stamp: str) -> None:
        with contextlib.suppress(ValueError):
            self._last = max(self._last, int(stamp[:20]))

    def down(self, e: BaseException) -> None:
        """Redis failed: say so once, then run on this replica's own state."""
        self.errors += 1
        if self.up is False:
            return
        self.up = False
        self.outages += 1
        self.since = time.monotonic()
        self.reason = f"{type(e).__name__}: {str(e)[:160]}" if str(e) else type(e).__name__
        log.warning(
            "session store down (%s): this replica routes on its own pins, aging window and "
            "prefix index until it returns",
            self.reason,
        )
        for waiting in (*self._reads.values(), *self._acks.values()):
            _release(waiting)
        self._reads.clear()
        self._acks.clear()

    def back(self) -> None:
        if self.up:
            return
        if self.up is False:
            log.warning(
                "session store back after %.1f s: sending %d pins decided meanwhile (last "
                "writer wins); re-reading the others on their next use",
                time.monotonic() - self.since,
                len(self.pending),
            )
        else:
            log.info("session store: connected (replica %s)", self.me)
        self.up = True
        self.reason = ""
        self.since = time.monotonic()
        self.epoch += 1
        self._wake_writer.set()

    def health(self) -> dict[str, object]:
        if self.up:
            return {"status": "ok", "replica": self.me}
        return {
            "status": "degraded",
            "replica": self.me,
            "reason": self.reason,
            "down_s": round(time.monotonic() - self.since, 3),
            "pending_pins": len(self.pending),
        }

    async def check(self) -> None:
        await self.client.ping()

    async def close(self) -> None:
        await self.client.aclose()
        await self.pool.disconnect()

    # --- pins -----------------------------------------------------------------------------

    def key(self, session: str) -> str:
        return self.ns + "session:" + session

    @property
    def pin_channel(self) -> str:
        return self.ns + "pins"

    def queue_pin(self, session: str, pin: Pin, stamp: str) -> None:
        """Queue a pin for Redis; never waits. Past PENDING_MAX the oldest are dropped."""
        self.pending[session] = (pin, stamp)
        self.pending.move_to_end(session)
        while len(self.pending) > PENDING_MAX:
            self.pending.popitem(last=False)
            self.counts["dropped"] += 1
        if self.up:
            self._wake_writer.set()

    def needs_read(self, session: str) -> bool:
        """Whether a request of this session should wait (READ_WAIT_S at most) for Redis:
        the session is unknown here, or known from before Redis last returned."""
        if not self.up:
            return False
        k = self.sessions.known.get(session)
        if k is None:
            return True
        self.sessions.touch(session)
        return k.epoch < self.epoch and session not in self.pending

    async def read_pin(self, session: str) -> None:
        """Bring the session's pin from Redis into memory, waiting at most READ_WAIT_S."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        waiting = self._reads.get(session)
        if waiting is None:
            self._reads[session] = [waiter]
            self._wake_reader.set()
        else:
            waiting.append(waiter)
        timer = loop.call_later(READ_WAIT_S, self._gave_up, waiter)
        try:
            await waiter
        finally:
            timer.cancel()

    def unsent(self, session: str) -> bool:
        """Whether this session's pin is queued or on its way to Redis (Redis up)."""
        return bool(self.up) and (session in self.pending or session in self._sending)

    async def settled(self, session: str) -> None:
        """Until this session's pin is in Redis, READ_WAIT_S at most: an answer waits for its
        new pin before it leaves, so that the session's next turn, at whichever replica,
        finds it. Usually it is there before the backend answers, and nothing waits."""
        if not self.unsent(session):
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._acks.setdefault(session, []).append(waiter)
        timer = loop.call_later(READ_WAIT_S, self._gave_up, waiter, "write_timeout")
        try:
            await waiter
        finally:
            timer.cancel()

    def _gave_up(self, waiter: asyncio.Future[bool], what: str = "read_timeout") -> None:
        if not waiter.done():
            waiter.set_result(False)
            self.counts[what] += 1

    async def _writer(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer.clear()
            while self.pending and self.up:
                batch = []
                for _ in range(min(BATCH, len(self.pending))):
                    batch.append(self.pending.popitem(last=False))
                args: list[str | int] = [SESSION_TTL_S, self.pin_channel]
                args += [encode_pin(stamp, pin) for _, (pin, stamp) in batch]
                self._sending = {s for s, _ in batch}
                try:
                    out = await self._write(keys=[self.key(s) for s, _ in batch], args=args)
                except Exception as e:
                    self._sending = set()
                    for s, item in reversed(batch):  # keep them, unless superseded meanwhile
                        if s not in self.pending:
                            self.pending[s] = item
                            self.pending.move_to_end(s, last=False)
                    self.down(e)
                    break
                self._sending = set()
                self.counts["written"] += len(batch)
                for s, _ in batch:
                    waiting = self._acks.pop(s, None)
                    if waiting:
                        _release(waiting)
                for (s, _), won in zip(batch, out, strict=True):
                    if won:
                        with contextlib.suppress(ValueError):
                            stamp, pin = decode_pin(won)
                            if self.sessions.adopt(s, pin, stamp):
                                self.counts["conflicts"] += 1
                    else:
                        k = self.sessions.known.get(s)
                        if k is not None:
                            k.epoch = self.epoch

    async def _reader(self) -> None:
        while True:
            await self._wake_reader.wait()
            self._wake_reader.clear()
            while self._reads:
                batch = [(s, self._reads.pop(s)) for s in list(self._reads)[:BATCH]]
                got: list[bytes | None] = []
                try:
                    if self.up:
                        got = await self.client.mget([self.key(s) for s, _ in batch])
                except Exception as e:
                    self.down(e)
                self.counts["read"] += len(got)
                for (s, _), raw in zip(batch, got, strict=False):
                    self._reconcile(s, raw)
                for _, waiting in batch:
                    _release(waiting)

    def _reconcile(self, session: str, raw: bytes | None) -> None:
        """Redis's pin for a session against ours: the later one wins, here and there."""
        theirs = ""
        if raw:
            try:
                theirs, pin = decode_pin(raw)
            except ValueError:
                return
            self.sessions.adopt(session, pin, theirs)
        k = self.sessions.known.get(session)
        mine = self.sessions.pins.get(session)
        if k is None or mine is None or k.stamp <= theirs:
            return
        if session not in self.pending and session not in self._sending:
            # Redis lost it (restarted empty, or it expired) or holds an older one: write
            # ours back, with its version.
            self.counts["restored"] += 1
            self.queue_pin(session, mine, k.stamp)

    def _apply(self, data: bytes) -> None:
        """A message of the pins channel: the pins one write kept."""
        try:
            items = json.loads(data)
        except ValueError:
            return
        if not isinstance(items, list):
            return
        prefix = self.ns + "session:"
        for item in items:
            try:
                key, value = str(item).split("\n", 1)
                stamp, pin = decode_pin(value)
            except ValueError:
                continue
            session = key.removeprefix(prefix)
            if stamp.endswith(self.me):  # our own write, confirmed
                k = self.sessions.known.get(session)
                if k is not None and k.stamp == stamp:
                    k.epoch = self.epoch
            elif self.sessions.adopt(session, pin, stamp):
                self.counts["applied"] += 1

    async def _subscriber(self) -> None:
        """Apply every replica's pins as published; (re)subscribing is how a replica learns
        that Redis is back."""
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(self.pin_channel)
                self.subscribed.set()
                self.back()
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                    if msg is not None and msg.get("type") == "message":
                        self._apply(msg["data"])
                    elif msg is None and not self.up:  # a command failed; is Redis back?
                        await self.client.ping()
                        self.back()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.subscribed.clear()
                self.down(e)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(RETRY_S)

    # --- the aging window -------------------------------------------------------------------

    def ttft_window(self, window_s: float) -> SharedMedian:
        """The scheduler's TTFT window, merged across replicas while Redis is up."""
        self.median = SharedMedian(window_s, self)
        return self.median

    async def sync_ttft(self) -> None:
        """Send this replica's last second of TTFT samples, and merge every replica's."""
        m = self.median
        if m is None:
            return
        wall = time.time()
        count, points = m.take_second()
        if count:
            self._ttft_own.append((int(wall), count, points))
        while self._ttft_own and self._ttft_own[0][0] < wall - m.window:
            self._ttft_own.popleft()
        if not self.up:
            return
        reps = self.ns + "ttft:replicas"
        keep = int(m.window) + 10
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.ns + "ttft:" + self.me, json.dumps(list(self._ttft_own)), ex=keep)
            pipe.zadd(reps, {self.me: wall})
            pipe.zremrangebyscore(reps, "-inf", wall - keep)
            pipe.expire(reps, keep)
            pipe.zrange(reps, 0, -1)
            *_, members = await pipe.execute()
        names = [x.decode() if isinstance(x, bytes) else x for x in members]
        blobs = await self.client.mget([self.ns + "ttft:" + n for n in names]) if names else []
        merged: list[tuple[float, float]] = []
        for blob in blobs:
            if not blob:
                continue
            with contextlib.suppress(ValueError, TypeError):
                for sec, n, values in json.loads(blob):
                    if sec >= wall - m.window and values:
                        w = n / len(values)
                        merged.extend((float(v), w) for v in values)
        m.merged = weighted_median(merged)
        m.merged_at = time.monotonic()

    async def _ttft_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.sync_ttft()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.down(e)

    # --- the whole ----------------------------------------------------------------------------

    async def run(self) -> None:
        """The background tasks (subscriber, writer, reader, TTFT), until cancelled."""
        tasks = [
            asyncio.create_task(t())
            for t in (self._subscriber, self._writer, self._reader, self._ttft_loop)
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    # --- the prefix index's updates (pub/sub) -----------------------------------------------

    @property
    def prefix_channel(self) -> str:
        return self.ns + "prefix"

    async def publish_prefix(self, messages: Sequence[bytes]) -> None:
        """Publish prefix-index updates, in one round trip."""
        if self.up is False:
            raise ConnectionError(self.reason)
        async with self.client.pipeline(transaction=False) as pipe:
            for m in messages:
                pipe.publish(self.prefix_channel, m)
            await pipe.execute()

    async def prefix_updates(
        self, subscribed: Callable[[], None] | None = None
    ) -> AsyncIterator[bytes]:
        """Every replica's prefix-index updates (this one's too) as they are published, until
        the connection fails (the error is raised). `subscribed()` is called once listening."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.prefix_channel)
            if subscribed is not None:
                subscribed()
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None and msg.get("type") == "message":
                    yield msg["data"]
        finally:
            await pubsub.aclose()
