"""route-serve's memory under clients that name many sessions with long ids: the tables a
client's input keys are bounded, whatever the keys' lengths."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from harness.procs import status_kb
from tests.daemon.test_route_serve import Router, entry, redis_url  # noqa: F401 (a fixture)
from tests.procs import NAME, Emulator, http_request

MB = 1_000_000  # under the emulated server's own 1 MiB body limit, as vLLM has none
KEYS = 1_000  # distinct sessions of each kind
WARM = 100  # of each kind first, so that the allocator's pools reach their working size
HEADER_BYTES = 8_000  # aiohttp refuses a header value past 8190 bytes
POOL = 8  # requests in flight at once
BOUND_KB = 64 * 1024  # growth over the idle size allowed


def _send(port: int, i: int, tag: str) -> int:
    """One completion naming session `tag`-i: a 1 MB "user", or an 8 KB X-Session-ID."""
    name = f"{tag}-{i:08d}-"
    body: dict[str, object] = {"model": NAME, "prompt": "hi", "max_tokens": 1}
    headers = {}
    if tag.startswith("user"):
        body["user"] = name + "u" * (MB - len(name))
    else:
        headers["X-Session-ID"] = name + "h" * (HEADER_BYTES - len(name))
    return http_request(port, "POST", "/v1/completions", json.dumps(body).encode(), headers, 60)[0]


def _round(port: int, n: int, tag: str) -> None:
    with ThreadPoolExecutor(POOL) as pool:
        got = list(pool.map(lambda i: _send(port, i, f"user-{tag}"), range(n)))
        got += pool.map(lambda i: _send(port, i, f"header-{tag}"), range(n))
    assert got == [200] * (2 * n), sorted(set(got))


def _pins(r: Router) -> float:
    for line in r.metrics().splitlines():
        if line.startswith("fleetctl_session_pins "):
            return float(line.split()[1])
    raise AssertionError("no fleetctl_session_pins on /metrics")


def test_a_thousand_distinct_1mb_session_keys_keep_route_serve_within_64mb(tmp_path):
    """Before, each pin kept its session id whole: 300 distinct 1 MB "user" values took
    route-serve from 88 MB to 382 MB."""
    emu = Emulator(tmp_path)
    r = None
    try:
        emu.wait_healthy()
        r = Router(tmp_path, [entry(emu, "rtx-1", "RTX-4090")])
        _round(r.port, WARM, "warm")
        idle = status_kb(r.proc.pid, "VmRSS")
        start = time.monotonic()
        _round(r.port, KEYS, "load")
        took = time.monotonic() - start
        grown = status_kb(r.proc.pid, "VmRSS") - idle
        print(f"idle {idle // 1024} MB, grown {grown // 1024} MB, {took:.1f} s")
        assert grown < BOUND_KB, f"route-serve grew {grown // 1024} MB over its idle size"
        assert _pins(r) == 2 * (WARM + KEYS)  # every session was pinned, none refused
        assert took < 60, took
    finally:
        if r is not None:
            r.stop()
        emu.stop()


PROMPT_CHARS = 32_000  # ~500 blocks, near the emulated model's context (40,000 are refused)


def _prompt(port: int, i: int) -> int:
    """One completion of a prompt no other shares from its first block on."""
    prompt = (f"{i:08d} " * (PROMPT_CHARS // 9 + 1))[:PROMPT_CHARS]
    body = json.dumps({"model": NAME, "prompt": prompt, "max_tokens": 1}).encode()
    return http_request(port, "POST", "/v1/completions", body, {}, 60)[0]


def _index_blocks(r: Router) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in r.metrics().splitlines()
        if line.startswith("fleetctl_prefix_index_blocks{")
    )


def test_a_thousand_distinct_long_prompts_keep_route_serve_within_64mb(tmp_path):
    """The prefix index is keyed by clients' prompts too (a 1 MB prompt is refused as over the
    context, so the longest a client may send are used). Before, its default of 1,048,576
    blocks (~150 bytes each) let these prompts grow route-serve by ~75 MB, and more of them
    by ~150 MB; the default now fills at ~40 MB."""
    from fleetctl.daemon.router import PREFIX_CAPACITY

    emu = Emulator(tmp_path)
    r = None
    try:
        emu.wait_healthy()
        r = Router(tmp_path, [entry(emu, "rtx-1", "RTX-4090")])
        with ThreadPoolExecutor(POOL) as pool:
            assert set(pool.map(lambda i: _prompt(r.port, i), range(-WARM, 0))) == {200}
            idle = status_kb(r.proc.pid, "VmRSS")
            assert set(pool.map(lambda i: _prompt(r.port, i), range(KEYS))) == {200}
        grown = status_kb(r.proc.pid, "VmRSS") - idle
        print(f"idle {idle // 1024} MB, grown {grown // 1024} MB")
        assert grown < BOUND_KB, f"route-serve grew {grown // 1024} MB over its idle size"
        assert _index_blocks(r) == PREFIX_CAPACITY  # full: its bound, not the traffic, stopped it
    finally:
        if r is not None:
            r.stop()
        emu.stop()


def test_max_sessions_bounds_the_pins_least_recently_used_first_out(tmp_path):
    emu = Emulator(tmp_path)
    r = None
    try:
        emu.wait_healthy()
        r = Router(tmp_path, [entry(emu, "rtx-1", "RTX-4090")], "--max-sessions", "50")
        for i in range(120):
            assert r.complete(headers={"X-Session-ID": f"s{i}"})[0] == 200
        assert _pins(r) == 50
    finally:
        if r is not None:
            r.stop()
        emu.stop()


def test_a_long_session_id_is_a_short_redis_key_that_expires(tmp_path, redis_url):  # noqa: F811
    import redis

    emu = Emulator(tmp_path)
    r = None
    try:
        emu.wait_healthy()
        backends = [entry(emu, "rtx-1", "RTX-4090")]
        r = Router(tmp_path, backends, "--session-store", redis_url, name="stored")
        assert r.complete(user="u" * MB)[0] == 200
        assert r.complete(headers={"X-Session-ID": "h" * HEADER_BYTES})[0] == 200
        db = redis.Redis.from_url(redis_url)
        try:  # a new pin reaches Redis before its whole answer does
            keys = list(db.scan_iter(match="fleetctl:*:session:*"))
            assert len(keys) == 2, keys
            for key in keys:
                assert len(key) < 100 and len(db.get(key) or b"") < 200, key[:200]
                assert 0 < db.ttl(key) <= 24 * 3600, key[:200]
        finally:
            db.close()
    finally:
        if r is not None:
            r.stop()
        emu.stop()
