"""route-serve refuses bad requests at the door: hints, JSON depth, protocol limits."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from fleetctl.daemon.router import DaemonConfig
from fleetctl.daemon.router import Router as DaemonRouter
from fleetctl.routing.registry import make_policy
from fleetctl.routing.scheduler import Scheduler
from fleetctl.routing.types import Backend
from tests.daemon.test_route_serve import INVENTORY, Router
from tests.daemon.test_router_hostile import Hostile
from tests.procs import NAME, RouterThread, free_port, http_request

RANGE = "from 0 (most urgent) to 9"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("requests")
    servers = [Hostile(), Hostile()]  # each answers every POST well while its kind is None
    backends = [
        {
            "url": f"http://127.0.0.1:{s.port}",
            "node": f"n{i}",
            "gpu_type": "RTX-4090",
            "model": NAME,
        }
        for i, s in enumerate(servers)
    ]
    backends[1]["variant"] = "gptq-int4"
    r = Router(tmp, backends, name="requests")
    try:
        yield r
    finally:
        r.stop()
        for s in servers:
            s.stop()


def error(router: Router, body: object, headers: dict | None = None) -> tuple[int, str]:
    status, _, answer = router.request("POST", "/v1/completions", body, headers)
    if status == 200:
        return status, ""
    err = json.loads(answer)["error"]
    assert err["code"] == status
    return status, err["message"]


def completion(**fields: object) -> dict:
    return {"model": NAME, "prompt": "hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    "value",
    ["-1", "1e20", "abc", "1.5", "true", "10", "99999999999", "٣".encode(), "+1", "1_0", ""],
)
def test_a_bad_x_priority_is_a_400_that_names_the_range(router, value):
    status, message = error(router, completion(), {"X-Priority": value})
    assert status == 400 and RANGE in message, message


@pytest.mark.parametrize("value", [-1, 1e20, "abc", 1.5, True, 10, "2", [1], {"a": 1}])
def test_a_bad_body_priority_is_a_400_that_names_the_range(router, value):
    status, message = error(router, completion(priority=value))
    assert status == 400 and RANGE in message, message


@pytest.mark.parametrize(
    ("header", "body"), [("0", None), ("9", None), (" 3 ", None), (None, 0), (None, 9)]
)
def test_priorities_within_the_classes_are_served(router, header, body):
    headers = {} if header is None else {"X-Priority": header}
    fields = {} if body is None else {"priority": body}
    assert error(router, completion(**fields), headers) == (200, "")


@pytest.mark.parametrize(
    "hint", ["banana", "banana;strict", "banana;prefer", "int3", "bf16x;strict"]
)
def test_an_unknown_precision_is_a_400_listing_the_models_formats(router, hint):
    status, message = error(router, completion(), {"X-Fleet-Precision": hint})
    assert status == 400, message
    assert "unknown precision" in message and "runs bf16, gptq-int4" in message, message


@pytest.mark.parametrize(
    ("hint", "nodes"),
    [
        ("int4;strict", {"n1"}),
        ("gptq-int4", {"n1"}),
        ("16bit", {"n0"}),
        ("bf16;strict", {"n0"}),
        ("fp8", {"n0", "n1"}),  # no fp8 server: a preference falls back to any
        ("FP8;prefer", {"n0", "n1"}),
    ],
)
def test_known_precisions_are_served_where_they_name(router, hint, nodes):
    """A format (`gptq-int4`), a family (`int4`, `16bit`: n1 runs gptq-int4, n0 bf16) or a
    format no server runs, preferred: served, and where the hint says."""
    for _ in range(3):
        status, headers, answer = router.request(
            "POST", "/v1/completions", completion(), {"X-Fleet-Precision": hint}
        )
        assert status == 200, answer
        assert headers["X-Fleet-Backend"] in nodes, headers["X-Fleet-Backend"]


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_json_nested_too_deep_is_a_400(router, depth):
    raw = b'{"model": "%s", "prompt": "x", "extra": %s%s}' % (
        NAME.encode(),
        b"[" * (depth - 1),
        b"]" * (depth - 1),
    )
    status, message = error(router, raw)
    assert status == 400 and "deeper than 64" in message, message


def test_json_nested_to_the_limit_is_served(router):
    raw = b'{"model": "%s", "prompt": "x", "extra": %s%s}' % (NAME.encode(), b"[" * 63, b"]" * 63)
    assert error(router, raw) == (200, "")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"user": {"id": 1}}, "'user'"),
        ({"user": ["a"]}, "'user'"),
    ],
)
def test_bad_fields_are_400s(router, fields, words):
    status, message = error(router, completion(**fields))
    assert status == 400 and words in message, message


class InProcess(RouterThread):
    """The router's app, served in a thread with serve.py's limits and a given config, in front
    of one backend. For limits the CLI does not expose, so that a test can set them low."""

    def __init__(self, config: DaemonConfig, backend_url: str):
        backend = Backend(backend_url, "n0", "RTX-4090", NAME, "bf16", kv_tokens=100_000)
        super().__init__(DaemonRouter([backend], Scheduler(make_policy("round-robin")), config))


@pytest.fixture(scope="module")
def strict_router():
    server = Hostile()
    config = DaemonConfig(body_timeout_s=0.5, idle_timeout_s=0.5, linger_s=0.1)
    r = InProcess(config, f"http://127.0.0.1:{server.port}")
    try:
        yield r
    finally:
        r.stop()
        server.stop()


def exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Send `data`, then read until the router closes the connection: (what came back, seconds
    it took). The socket timeout only stops a hung test."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got, time.monotonic() - started


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_request_head_that_never_ends_is_dropped_after_the_idle_timeout(strict_router):
    """idle_timeout_s 0.5: dropped after that half second, not the socket's 20 s nor a timeout
    five times the one set (the 2 s over it are a loaded machine's)."""
    got, took = exchange(strict_router.port, HEAD + b"X-Slow: 1\r\n")
    assert got == b"" and 0.4 <= took < 2.5, took


def test_a_request_body_that_never_ends_is_a_408_and_closed(strict_router):
    got, took = exchange(strict_router.port, HEAD + b'Content-Length: 100\r\n\r\n{"model"')
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"not received within 0.5 s" in got and 0.4 <= took < 2.5, took


def test_route_serves_head_and_body_timeouts_are_75_and_60_s():
    """README: a request head must arrive within 75 s of the connection opening or of its
    last answer, and a body within 60 s of its head. The tests above run both at 0.5 s through
    the same settings; route-serve (no flag sets them) runs DaemonConfig's defaults."""
    from fleetctl.daemon.serve import server_options

    config = DaemonConfig()
    assert server_options(config)["keepalive_timeout"] == 75.0
    assert config.body_timeout_s == 60.0


def test_a_whole_request_is_still_served(strict_router):
    body = json.dumps(completion()).encode()
    got, _ = exchange(
        strict_router.port,
        HEAD + b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert got.startswith(b"HTTP/1.1 200 "), got[:200]


@pytest.mark.parametrize(
    "head",
    [
        HEAD + b"X-Long: " + b"a" * 9000 + b"\r\n",  # one header over MAX_FIELD_BYTES
        b"POST /v1/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n",  # request line too long
        HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(200)),  # over MAX_HEADERS lines
    ],
    ids=["header-too-long", "request-line-too-long", "too-many-headers"],
)
def test_request_heads_past_the_limits_are_refused(strict_router, head):
    got, _ = exchange(strict_router.port, head + b"Content-Length: 2\r\n\r\n{}")
    assert got.split(b" ", 2)[1] in (b"400", b"414", b"431"), got[:200]


def _head_status(port: int, head: bytes) -> bytes:
    body = json.dumps(completion()).encode()
    tail = b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    got, _ = exchange(port, head + tail)
    return got.split(b" ", 2)[1]


def test_request_head_limits_hold_at_their_bounds(strict_router):
    """README: request line and each header line at most 8190 bytes, at most 128 header
    lines. As aiohttp applies them (serve.py's MAX_LINE_BYTES, MAX_FIELD_BYTES,
    MAX_HEADERS): the request target up to 8190 bytes, each header's value up to 8190, 128
    header lines; one byte or one line more is refused."""
    port = strict_router.port
    base = b"Host: x\r\nContent-Type: application/json\r\n"

    def served(head: bytes) -> bool:
        status = _head_status(port, head)
        assert status in (b"200", b"414", b"431"), status
        return status == b"200"

    for size, ok in ((8190, True), (8191, False)):
        target = b"/v1/completions?" + b"a" * (size - len(b"/v1/completions?"))
        assert served(b"POST " + target + b" HTTP/1.1\r\n" + base) is ok, size
        assert served(HEAD + b"X-Long: " + b"a" * size + b"\r\n") is ok, size
    # HEAD has Host and Content-Type; the tail adds Connection and Content-Length.
    for lines, ok in ((128, True), (129, False)):
        assert served(HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(lines - 4))) is ok


# What aiohttp's HTTP parser refuses before any route sees the request: each is answered in
# the OpenAI error shape with the status that fits, and the connection closed (before, a
# plain-text 400 for every one).
PROTOCOL_ERRORS = {
    "header-of-9000-bytes": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000, 431),
    "200-headers": (
        b"GET /health HTTP/1.1\r\nHost: x" + b"".join(b"\r\nX-H%d: v" % i for i in range(200)),
        431,
    ),
    "target-of-9000-bytes": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x", 414),
    "method-brew": (b"BREW /health HTTP/1.1\r\nHost: x", 501),
    "content-length-and-transfer-encoding": (
        HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0",
        400,
    ),
    "tls-hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),
    # Refused by aiohttp past its parser but before any route, as plain text all the same: an
    # expectation other than 100-continue, targets no route can match (not a path).
    "expect-other-than-100-continue": (HEAD + b"Expect: 200-ok\r\nContent-Length: 2", 417),
    "asterisk-form-target": (b"OPTIONS * HTTP/1.1\r\nHost: x", 404),
    "authority-form-target": (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: x", 404),
}


@pytest.mark.parametrize("case", PROTOCOL_ERRORS)
def test_protocol_errors_are_openai_shaped_json(router, case):
    data, status = PROTOCOL_ERRORS[case]
    got, _ = exchange(router.port, data + b"\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"%d" % status, got[:300]
    assert b"Content-Type: application/json" in head, head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["type"] == "invalid_request_error", err
    assert "aaaa" not in err["message"] and len(err["message"]) < 120, err  # no echo
    assert router.request("GET", "/health")[0] in (200, 503)  # and it still serves


def test_expect_100_continue_is_answered_before_the_body_is_sent(router):
    """route-serve handles Expect itself (to refuse other expectations as JSON): the interim
    100 still comes first, and the body sent after it is served."""
    body = json.dumps(completion()).encode()
    head = HEAD + b"Expect: 100-continue\r\nConnection: close\r\n"
    with socket.create_connection(("127.0.0.1", router.port), timeout=20) as s:
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        assert got == b"HTTP/1.1 100 Continue\r\n\r\n", got
        s.sendall(body)
        while chunk := s.recv(65536):
            got += chunk
    assert got.split(b"\r\n\r\n", 1)[1].startswith(b"HTTP/1.1 200 "), got[:300]


def test_values_written_into_headers_cannot_split_them():
    """A node name with CR/LF (validation should have refused it) is escaped where the
    X-Fleet-Backend header is written, and the request is still served."""
    server = Hostile()
    r = InProcess(DaemonConfig(), f"http://127.0.0.1:{server.port}")
    r.router.backends[0].node = "evil\r\nSet-Cookie: a=b\x00"
    try:
        status, headers, body = http_request(r.port, "POST", "/v1/completions", completion())
        assert status == 200, body
        assert headers["X-Fleet-Backend"] == "evil\\x0d\\x0aSet-Cookie: a=b\\x00"
        assert "Set-Cookie" not in headers
    finally:
        r.stop()
        server.stop()


def test_a_backends_file_node_name_with_control_characters_is_refused(tmp_path):
    bad = {"url": "http://127.0.0.1:9", "node": "a\r\nb", "gpu_type": "RTX-4090", "model": NAME}
    path = tmp_path / "backends.yaml"
    path.write_text(json.dumps({"backends": [bad]}))
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetctl",
            "route-serve",
            str(inv),
            "--backends",
            str(path),
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "node" in out.stderr and "Traceback" not in out.stderr
