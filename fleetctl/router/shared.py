"""State several router replicas share through Redis: session pins, the TTFT window, and
what each replica's prefix index learns.

Routing decisions stay synchronous and local: a request's pin is fetched from Redis before
it is queued, and new pins are written after placement. TTFT samples go to a sorted set by
wall-clock time; each replica rebuilds its aging median from the last window once a second.
Prefix-index updates are published on a pub/sub channel, fire and forget
(fleetctl/router/prefix_share.py): a replica that is away misses them, and learns again from
its own placements.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fleetctl.errors import UserError
from fleetctl.routing.scheduler import RollingMedian
from fleetctl.routing.sessions import Pin, SessionTable

PREFIX = "fleetctl:"
SESSION_TTL_S = 24 * 3600


class RedisShared:
    """Session pins and TTFT samples in Redis (`redis://host:port/db`)."""

    def __init__(self, url: str, namespace: str = "default"):
        try:
            import redis.asyncio as redis
        except ImportError:
            raise UserError(
                "--session-store redis:// needs the redis package",
                None,
                "pip install 'fleetctl[redis]'",
            ) from None
        self.client: Any = redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.ns = f"{PREFIX}{namespace}:"
        self.me = uuid.uuid4().hex[:8]

    async def check(self) -> None:
        await self.client.ping()

    async def close(self) -> None:
        await self.client.aclose()

    async def load_pin(self, table: SessionTable, session: str) -> None:
        """Copy the session's pin from Redis into the local table (Redis wins)."""
        raw = await self.client.get(self.ns + "session:" + session)
        if raw:
            d = json.loads(raw)
            table.set(session, Pin(d["node_class"], d["node"]))

    async def save_pin(self, session: str, pin: Pin) -> None:
        body = json.dumps({"node_class": pin.node_class, "node": pin.node})
        await self.client.set(self.ns + "session:" + session, body, ex=SESSION_TTL_S)

    async def add_ttft(self, value: float) -> None:
        now = time.time()
        await self.client.zadd(self.ns + "ttft", {f"{now:.6f}:{value:.6f}:{self.me}": now})

    async def ttft_median(self, window_s: float) -> RollingMedian:
        """A RollingMedian over every replica's samples of the last `window_s` (monotonic clock)."""
        wall, mono = time.time(), time.monotonic()
        key = self.ns + "ttft"
        await self.client.zremrangebyscore(key, "-inf", wall - window_s)
        members = await self.client.zrangebyscore(key, wall - window_s, "+inf")
        median = RollingMedian(window_s)
        for m in members:
            at, value, _ = (m.decode() if isinstance(m, bytes) else m).split(":")
            median.add(mono - (wall - float(at)), float(value))
        return median

    # --- the prefix index's updates (pub/sub) -----------------------------------------------

    @property
    def prefix_channel(self) -> str:
        return self.ns + "prefix"

    async def publish_prefix(self, messages: Sequence[bytes]) -> None:
        """Publish prefix-index updates, in one round trip."""
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
