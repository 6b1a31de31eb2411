"""State several router replicas share through Redis: session pins and the TTFT window.

Routing decisions stay synchronous and local: a request's pin is fetched from Redis before
it is queued, and new pins are written after placement. TTFT samples go to a sorted set by
wall-clock time; each replica rebuilds its aging median from the last window once a second.
"""

from __future__ import annotations

import json
import time
import uuid
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
