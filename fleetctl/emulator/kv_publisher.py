"""The emulator's KV cache events, published as vLLM 0.32 publishes them.

`--kv-events-config JSON` is vLLM's flag and takes vLLM's fields (config/kv_events.py
`KVEventsConfig`): `enable_kv_cache_events`, `publisher` ("zmq" or "null"; by default "zmq"
when events are enabled), `endpoint` (default `tcp://*:5557`), `replay_endpoint`,
`buffer_steps`, `hwm`, `max_queue_size`, `topic`. Data parallelism is not emulated (rank 0).

What goes on the wire (vllm/distributed/kv_events.py `ZmqEventPublisher`, the same as
fleetctl/daemon/kv_events.py reads):

- A PUB socket that *binds* when the endpoint holds `*` or `::` or is ipc:// or inproc://
  and *connects* otherwise (then the subscriber binds). Each batch is one multipart message
  `[topic (UTF-8), seq (8 bytes big-endian, from 0 for each process), payload]`.
- The payload is msgspec's msgpack of `KVEventBatch`, an array `[ts, events, 0]` (the data
  parallel rank); each event a map, tag first: `{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id": None, "medium": "GPU",
  "lora_name": None}`, `{"type": "BlockRemoved", "block_hashes", "medium": "GPU"}`,
  `{"type": "AllBlocksCleared"}` (sent when the server sleeps: its cache is dropped).
  Block hashes are uint64 ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES's default).
- With `replay_endpoint`, a bound ROUTER answering `[id, b"", start_seq]` with every buffered
  batch from start_seq as `[id, b"", topic, seq, payload]` and the end marker
  `[id, b"", b"", (-1 as 8 signed bytes), b""]`; it keeps the last `buffer_steps` batches.
- One batch per engine step that stored or evicted blocks; a step's stores are one
  BlockStored per run of blocks chained one to the next (vLLM: one per request per step).

Block hashes (`wire_hash`): the engine (fleetctl/sim/kvpool.py `engine_keys`) keys block b of
a prompt named by `block_size`-token hashes h_b as `h_b ^ (block_size * _MIX)`; the wire
carries `key ^ (block_size * _MIX)` in 64 bits, so a token-id prompt's blocks go out under
the very ints vLLM would publish for them (fleetctl/emulator/prompts.py names those with
fleetctl/vllm/hashing.py), and a router's precise index matches them as it would a real
server's. Text prompts' blocks (named by their characters) get other, still stable, ints.

pyzmq and msgpack are imported only when events are configured. The publishing runs in a
thread, as vLLM's does: the event loop only queues the batch.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from fleetctl.base.errors import UserError
from fleetctl.sim.kvpool import _MIX

log = logging.getLogger("fleetctl.emulator")

MASK64 = (1 << 64) - 1
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MEDIUM = "GPU"
# Parents and token ids of blocks submitted but not yet stored, kept for their BlockStored;
# bounded (the oldest go first: a block never computed would otherwise stay for good).
MAX_PENDING_BLOCKS = 1 << 20


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig fields (vllm/config/kv_events.py, 0.32 defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether a ZMQ publisher runs (vLLM: publisher defaults to zmq when enabled)."""
        kind = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and kind == "zmq"


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """`--kv-events-config`'s JSON, checked as vLLM's config dataclass checks it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise UserError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KvEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UserError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
    kinds: dict[str, type | tuple[type, ...]] = {
        "enable_kv_cache_events": bool,
        "publisher": (str, type(None)),
        "endpoint": str,
        "replay_endpoint": (str, type(None)),
        "buffer_steps": int,
        "hwm": int,
        "max_queue_size": int,
        "topic": str,
    }
    for name, value in raw.items():
        kind = kinds[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise UserError(f"--kv-events-config: {name} {value!r} has the wrong type")
    config = KvEventsConfig(**raw)
    if config.publisher not in (None, "zmq", "null"):
        raise UserError(f"--kv-events-config: publisher {config.publisher!r}: use zmq or null")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise UserError(f"--kv-events-config: {name} must be at least 1")
    return config


def wire_hash(key: int, block_size: int) -> int:
    """The uint64 a block's engine key is published as (see the module docstring)."""
    return (key ^ (block_size * _MIX)) & MASK64


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's `_is_bind_endpoint`: bind wildcards and ipc/inproc, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class BlockNames:
    """What a BlockStored tells beyond the hash: each pending block's parent and token ids."""

    def __init__(self, block_size: int, limit: int = MAX_PENDING_BLOCKS):
        self.block_size = block_size
        self.limit = limit
        self.pending: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()

    def describe(self, keys: Sequence[int], ids: Sequence[int] | None, cached: Any) -> None:
        """A prompt's engine keys (and its token ids, if it came as ids): remember the ones
        not cached yet, which it may store."""
        bs = self.block_size
        pending = self.pending
        parent: int | None = None
        for j, key in enumerate(keys):
            if key not in cached and key not in pending:
                tokens = tuple(ids[j * bs : (j + 1) * bs]) if ids is not None else ()
                pending[key] = (parent, tokens)
            parent = key
        while len(pending) > self.limit:
            pending.popitem(last=False)

    def events(self, raw: Sequence[tuple[str, list[int]]]) -> list[dict[str, Any]]:
        """The engine pool's ("stored" | "removed", keys) as vLLM's event maps, consecutive
        stores that chain merged into one BlockStored."""
        bs = self.block_size
        out: list[dict[str, Any]] = []
        run: dict[str, Any] | None = None
        last: int | None = None
        for kind, keys in raw:
            if kind == "cleared":
                run = None
                self.pending.clear()
                out.append({"type": "AllBlocksCleared"})
                continue
            if kind == "removed":
                run = None
                hashes = [wire_hash(k, bs) for k in keys]
                out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM})
                continue
            for key in keys:
                parent, tokens = self.pending.pop(key, (None, ()))
                if run is not None and parent is not None and parent == last:
                    run["block_hashes"].append(wire_hash(key, bs))
                    run["token_ids"].extend(tokens)
                else:
                    run = {
                        "type": "BlockStored",
                        "block_hashes": [wire_hash(key, bs)],
                        "parent_block_hash": None if parent is None else wire_hash(parent, bs),
                        "token_ids": list(tokens),
                        "block_size": bs,
                        "lora_id": None,
                        "medium": MEDIUM,
                        "lora_name": None,
                    }
                    out.append(run)
                last = key
        return out


def encode_batch(ts: float, events: list[dict[str, Any]], rank: int = 0) -> bytes:
    """A KVEventBatch payload, byte for byte as msgspec encodes vLLM's."""
    import msgpack  # type: ignore[import-untyped, unused-ignore]

    return msgpack.packb([ts, events, rank], use_bin_type=True)


class KvEventPublisher:
    """vLLM's ZmqEventPublisher: a PUB socket, an optional replay ROUTER, a publishing thread."""

    def __init__(self, config: KvEventsConfig):
        import zmq

        self.config = config
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self.published = 0
        self.dropped = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise UserError(f"--kv-events-config: cannot open {config.endpoint}: {e}") from None
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="zmq-publisher")
        self._thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Queue one batch (called on the event loop; never blocks)."""
        if not events or not self._running:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1  # vLLM blocks the engine here; an emulator drops and logs
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: queue full, %d batches dropped", self.dropped)

    def close(self) -> None:
        """Send what is queued (up to a second), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=1.0)
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _loop(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._service_replay()
                except Exception:
                    log.exception("KV events: replay failed")
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            try:
                payload = encode_batch(time.time(), events)
                seq_bytes = seq.to_bytes(SEQ_BYTES, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.published += 1
            except Exception:
                log.exception("KV events: publishing failed")
                time.sleep(0.1)

    def _service_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: invalid replay request of %d frames", len(frames))
            return
        client, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
