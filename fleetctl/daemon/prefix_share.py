"""The prefix index across router replicas: each replica's placements reach the others'
indexes through the Redis session store's pub/sub channel.

A placement's update is queued without waiting (`SharedIndex.routed`, called by the policy
as it places a request) and published by one background task, several per round trip; a
placement that adds no block to this replica's index is shared at most once per REFRESH_S
per prompt, so a prompt that repeats (a system prompt) costs Redis nothing per request. The
queue is bounded: when Redis is slow or away, the oldest updates are dropped, never a request
held; each replica keeps its own index meanwhile. A replica applies every other replica's
updates to its index as they arrive; one that was away misses what was published then.

An update on the wire: a kind byte (`+` stored, `-` removed, `0` all cleared), a format
byte (`q`: the hashes are signed 64-bit integers, as CPython's hashes of routing/blocks.py
are; `Q`: unsigned, as vLLM's KV events carry them, fleetctl/vllm/hashing.py), the sender's
8-character id, the backend's name length (2 bytes, big-endian) and UTF-8 name, then the
hashes, little-endian. Hashes that fit neither are not shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from fleetctl.routing.prefix import PrefixIndex, PromptBlocks

log = logging.getLogger("fleetctl.router")

STORED, REMOVED, CLEARED = b"+", b"-", b"0"
# Updates waiting to be published: the oldest go first past this many bytes (a 12K-token
# prompt's update is ~6 KB; 1M blocks' worth is 8 MB).
OUTBOX_BYTES = 8 << 20
BATCH = 128  # updates per round trip
RETRY_S = 1.0  # after Redis fails, wait this long before the next try
REFRESH_S = 5.0  # a prompt placed again with no new block is shared at most this often
REFRESH_KEYS = 1 << 16  # prompts remembered for that (forgotten all at once past it)
_LEN = struct.Struct(">H")


class Store(Protocol):
    """What sharing needs of the session store (fleetctl/daemon/shared.py RedisShared)."""

    me: str

    async def publish_prefix(self, messages: Sequence[bytes]) -> None: ...

    def prefix_updates(
        self, subscribed: Callable[[], None] | None = None
    ) -> AsyncIterator[bytes]: ...


def encode(kind: bytes, sender: str, backend: str, hashes: Sequence[int]) -> bytes | None:
    """An update's bytes, or None when a hash does not fit 64 bits."""
    name = backend.encode()
    packed = None
    for fmt in ("q", "Q"):
        try:
            packed = array(fmt, hashes)
            break
        except OverflowError:
            continue
    if packed is None or packed.itemsize != 8:
        return None
    if not _little:
        packed.byteswap()
    head = (kind, packed.typecode.encode(), sender.encode()[:8].ljust(8), _LEN.pack(len(name)))
    return b"".join((*head, name, packed))


def decode(data: bytes) -> tuple[bytes, str, str, tuple[int, ...]]:
    """(kind, sender, backend, hashes) of an update; ValueError when malformed."""
    if len(data) < 12:
        raise ValueError("short prefix update")
    kind, fmt, sender = data[:1], data[1:2].decode(), data[2:10].decode()
    (n,) = _LEN.unpack_from(data, 10)
    backend = data[12 : 12 + n].decode()
    rest = data[12 + n :]
    if fmt not in ("q", "Q") or len(backend.encode()) != n or len(rest) % 8:
        raise ValueError("malformed prefix update")
    hashes = array(fmt)
    hashes.frombytes(rest)
    if not _little:
        hashes.byteswap()
    return kind, sender, backend, tuple(hashes)


_little = struct.pack("=H", 1) == b"\x01\x00"


class SharedIndex(PrefixIndex):
    """A PrefixIndex whose placements (and, for a KV-event-fed one, whose `stored`,
    `removed` and `cleared` calls) are also queued for the other replicas, once `share`
    is set."""

    def __init__(self, capacity: int = 1 << 20, learn: bool = True):
        super().__init__(capacity, learn)
        self.share: PrefixShare | None = None

    def share_with(self, share: PrefixShare) -> None:
        """Queue what changes here for the other replicas, through `share`."""
        self.share = share

    def routed(self, backend: str, blocks: PromptBlocks) -> None:
        if self.learn:
            hashes = blocks.hashes
            share = self.share
            if share is not None and hashes and share.worth_sharing(self, backend, hashes):
                share.queue(STORED, backend, hashes)
            self.insert(backend, hashes)

    def stored(self, backend: str, hashes: Sequence[int]) -> None:
        """An engine's BlockStored: insert here, and tell the other replicas."""
        self.insert(backend, hashes)
        if self.share is not None:
            self.share.queue(STORED, backend, hashes)

    def removed(self, backend: str, hashes: Sequence[int]) -> None:
        self.remove(backend, hashes)
        if self.share is not None:
            self.share.queue(REMOVED, backend, hashes)

    def cleared(self, backend: str) -> None:
        self.clear(backend)
        if self.share is not None:
            self.share.queue(CLEARED, backend, ())


class PrefixShare:
    """Publishes this replica's index updates and applies the other replicas' ones."""

    def __init__(self, store: Store, index: PrefixIndex, outbox_bytes: int = OUTBOX_BYTES):
        self.store = store
        self.index = index
        self.outbox: deque[bytes] = deque()
        self.outbox_bytes = outbox_bytes
        self.queued_bytes = 0
        self._me = store.me.encode()[:8].ljust(8)
        self.listening = asyncio.Event()  # subscribed: from now on, peers' updates arrive
        self._wake = asyncio.Event()
        self.published = self.dropped = self.applied = 0
        self._warned = 0.0
        self._shared_at: dict[tuple[str, int], float] = {}  # (backend, last block): when
        if isinstance(index, SharedIndex):
            index.share_with(self)

    def renamed(self) -> None:
        """The store's replica id changed (a forked worker's)."""
        self._me = self.store.me.encode()[:8].ljust(8)

    def worth_sharing(self, index: PrefixIndex, backend: str, hashes: Sequence[int]) -> bool:
        """Whether a placement tells the others something: a block new to this replica's
        index, or a prompt not shared for REFRESH_S (so that the others' least recently used
        order sees it is still used). A prompt placed again and again (a system prompt) is
        then published once per REFRESH_S, not once per request."""
        held = index.blocks.get(backend)
        if held is None or hashes[-1] not in held or hashes[0] not in held:
            fresh = True
        else:
            fresh = any(h not in held for h in hashes)
        now = time.monotonic()
        key = (backend, hashes[-1])
        if not fresh and now - self._shared_at.get(key, -REFRESH_S) < REFRESH_S:
            return False
        if len(self._shared_at) >= REFRESH_KEYS:
            self._shared_at.clear()
        self._shared_at[key] = now
        return True

    def queue(self, kind: bytes, backend: str, hashes: Sequence[int]) -> None:
        """Queue an update; never waits. Past `outbox_bytes`, the oldest are dropped."""
        msg = encode(kind, self.store.me, backend, hashes)
        if msg is None:
            return
        self.outbox.append(msg)
        self.queued_bytes += len(msg)
        while self.queued_bytes > self.outbox_bytes:
            self.queued_bytes -= len(self.outbox.popleft())
            self.dropped += 1
        self._wake.set()

    def apply(self, data: bytes) -> bool:
        """Apply another replica's update to the local index; False for our own or junk."""
        if data[2:10] == self._me:
            return False
        try:
            kind, sender, backend, hashes = decode(data)
        except (ValueError, UnicodeDecodeError):
            return False
        if sender == self.store.me:
            return False
        if kind == STORED:
            self.index.insert(backend, hashes)
        elif kind == REMOVED:
            self.index.remove(backend, hashes)
        elif kind == CLEARED:
            self.index.clear(backend)
        else:
            return False
        self.applied += 1
        return True

    async def publish(self) -> None:
        """Publish queued updates, BATCH per round trip, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.outbox:
                batch = [self.outbox.popleft() for _ in range(min(BATCH, len(self.outbox)))]
                self.queued_bytes -= sum(len(m) for m in batch)
                try:
                    await self.store.publish_prefix(batch)
                    self.published += len(batch)
                except Exception as e:  # keep the local index; try again later
                    self.dropped += len(batch)
                    self._warn(e)
                    await asyncio.sleep(RETRY_S)

    async def listen(self) -> None:
        """Apply the other replicas' updates, resubscribing after a failure, until cancelled."""
        while True:
            try:
                async for data in self.store.prefix_updates(self.listening.set):
                    self.apply(data)
            except Exception as e:
                self.listening.clear()
                self._warn(e)
            await asyncio.sleep(RETRY_S)

    async def run(self) -> None:
        """Both directions, until cancelled."""
        tasks = [asyncio.create_task(self.publish()), asyncio.create_task(self.listen())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    def _warn(self, e: BaseException) -> None:
        """The session store's health says so (once per outage), or one log line per minute
        at most while Redis fails."""
        down = getattr(self.store, "down", None)
        if callable(down):
            down(e)
            return
        now = time.monotonic()
        if now - self._warned >= 60.0:
            self._warned = now
            log.warning("session store (prefix sharing): %s", type(e).__name__)
