"""The approximate prefix index: prompts as block hashes, learned from placements, bounded, and
shared between router replicas through a real redis-server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetctl.daemon.prefix_share import STORED, PrefixShare, SharedIndex, decode, encode
from fleetctl.daemon.router import DaemonConfig, Router, per_backend, routing_core
from fleetctl.daemon.shared import RedisShared
from fleetctl.routing.blocks import TEXT_CHUNK_CHARS, text_blocks, token_blocks
from fleetctl.routing.policies.round_robin import RoundRobin
from fleetctl.routing.prefix import PrefixIndex, PromptBlocks
from fleetctl.routing.registry import make_policy
from fleetctl.routing.scheduler import Scheduler
from fleetctl.routing.types import Backend, Decision, Request
from tests.conftest import REPO
from tests.daemon.test_route_serve import redis_url  # noqa: F401 - the real redis-server fixture
from tests.daemon.test_router_hostile import Hostile
from tests.procs import NAME, RouterThread, free_port, http_request

SYSTEM = "You are a careful assistant for the fleet. " * 40  # 1,720 characters
C = TEXT_CHUNK_CHARS


def shared_run(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- blocks (pure) ---------------------------------------------------------------------------


def test_text_prompts_sharing_n_characters_share_n_over_chunk_leading_hashes():
    common = "x" * 1000 + "the shared part of both prompts " * 20  # 1,640 characters
    one = text_blocks(common + "A" * 700, 600)
    two = text_blocks(common + "B" * 700, 600)
    assert shared_run(one.hashes, two.hashes) == len(common) // C
    assert len(one.hashes) == len(two.hashes) == (len(common) + 700) // C
    # After the first differing chunk nothing matches again: the hashes are chained.
    k = len(common) // C
    assert not set(one.hashes[k:]) & set(two.hashes[k:])
    assert one.block_tokens == round(C * 600 / (len(common) + 700))
    assert one.prefix_tokens(len(one.hashes)) <= one.tokens == 600


def test_only_full_blocks_are_hashed():
    # The README's figure, written out: text is cut into 64-character chunks.
    assert text_blocks("a" * 63, 16).hashes == ()
    assert len(text_blocks("a" * 191, 48).hashes) == 2
    assert text_blocks("a" * 128, 32).block_tokens == 16
    assert text_blocks("a" * (C - 1), 10).hashes == ()
    assert len(text_blocks("a" * (3 * C + 5), 50).hashes) == 3
    ids = list(range(16 * 5 + 7))
    blocks = token_blocks(ids)
    assert len(blocks.hashes) == 5 and blocks.tokens == 87 and blocks.block_tokens == 16
    other = token_blocks([*ids[:40], 999, *ids[41:]])  # differs in block 2 (tokens 32-47)
    assert shared_run(blocks.hashes, other.hashes) == 2
    assert token_blocks([]).hashes == () and text_blocks("", 0).hashes == ()


def test_block_hashes_are_the_same_in_every_process():
    """Replicas share hashes: they must not depend on the per-process str hash seed."""
    code = (
        "import json\n"
        "from fleetctl.routing.blocks import text_blocks, token_blocks\n"
        "t = text_blocks('héllo wörld, a prompt \\ud800 ' * 30, 200).hashes\n"
        "k = token_blocks(list(range(100))).hashes\n"
        "print(json.dumps([t, k]))\n"
    )
    seen = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout)
    assert seen[0] == seen[1]
    assert len(json.loads(seen[0])[0]) > 10


def test_an_update_survives_the_wire():
    hashes = token_blocks(list(range(160))).hashes
    msg = encode(STORED, "abcd1234", "http://10.0.0.1:8000", hashes)
    assert msg is not None
    assert decode(msg) == (STORED, "abcd1234", "http://10.0.0.1:8000", hashes)
    # vLLM's KV events carry unsigned 64-bit hashes: shared as such.
    engine = (2**64 - 1, 2**63, 5)
    assert decode(encode(STORED, "abcd1234", "b", engine) or b"") == (
        STORED,
        "abcd1234",
        "b",
        engine,
    )
    assert encode(STORED, "abcd1234", "b", [2**70]) is None  # fits no 64 bits: not shared
    with pytest.raises(ValueError):
        decode(msg[:-3])


# --- route-serve in front of real HTTP backends ----------------------------------------------


class Recording(RoundRobin):
    """Round-robin that keeps each placed request (to read the Request intake built)."""

    def __init__(self, index: PrefixIndex | None = None) -> None:
        super().__init__(index)
        self.seen: list[tuple[Request, str]] = []

    def placed(self, req: Request, backend: Backend, decision: Decision | None = None) -> None:
        self.seen.append((req, backend.name))
        super().placed(req, backend, decision)


class Serving(RouterThread):
    """A daemon Router's app in a thread of its own, on 127.0.0.1."""

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        """fn() on the router's loop (its index is that loop's alone)."""

        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def chat(self, system: str, user: str, **extra: Any) -> int:
        body = {
            "model": NAME,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 8,
            **extra,
        }
        status, _, _ = http_request(self.port, "POST", "/v1/chat/completions", body, timeout=30)
        return status


@pytest.fixture(scope="module")
def servers():
    found = [Hostile(), Hostile()]
    try:
        yield found
    finally:
        for s in found:
            s.stop()


def backends(servers: list[Hostile]) -> list[Backend]:
    return [
        Backend(f"http://127.0.0.1:{s.port}", f"n{i}", "RTX-4090", NAME, "bf16", kv_tokens=100_000)
        for i, s in enumerate(servers)
    ]


def wait_for(check: Callable[[], bool], what: str, timeout: float = 20) -> None:
    end = time.monotonic() + timeout  # only stops a hang
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_chats_sharing_a_system_prompt_share_leading_blocks_and_the_index_learns(servers):
    policy = Recording(SharedIndex())
    router = Router(backends(servers), Scheduler(policy), DaemonConfig(), hash_prompts=True)
    assert isinstance(policy.prefix, PrefixIndex) and router.intake.blocks
    s = Serving(router)
    try:
        assert s.chat(SYSTEM, "Which GPU is the fastest for llama?") == 200
        assert s.chat(SYSTEM, "List every node of class RTX-4090.") == 200
        (first, at_first), (second, at_second) = policy.seen
        assert at_first != at_second  # round-robin
        assert first.blocks is not None and second.blocks is not None
        assert first.max_tokens == 8  # intake fills what the client asked for
        # The messages' contents joined by a newline: the system prompt and that newline are
        # shared, and the user turns differ from their first character.
        shared = (len(SYSTEM) + 1) // C
        assert shared_run(first.blocks.hashes, second.blocks.hashes) == shared
        # The first placement taught the index: the first backend holds the first prompt,
        # and the second prompt's shared run.
        index = router.prefix
        assert index is not None
        assert s.on_loop(lambda: index.match(at_first, first.blocks.hashes)) == len(
            first.blocks.hashes
        )
        assert s.on_loop(lambda: index.match(at_first, second.blocks.hashes)) == shared
        assert s.on_loop(lambda: index.cached(at_first, second.blocks)) == (
            second.blocks.prefix_tokens(shared)
        )
    finally:
        s.stop()


def test_token_id_prompts_hash_16_token_blocks(servers):
    policy = Recording()
    router = Router(backends(servers)[:1], Scheduler(policy), DaemonConfig(), hash_prompts=True)
    s = Serving(router)
    try:
        ids = list(range(1000, 1000 + 16 * 10 + 3))
        body = {"model": NAME, "prompt": ids, "max_tokens": 4}
        assert http_request(s.port, "POST", "/v1/completions", body, timeout=30)[0] == 200
        batch = {"model": NAME, "prompt": ["one prompt", "another"], "max_tokens": 4}
        assert http_request(s.port, "POST", "/v1/completions", batch, timeout=30)[0] == 200
        single = {"model": NAME, "prompt": [SYSTEM], "max_tokens": 4}
        assert http_request(s.port, "POST", "/v1/completions", single, timeout=30)[0] == 200
        (one, _), (two, _), (three, _) = policy.seen
        assert one.blocks == token_blocks(ids) and len(one.blocks.hashes) == 10
        assert two.blocks is None  # a batch has no one prefix
        assert three.blocks is not None and len(three.blocks.hashes) == len(SYSTEM) // C
    finally:
        s.stop()


@pytest.mark.parametrize("name", ["prefix-kv", "kv-router", "hardware-aware"])
def test_prefix_aware_policies_get_hashed_prompts_and_the_index(name):
    router = Router([], routing_core(name, 0))
    assert router.policy.reads_prefix and router.intake.blocks
    assert isinstance(router.prefix, SharedIndex) and router.policy.prefix is router.prefix


def test_a_policy_with_its_own_index_gets_hashed_prompts_only():
    router = Router([], routing_core("cache-aware", 0))
    assert router.intake.blocks and router.prefix is None


def test_cache_aware_sends_chats_sharing_a_system_prompt_to_one_server(servers):
    router = Router(backends(servers), Scheduler(make_policy("cache-aware")), DaemonConfig())
    s = Serving(router)
    try:
        nodes = set()
        for i in range(6):
            body = {
                "model": NAME,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"question number {i}"},
                ],
                "max_tokens": 4,
            }
            status, headers, _ = http_request(s.port, "POST", "/v1/chat/completions", body)
            assert status == 200
            nodes.add(headers["X-Fleet-Backend"])
        assert len(nodes) == 1
        # Every turn after the first found its prefix there (without blocks: "prefix:none").
        _, _, page = http_request(s.port, "GET", "/metrics")
        reasons = {
            sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(page.decode())
            for sample in family.samples
            if sample.name == "fleetctl_requests_total"
        }
        assert reasons == {"cache-aware prefix:miss": 1.0, "cache-aware prefix:hit": 5.0}
    finally:
        s.stop()


def test_prompts_are_not_hashed_for_a_policy_that_ignores_prefixes(servers):
    policy = Recording()
    router = Router(backends(servers), Scheduler(policy), DaemonConfig())
    assert not policy.reads_prefix and not router.intake.blocks and router.prefix is None
    s = Serving(router)
    try:
        assert s.chat(SYSTEM, "hello") == 200
        assert policy.seen[0][0].blocks is None
    finally:
        s.stop()


def test_the_index_stays_within_its_bound(servers):
    capacity = 40  # blocks over both backends: 20 each
    policy = Recording(SharedIndex(per_backend(capacity, 2)))
    router = Router(
        backends(servers),
        Scheduler(policy),
        DaemonConfig(),
        prefix_capacity=capacity,
        hash_prompts=True,
    )
    index = router.prefix
    assert isinstance(index, SharedIndex) and index.capacity == 20
    s = Serving(router)
    try:
        for i in range(12):  # 12 distinct prompts of 27 blocks each
            assert s.chat(f"{i:04d} " + SYSTEM, "hi") == 200
        sizes = s.on_loop(lambda: [index.size(b.name) for b in router.backends])
        assert sizes == [20, 20]
        # What is kept is the last prompt placed there: least recently used blocks went first.
        last, at = policy.seen[-1]
        assert last.blocks is not None
        kept = s.on_loop(lambda: sum(index.match(at, (h,)) for h in last.blocks.hashes))
        assert kept == 20
    finally:
        s.stop()


def test_a_policy_given_an_index_keeps_it():
    index = PrefixIndex(7)
    router = Router(
        [Backend("http://127.0.0.1:1", "n", "RTX-4090", NAME, "bf16", kv_tokens=1000)],
        Scheduler(make_policy("round-robin", prefix=index)),
    )
    assert router.prefix is index and router.policy.prefix is index and index.capacity == 7
    assert Router([], Scheduler(make_policy("round-robin")), prefix_capacity=0).prefix is None


# --- sharing through Redis -------------------------------------------------------------------


def replica(servers: list[Hostile], url: str, namespace: str) -> Serving:
    policy = Recording(SharedIndex())
    router = Router(
        backends(servers),
        Scheduler(policy),
        DaemonConfig(),
        shared=RedisShared(url, namespace),
        hash_prompts=True,
    )
    return Serving(router)


def test_a_prompt_routed_by_one_replica_is_in_the_others_index(servers, redis_url):  # noqa: F811
    a = replica(servers, redis_url, "prefix-share")
    b = replica(servers, redis_url, "prefix-share")
    try:
        for r in (a, b):
            share = r.router.prefix_share
            assert share is not None
            wait_for(share.listening.is_set, "the subscription")
        assert a.chat(SYSTEM, "What runs on a100-1?") == 200
        policy = a.router.policy
        assert isinstance(policy, Recording)
        req, at = policy.seen[0]
        assert req.blocks is not None
        hashes = req.blocks.hashes
        index_b = b.router.prefix
        assert index_b is not None
        wait_for(
            lambda: b.on_loop(lambda: index_b.match(at, hashes)) == len(hashes),
            "replica B to learn replica A's placement",
        )
        assert b.on_loop(lambda: index_b.size(at)) == len(hashes)
        # B's own placements reach A the same way.
        assert b.chat("Another system prompt entirely. " * 20, "hi") == 200
        req_b, at_b = b.router.policy.seen[0]  # type: ignore[attr-defined]
        index_a = a.router.prefix
        assert index_a is not None
        wait_for(
            lambda: (
                a.on_loop(lambda: index_a.match(at_b, req_b.blocks.hashes))
                == len(req_b.blocks.hashes)
            ),
            "replica A to learn replica B's placement",
        )
        share_a = a.router.prefix_share
        assert share_a is not None and share_a.applied >= 1 and share_a.published >= 1
    finally:
        a.stop()
        b.stop()


def test_without_redis_a_replica_serves_and_keeps_its_own_index(servers):
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    r = replica(servers, down, "prefix-down")
    try:
        started = time.monotonic()
        for i in range(5):
            assert r.chat(SYSTEM, f"question {i}") == 200
        assert time.monotonic() - started < 10  # no request waits on Redis
        policy = r.router.policy
        assert isinstance(policy, Recording)
        req, at = policy.seen[0]
        index = r.router.prefix
        assert index is not None and req.blocks is not None
        assert r.on_loop(lambda: index.match(at, req.blocks.hashes)) == len(req.blocks.hashes)
    finally:
        r.stop()


def test_the_outbox_is_bounded_and_never_waits():
    class Nowhere:
        me = "nowhere1"

        async def publish_prefix(self, messages: Any) -> None:
            raise ConnectionError

        def prefix_updates(self, subscribed: Any = None) -> Any:
            raise ConnectionError

    async def go() -> PrefixShare:
        index = SharedIndex(100)
        size = len(encode(STORED, Nowhere.me, "b0", range(1, 6)) or b"")
        share = PrefixShare(Nowhere(), index, outbox_bytes=50 * size)
        for i in range(500):  # each a prompt new to the index (a repeat is not shared again)
            index.routed(f"b{i % 3}", PromptBlocks(tuple(range(5 * i + 1, 5 * i + 6)), 16, 80))
        return share

    share = asyncio.run(go())
    assert len(share.outbox) == 50 and share.dropped == 450


class WordTokenizer:
    """A word-level tokenizer with the interface TokenCounter uses of a Hugging Face one
    (`encode(text).ids`): each distinct word gets the next id."""

    class Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> WordTokenizer.Encoding:
        return self.Encoding([self.vocab.setdefault(w, len(self.vocab)) for w in text.split()])


def test_with_a_tokenizer_the_blocks_are_16_token_blocks_of_its_ids():
    from fleetctl.daemon.tokens import TokenCounter

    counter = TokenCounter()
    tok = WordTokenizer()
    counter.tokenizers[NAME] = tok
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    m = asyncio.run(counter.measure(NAME, body, chat=True, blocks=True))
    ids = tok.encode(SYSTEM + "\nhi").ids
    assert m.tokens == len(ids) and m.blocks == token_blocks(ids)
    assert m.blocks.block_tokens == 16 and len(m.blocks.hashes) == len(ids) // 16
    # Long prompts go through a thread: the same answer.
    long_body = {"prompt": SYSTEM * 30, "model": NAME}
    m = asyncio.run(counter.measure(NAME, long_body, chat=False, blocks=True))
    assert m.blocks == token_blocks(tok.encode(SYSTEM * 30).ids)
    # Without `blocks` nothing is hashed.
    assert asyncio.run(counter.measure(NAME, long_body, chat=False)).blocks is None


# --- the precise source: KV events -----------------------------------------------------------


def test_kv_events_feed_the_index_and_prompts_are_named_as_vllm_names_them(servers):
    """A real ZMQ PUB on loopback stands for vLLM's KV events publisher (the wire itself is
    tests/daemon/test_kv_events.py's): route-serve subscribes to it, names a token-id prompt's
    blocks as vLLM does, and finds them cached where the events say; its own placements
    teach the index nothing."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    from fleetctl.vllm.hashing import block_hashes

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    two = backends(servers)
    policy = Recording(SharedIndex())
    router = Router(
        two,
        Scheduler(policy),
        DaemonConfig(),
        hash_prompts=True,
        kv_events={two[0].name: f"tcp://127.0.0.1:{port}"},
    )
    index = router.prefix
    assert index is not None and not index.learn
    s = Serving(router)
    try:
        ids = list(range(500, 500 + 16 * 6 + 5))
        hashes = block_hashes(ids, 16)
        assert hashes is not None
        stored = {
            "type": "BlockStored",
            "block_hashes": hashes[:4],  # the server holds the first 4 of 6 blocks
            "parent_block_hash": None,
            "token_ids": ids[:64],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        }
        seq = 0

        def held() -> bool:
            nonlocal seq  # PUB drops what it sends before the subscriber has joined: resend
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, [stored], 0])])
            seq += 1
            return s.on_loop(lambda: index.size(two[0].name)) == 4

        wait_for(held, "the KV events to reach the index")
        body = {"model": NAME, "prompt": ids, "max_tokens": 4}
        for _ in range(2):  # round-robin: one to each backend
            assert http_request(s.port, "POST", "/v1/completions", body, timeout=30)[0] == 200
        (req, _), _ = policy.seen
        assert req.blocks is not None and req.blocks.hashes == tuple(hashes)
        assert s.on_loop(lambda: index.cached(two[0].name, req.blocks)) == 64
        assert s.on_loop(lambda: index.size(two[1].name)) == 0  # placements teach nothing
    finally:
        s.stop()
        pub.close()
        ctx.term()
