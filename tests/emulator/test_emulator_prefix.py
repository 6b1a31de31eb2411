"""The emulator's prefix cache on real prompts, and its KV events in vLLM's wire format.

Over real HTTP on loopback: an emulator subprocess for the hit counts; an emulator served in
this process (aiohttp on 127.0.0.1, ZMQ on 127.0.0.1) for the KV events, so its engine's
cache can be compared with what a KvEventSubscriber learned from them.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import msgpack
import pytest
import zmq

from fleetctl.base.errors import UserError
from fleetctl.daemon.kv_events import (
    KvEventSubscriber,
    KvSource,
    decode_batch,
    prompt_blocks,
    server_hit_tokens,
)
from fleetctl.emulator.args import parse_args
from fleetctl.emulator.config import resolve
from fleetctl.emulator.kv_publisher import (
    BlockNames,
    encode_batch,
    is_bind_endpoint,
    parse_kv_events_config,
    wire_hash,
)
from fleetctl.emulator.prompts import name, sources
from fleetctl.emulator.server import STATE, make_app
from fleetctl.routing.prefix import PrefixIndex
from fleetctl.vllm.hashing import block_hashes
from tests.procs import NAME, SOURCE, Emulator, free_port

BS = 16


def _hits(emu: Emulator) -> tuple[float, float]:
    m = emu.metrics()
    q = next(s.value for s in m["vllm:prefix_cache_queries"].samples if s.name.endswith("_total"))
    h = next(s.value for s in m["vllm:prefix_cache_hits"].samples if s.name.endswith("_total"))
    return q, h


def _post(emu: Emulator, path: str, body: dict) -> dict:
    status, answer = emu.request("POST", path, body, timeout=30)
    assert status == 200, answer
    return json.loads(answer)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    e = Emulator(tmp_path_factory.mktemp("emu-prefix"))
    try:
        e.wait_healthy()
        yield e
    finally:
        e.stop()


def test_token_id_prompts_sharing_a_prefix_hit_the_shared_blocks(emu):
    shared = list(range(1000, 1000 + 4096))
    q0, h0 = _hits(emu)
    _post(emu, "/v1/completions", {"prompt": [*shared, *range(1, 101)], "max_tokens": 2})
    q1, h1 = _hits(emu)
    assert (q1 - q0, h1 - h0) == (4196, 0)
    _post(emu, "/v1/completions", {"prompt": [*shared, *range(7, 207)], "max_tokens": 2})
    q2, h2 = _hits(emu)
    assert q2 - q1 == 4296
    assert h2 - h1 == 4096  # exactly the shared 256 blocks


def _computed(emu: Emulator) -> tuple[float, float]:
    """(prompt tokens computed, requests) from vllm:request_prefill_kv_computed_tokens."""
    m = emu.metrics()["vllm:request_prefill_kv_computed_tokens"].samples
    total = next(s.value for s in m if s.name.endswith("_sum"))
    count = next(s.value for s in m if s.name.endswith("_count"))
    return total, count


def test_prefill_counts_computed_tokens_not_cached_ones(emu):
    """As vLLM's histogram does ("new KV tokens computed during prefill (excluding cached
    tokens)"): a prompt sent again computes only what its cached whole blocks leave. Before,
    the emulator counted every prompt token, and calibrate read a 4090 prefilling 8.6x its
    model's speed on shared-prefix traffic. (tests/vllm/test_vllm_real.py checks the real server
    by the same rule.)"""
    prompt = list(range(5000, 5000 + 300))
    t0, n0 = _computed(emu)
    _post(emu, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    _post(emu, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    t1, n1 = _computed(emu)
    assert n1 - n0 == 2
    # 300 tokens, then what 18 whole blocks of 16 leave: 300 - 288.
    assert t1 - t0 == 300 + (300 - 300 // BS * BS)


def test_text_and_chat_prompts_sharing_a_prefix_hit_about_the_shared_part(emu):
    system = "".join(f"rule {i}: be brief and precise. " for i in range(700))  # ~22K chars
    h0 = _hits(emu)[1]
    _post(emu, "/v1/completions", {"prompt": system + "first question?", "max_tokens": 2})
    _post(emu, "/v1/completions", {"prompt": system + "another one!", "max_tokens": 2})
    h1 = _hits(emu)[1]
    shared_tokens = len(system) / 4
    assert shared_tokens - 32 <= h1 - h0 <= shared_tokens  # whole 64-char chunks of it
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    _post(emu, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    messages[1]["content"] = "hello there, how are you?"
    _post(emu, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    h2 = _hits(emu)[1]
    # The first chat's text ("system\\nhi") shares the completions' chunks up to "first", the
    # second shares the first chat's: two hits of about the system prompt.
    assert 2 * (shared_tokens - 32) <= h2 - h1 <= 2 * shared_tokens


def test_prompt_naming_follows_vllm_for_ids_and_text_chunks():
    ids = list(range(40))
    n = name(ids, 40, BS)
    assert n.blocks is not None and n.ids == tuple(ids)
    assert list(n.blocks.hashes) == block_hashes(ids, BS)  # what a real vLLM would publish
    t = name("x" * 200, 50, BS)
    assert t.blocks is not None and len(t.blocks.hashes) == 3 and t.blocks.block_tokens == 16
    chat = {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}
    assert sources(chat, True) == ["a\nb"]
    assert sources({"prompt": [[1, 2], [3]]}, False) == [[1, 2], [3]]
    assert sources({"prompt": [1, 2]}, False) == [[1, 2]]


# --- KV events -------------------------------------------------------------------------------


def test_kv_events_config_is_vllms():
    c = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    assert c.publishes and c.replay_endpoint is None and c.topic == ""
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').publishes
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishes
    for bad in ("[]", "{", '{"endpoints": "x"}', '{"hwm": "1"}', '{"publisher": "kafka"}'):
        with pytest.raises(UserError):
            parse_kv_events_config(bad)
    assert is_bind_endpoint("tcp://*:5557") and not is_bind_endpoint("tcp://127.0.0.1:5557")


def test_events_encode_as_vllm_and_decode():
    names = BlockNames(BS)
    keys = [h ^ (BS * 0x9E3779B97F4A7C15) for h in (11, 12, 13)]
    names.describe(keys, list(range(48)), {})
    events = names.events([("stored", [keys[0]]), ("stored", [keys[1]]), ("removed", [keys[2]])])
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"}
    payload = encode_batch(1.5, events)
    assert msgpack.unpackb(payload)[0::2] == [1.5, 0]
    stored, removed = decode_batch(payload)
    assert stored.hashes == (11, 12) and stored.parent is None and stored.tokens == tuple(range(32))
    assert removed.hashes == (13,)
    assert wire_hash(keys[2], BS) == 13


def test_a_sleep_clears_the_cache_with_all_blocks_cleared():
    """A sleep drops the prefix cache (Engine.reset_prefix_cache): the publisher says so in
    vLLM's one event, which the router's KV-event reader turns into an emptied index."""
    names = BlockNames(BS)
    keys = [h ^ (BS * 0x9E3779B97F4A7C15) for h in (11, 12)]
    names.describe(keys, list(range(32)), {})
    events = names.events([("stored", keys), ("cleared", [])])
    assert events[-1] == {"type": "AllBlocksCleared"}
    assert [type(e).__name__ for e in decode_batch(encode_batch(0.0, events))][-1] == "Cleared"


async def _serve(port: int, kv: dict) -> tuple:
    argv = ["--gpu", "RTX-4090", "--model", NAME, SOURCE, "--served-model-name", NAME]
    argv += ["--port", str(port), "--time-scale", "50", "--max-model-len", "8192"]
    argv += ["--truth-kv", "0.25", "--kv-events-config", json.dumps(kv)]
    args, _ = parse_args(argv)
    app = make_app(resolve(args))
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return app, runner


async def _complete(session: aiohttp.ClientSession, url: str, ids: list[int]) -> None:
    body = {"prompt": ids, "max_tokens": 3}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def _settle(index: PrefixIndex, backend: str, want: set[int], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while set(index.blocks.get(backend, ())) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def test_subscriber_mirrors_the_emulators_cache_through_evictions():
    """vLLM's connect mode (the PUB dials the subscriber's bound port) and a replay socket:
    a KvEventSubscriber's index holds exactly the blocks the engine caches, after stores and
    after evictions, and the hits it predicts are the hits the emulator then reports."""

    async def main() -> None:
        port, pub, replay = free_port(), free_port(), free_port()
        endpoint = f"tcp://127.0.0.1:{pub}"
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": endpoint,
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv",
        }
        index = PrefixIndex(learn=False)
        src = KvSource("emu", endpoint, "kv", f"tcp://127.0.0.1:{replay}", bind=True)
        async with KvEventSubscriber(index, [src]) as sub:
            app, runner = await _serve(port, kv)
            try:
                engine = app[STATE].run().engine
                url = f"http://127.0.0.1:{port}"
                await asyncio.sleep(0.3)  # the PUB's connection to the bound SUB
                async with aiohttp.ClientSession() as session:
                    base = list(range(5000, 5000 + 2048))
                    await _complete(session, url, [*base, *range(10, 60)])
                    cached = {wire_hash(k, BS) for k in engine.pool.cached}
                    await _settle(index, "emu", cached)
                    assert set(index.blocks["emu"]) == cached
                    assert len(cached) == (2048 + 50) // BS
                    # The index predicts the next request's hit as vLLM would take it.
                    probe = [*base, *range(70, 170)]
                    pb = prompt_blocks(probe, BS)
                    assert pb is not None
                    predicted = server_hit_tokens(index.match("emu", pb.hashes), len(probe), BS)
                    h0 = engine.stats.prefix_cache_hits
                    await _complete(session, url, probe)
                    assert engine.stats.prefix_cache_hits - h0 == predicted == 2048
                    # Fill the small cache until blocks are evicted: the index follows.
                    total = engine.total_blocks
                    for i in range(total * BS // 6000 + 3):
                        await _complete(session, url, list(range(i * 7919, i * 7919 + 6000)))
                    cached = {wire_hash(k, BS) for k in engine.pool.cached}
                    assert pb.hashes[0] not in cached  # the first prompts were evicted
                    await _settle(index, "emu", cached)
                    assert set(index.blocks["emu"]) == cached
                    stats = sub.stats["emu"]
                    assert stats.malformed == 0 and stats.cleared == 0 and stats.batches > 0
                    assert app[STATE].publisher is not None
                    assert app[STATE].publisher.published == (stats.last_seq or 0) + 1
            finally:
                await runner.cleanup()

    asyncio.run(main())


def test_replay_socket_answers_like_vllms():
    """A DEALER asking the replay ROUTER for seq 0 gets every batch, then the end marker."""

    async def main() -> None:
        port, pub, replay = free_port(), free_port(), free_port()
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{pub}",  # nobody listens: live batches are lost
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        app, runner = await _serve(port, kv)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            async with aiohttp.ClientSession() as session:
                await _complete(session, f"http://127.0.0.1:{port}", list(range(100)))
            publisher = app[STATE].publisher
            assert publisher is not None
            deadline = time.monotonic() + 5
            while publisher.published < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            sock.connect(f"tcp://127.0.0.1:{replay}")
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = []
            while True:
                assert sock.poll(5000), "no replay answer"
                got = sock.recv_multipart()
                frames.append(got)
                if got[2] == (-1).to_bytes(8, "big", signed=True):
                    break
            assert frames[0][:3] == [b"", b"", (0).to_bytes(8, "big")]
            (stored,) = decode_batch(frames[0][3])
            assert len(stored.hashes) == 100 // BS and stored.tokens == tuple(range(96))
            assert list(stored.hashes) == block_hashes(list(range(100)), BS)
            assert frames[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        finally:
            sock.close(0)
            ctx.term()
            await runner.cleanup()

    asyncio.run(main())


def test_prefix_caching_flags_parse_as_vllms():
    base = ["--gpu", "RTX-4090", "--model", NAME, "--max-model-len", "8192"]
    args, ignored = parse_args([*base, "--no-enable-prefix-caching"])
    assert not ignored and not resolve(args).prefix_caching
    args, ignored = parse_args([*base, "--prefix-caching-hash-algo", "sha256_cbor"])
    c = resolve(args)
    assert not ignored and c.prefix_caching and c.hash_algo == "sha256_cbor" and c.kv_events is None
