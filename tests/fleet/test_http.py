"""fleetctl's GET client (fleetctl/fleet/http.py) against real sockets: answers, bounds and reasons."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fleetctl.fleet import http
from tests.procs import free_port

SLOW_TAIL = b'vllm:num_requests_running{engine="0"} 3.0\n'
PAUSE = threading.Event()  # never set: the handler waits out its timeout (0.3 s below)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self) -> None:
        if self.path == "/slow":
            # A /metrics page whose vllm: series arrive after a pause (a busy server).
            head, tail = b"python_gc_objects_collected_total 1.0\n", SLOW_TAIL
            self.send_response(200)
            self.send_header("Content-Length", str(len(head) + len(tail)))
            self.end_headers()
            self.wfile.write(head)
            self.wfile.flush()
            PAUSE.wait(0.3)
            self.wfile.write(tail)
            return
        body = {"/big": b"x" * 5000, "/ok": b'{"data": []}'}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()


def test_an_answer_of_any_status_is_a_reply(server):
    r = http.get(server + "/ok", 5)
    assert (r.status, r.json()) == (200, {"data": []})
    assert http.get(server + "/missing", 5).status == 404  # not an error: the caller decides


def test_an_answer_is_read_to_its_end_when_it_comes_in_parts(server):
    # Reading "up to n bytes" returned the first part only: a page without its vllm: series.
    assert http.get(server + "/slow", 5).body.endswith(SLOW_TAIL)


def test_the_answer_size_is_bounded(server):
    assert len(http.get(server + "/big", 5, max_bytes=5000).body) == 5000
    with pytest.raises(http.HttpError, match="over the limit"):
        http.get(server + "/big", 5, max_bytes=4999)


def test_failures_are_one_short_reason():
    with pytest.raises(http.HttpError, match=r"^connection refused$"):
        http.get(f"http://127.0.0.1:{free_port()}/health", 5)
    # A socket that listens but never answers: the connection opens, the answer never comes.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        with pytest.raises(http.HttpError, match=r"^timed out after 0\.3 s$"):
            http.get(f"http://127.0.0.1:{silent.getsockname()[1]}/health", 0.3)
    finally:
        silent.close()


def test_the_async_client_keeps_its_connection(server):
    async def main() -> None:
        client = http.Client(5)
        try:
            for _ in range(3):
                assert (await client.get(server + "/ok")).status == 200
            assert client._session is not None and client._session.connector is not None
            conns = client._session.connector._conns  # type: ignore[attr-defined]
            assert sum(len(pool) for pool in conns.values()) == 1  # one, kept alive
        finally:
            await client.close()

    asyncio.run(main())
