"""route-serve in front of a backend that breaks its answers on purpose, byte for byte."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import struct
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.test_route_serve import CAPTURE, Router
from tests.procs import NAME
from tests.rawhttp import RawServer

BODY = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
).encode()
GOOD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BODY),
    BODY,
)
JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices": [{"text": "a"}]}\n\n'
FIRST = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)

# name: (bytes the backend sends, then how it ends: close, reset or stall). Each must end in a
# 502 for the client, never an internal error, and leave the counters as they were.
BREAKS = {
    "content-length-not-ascii-digits": (JSON_HEAD + b"Content-Length: \xb2\r\n\r\n{}", "close"),
    "content-length-negative": (JSON_HEAD + b"Content-Length: -1\r\n\r\n" + BODY, "close"),
    "content-length-huge-number": (
        JSON_HEAD + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n" + BODY,
        "close",
    ),
    "content-length-conflicting": (
        JSON_HEAD + b"Content-Length: 2\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
        "close",
    ),
    "content-length-and-chunked": (
        JSON_HEAD
        + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (len(BODY), BODY),
        "close",
    ),
    "status-line-garbage": (b"HTPT/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", "close"),
    "status-code-not-ascii-digits": (
        b"HTTP/1.1 \xb2\xb2\xb2 OK\r\nContent-Length: 2\r\n\r\n{}",
        "close",
    ),
    "status-code-out-of-range": (b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\n{}", "close"),
    "header-huge": (JSON_HEAD + b"X-Big: " + b"a" * 200_000 + b"\r\n\r\n", "close"),
    "headers-too-many": (
        JSON_HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"\r\n",
        "close",
    ),
    "header-value-with-lf": (
        JSON_HEAD + b"X-Evil: a\nSet-Cookie: b=c\r\n" + GOOD.split(b"\r\n", 1)[1],
        "close",
    ),
    "header-line-without-colon": (JSON_HEAD + b"Nonsense\r\n\r\n{}", "close"),
    "chunk-size-not-hex": (
        JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "close",
    ),
    "chunk-size-negative": (
        JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n",
        "close",
    ),
    "chunk-size-0x-prefix": (
        JSON_HEAD
        + b"Transfer-Encoding: chunked\r\n\r\n0x%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
        "close",
    ),
    "chunked-truncated": (
        JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n{" % len(BODY),
        "close",
    ),
    "body-stalls": (JSON_HEAD + b"Content-Length: %d\r\n\r\n{" % len(BODY), "stall"),
    "head-stalls": (JSON_HEAD, "stall"),
    "reset-mid-body": (JSON_HEAD + b"Content-Length: %d\r\n\r\n{" % len(BODY), "reset"),
    "reset-mid-until-close-body": (JSON_HEAD + b"Connection: close\r\n\r\n" + BODY[:20], "reset"),
    "closed-before-status": (b"", "close"),
    "reset-before-status": (b"", "reset"),
    "not-json": (JSON_HEAD + b"Content-Length: 12\r\n\r\n<html></html", "close"),
    "truncated-json-until-close": (JSON_HEAD + b"Connection: close\r\n\r\n" + BODY[:20], "close"),
}
# Streaming answers: the first event reaches the client, then the backend breaks; the client's
# stream must end with an error event.
STREAM_BREAKS = {
    "stream-stalls": (b"", "stall"),
    "stream-reset": (b"", "reset"),
    "stream-closed": (b"", "close"),
    "stream-chunk-size-not-hex": (b"zz\r\n", "close"),
    "stream-chunk-overruns-its-size": (b"2\r\nabcdef\r\n", "close"),
    "stream-chunk-size-huge": (b"f" * 100 + b"\r\n", "close"),
}


class Hostile(RawServer):
    """A raw HTTP server: GET /metrics gets the captured vLLM page; each POST gets `kind`'s
    bytes (GOOD when None). Stream kinds send the head and one event, then wait for `go`
    before breaking."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.auth: list[bytes] = []  # Authorization headers of the POSTs, as received
        super().__init__()

    async def answer(
        self,
        head: bytes,
        headers: list[tuple[bytes, bytes]],
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
    ) -> bool:
        self.auth += [v for n, v in headers if n == b"authorization"]
        if head.startswith(b"GET /metrics"):
            page = CAPTURE.encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page))
            return True
        kind = self.kind
        if kind is None:
            w.write(GOOD)
            return True
        if kind in STREAM_BREAKS:
            self.go.clear()
            w.write(SSE_HEAD + FIRST)
            await w.drain()
            await self.go.wait()  # the client has the first event
            data, end = STREAM_BREAKS[kind]
        else:
            data, end = BREAKS[kind]
        w.write(data)
        await w.drain()
        if end == "stall":
            await r.read()  # until the router gives up and closes
        elif end == "reset":
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
        return False


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    server = Hostile()
    backend = {
        "url": f"http://127.0.0.1:{server.port}",
        "node": "hostile",
        "gpu_type": "RTX-4090",
        "model": NAME,
    }
    # A backend that stalls is given up after 2 s of silence (a good answer from the in-process
    # backend takes milliseconds: 2 s leaves a loaded machine a wide margin).
    router = Router(tmp, [backend], "--upstream-timeout", "2", name="hostile")
    try:
        yield router, server, backend["url"]
    finally:
        router.stop()
        server.stop()


def held(router: Router, url: str) -> dict[str, float]:
    """What the router holds against the backend, from its /metrics."""
    names = {
        "fleetctl_backend_outstanding_requests": "outstanding",
        "fleetctl_backend_reserved_tokens": "reserved",
        "fleetctl_backend_pending_prefill_tokens": "prefill",
    }
    out = {}
    for family in text_string_to_metric_families(router.metrics()):
        for s in family.samples:
            if s.name in names and s.labels["backend"] == url:
                out[names[s.name]] = s.value
    assert set(out) == set(names.values()), out
    return out


def post(router: Router, stream: bool) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    body = {"model": NAME, "prompt": "hello " * 20, "max_tokens": 8, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def check_router_is_whole(router: Router, server: Hostile, url: str, before: dict, log: int):
    """The counters are back where they were, a good answer goes through, and the router's log
    since offset `log` shows no internal error."""
    assert held(router, url) == before
    server.kind = None
    resp = post(router, stream=False)
    assert resp.status == 200 and json.loads(resp.read()) == json.loads(BODY)
    assert held(router, url) == before
    text = router.log.read_text()[log:]
    assert "Traceback" not in text and "Error handling request" not in text, text


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_a_broken_answer_is_a_502_and_leaves_no_counter_raised(hostile, kind):
    router, server, url = hostile
    before, log = held(router, url), len(router.log.read_text())
    server.kind = kind
    started = time.monotonic()
    resp = post(router, stream=False)
    answer = resp.read()
    took = time.monotonic() - started
    assert resp.status == 502, answer
    if BREAKS[kind][1] == "stall":  # given up by --upstream-timeout 2, not the client's 30 s
        assert 1.9 < took < 8, took
    assert json.loads(answer)["error"]["type"] == "server_error"
    assert "X-Evil" not in resp.headers and "Set-Cookie" not in resp.headers
    check_router_is_whole(router, server, url, before, log)


@pytest.mark.parametrize("kind", sorted(STREAM_BREAKS))
def test_a_stream_broken_midway_ends_with_an_error_event(hostile, kind):
    router, server, url = hostile
    before, log = held(router, url), len(router.log.read_text())
    server.kind = kind
    resp = post(router, stream=True)
    assert resp.status == 200
    first = resp.read1(len(EVENT))
    server.release()
    started = time.monotonic()
    rest = resp.read()  # must end, not hang
    took = time.monotonic() - started
    if STREAM_BREAKS[kind][1] == "stall":  # given up by --upstream-timeout 2
        assert 1.9 < took < 8, took
    assert first + rest[: len(EVENT) - len(first)] == EVENT
    last = rest.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    assert json.loads(last[6:])["error"]["code"] == 502
    check_router_is_whole(router, server, url, before, log)


def test_client_header_bytes_outside_latin1_reach_the_backend_unharmed(hostile):
    """aiohttp decodes header bytes as UTF-8; the forwarded Authorization must be re-encoded
    to the same bytes, not fail the request (and leave the counters raised)."""
    router, server, url = hostile
    before, log = held(router, url), len(router.log.read_text())
    server.kind = None
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    body = {"model": NAME, "prompt": "hello", "max_tokens": 8}
    auth = "Bearer sk-€-ключ".encode()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": auth})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.read()
    assert server.auth[-1] == auth
    check_router_is_whole(router, server, url, before, log)
