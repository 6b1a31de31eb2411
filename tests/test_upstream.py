"""The router's upstream HTTP/1.1 client against real servers (raw asyncio ones and aiohttp)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from fleetctl.router.upstream import BadResponse, ServerDisconnected, Upstream
from tests.procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Raw:
    """A raw TCP server: `handler` runs once per connection; `conns` counts them."""

    def __init__(self, handler: Handler):
        self.handler, self.conns = handler, 0

    async def __aenter__(self) -> Raw:
        async def run(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.conns += 1
            try:
                await self.handler(r, w)
            finally:
                w.close()

        self.server = await asyncio.start_server(run, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def request(r: asyncio.StreamReader) -> bytes:
    """One request from the client, whole; b"" when it closed instead."""
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await r.readexactly(length)


def answering(*answers: bytes) -> Handler:
    """Answers one request per item, on the same connection."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for a in answers:
            if not await request(r):
                return
            w.write(a)
            await w.drain()
        await r.read()  # until the client closes

    return handler


def run(coro: Awaitable[None]) -> None:
    """Run a test's coroutine; the bound only stops a test that would hang."""
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


async def until(check: Callable[[], bool]) -> None:
    """Wait for a condition (the event loop runs meanwhile); `run`'s bound stops a hang."""
    while not check():
        await asyncio.sleep(0.01)


def test_request_bytes_and_content_length_body():
    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(await request(r))
        w.write(b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\nX-Thing:  a b \r\n\r\nhello")
        await r.read()

    async def main() -> None:
        async with Raw(handler) as srv:
            up = Upstream(5, 5)
            resp = await up.post(srv.url, b'{"a": 1}', {"Authorization": "Bearer k"})
            with resp:
                assert resp.status == 201
                assert resp.headers["Content-Length"] == "5"  # any case
                assert resp.headers["x-thing"] == "a b"
                assert await resp.read() == b"hello"
            up.close()
        port = srv.url.split(":")[2].split("/")[0]
        assert seen == [
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode() + b"\r\n"
            b"Content-Length: 8\r\nAuthorization: Bearer k\r\n\r\n" + b'{"a": 1}'
        ]

    run(main())


def test_chunked_body_with_extensions_and_trailers():
    body = b"4;ext=1\r\nWiki\r\n6\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nX-T: 1\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def main() -> None:
        async with Raw(answering(head + body, OK)) as srv:
            up = Upstream(5, 5)
            with await up.post(srv.url, b"{}", {}) as resp:
                assert await resp.read() == b"Wikipedia in \r\n\r\nchunks."
            with await up.post(srv.url, b"{}", {}) as resp:  # the trailers were consumed
                assert await resp.read() == b"ok"
            up.close()
            assert srv.conns == 1

    run(main())


def test_until_close_body_and_connection_close_are_not_reused():
    async def main() -> None:
        async def until_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            w.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")

        async with Raw(until_close) as srv:
            up = Upstream(5, 5)
            for _ in range(2):
                with await up.post(srv.url, b"{}", {}) as resp:
                    assert await resp.read() == b"all of it"
            assert srv.conns == 2
        async with Raw(answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + OK[17:])) as srv:
            for _ in range(2):
                with await up.post(srv.url, b"{}", {}) as resp:
                    assert await resp.read() == b"ok"
            assert srv.conns == 2
            up.close()

    run(main())


def test_stream_delivers_each_chunk_before_the_next_is_sent():
    async def main() -> None:
        got_first = asyncio.Event()

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            w.write(b'10\r\ndata: {"a": 1}\n\n\r\n')
            await w.drain()
            await got_first.wait()  # only once the client has the first chunk
            w.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await r.read()

        async with Raw(handler) as srv:
            up = Upstream(5, 5)
            with await up.post(srv.url, b"{}", {}) as resp:
                assert await resp.read_chunk() == b'data: {"a": 1}\n\n'
                got_first.set()
                assert await resp.read_chunk() == b"data: [DONE]\n\n"
                assert await resp.read_chunk() == b""
            up.close()

    run(main())


def test_keep_alive_reuses_one_connection():
    async def main() -> None:
        peers: list[object] = []

        async def handler(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
            return web.json_response({"n": len(peers)})

        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        up = Upstream(5, 5)
        for n in (1, 2):
            with await up.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {}) as resp:
                assert await resp.read() == b'{"n": %d}' % n
        up.close()
        await runner.cleanup()
        assert len(peers) == 2 and peers[0] == peers[1]

    run(main())


def test_idle_connection_closed_by_the_server_is_replaced():
    async def main() -> None:
        async def one_then_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            w.write(OK)  # keep-alive by default, then it closes anyway

        async with Raw(one_then_close) as srv:
            up = Upstream(5, 5)
            for _ in range(2):
                with await up.post(srv.url, b"{}", {}) as resp:
                    assert await resp.read() == b"ok"
                # The server's close reaches the idle connection, which is seen closed while
                # idle and so dropped (never handed out for the next request).
                await until(lambda: not any(up._pools.values()))
            assert srv.conns == 2
            up.close()

    run(main())


def test_reused_connection_dropped_before_answering_is_retried_once():
    async def main() -> None:
        # The first connection answers once, then drops the next request unanswered: the race
        # of a server's keep-alive timeout. Later connections answer.
        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if srv.conns > 1:
                return await answering(OK)(r, w)
            await request(r)
            w.write(OK)
            await request(r)

        async with Raw(handler) as srv:
            up = Upstream(5, 5)
            for _ in range(2):
                with await up.post(srv.url, b"{}", {}) as resp:
                    assert await resp.read() == b"ok"
            assert srv.conns == 2
            up.close()

    run(main())


def test_no_retry_once_the_server_answered_or_on_a_fresh_connection():
    async def main() -> None:
        async def partial_second(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            w.write(OK)
            await request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Le")  # then drops it

        async with Raw(partial_second) as srv:
            up = Upstream(5, 5)
            with await up.post(srv.url, b"{}", {}) as resp:
                await resp.read()
            with pytest.raises(ServerDisconnected):
                await up.post(srv.url, b"{}", {})
            assert srv.conns == 1

        async def drop(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)

        async with Raw(drop) as srv:
            with pytest.raises(ServerDisconnected):
                await up.post(srv.url, b"{}", {})
            assert srv.conns == 1
            up.close()

    run(main())


def test_connection_refused():
    async def main() -> None:
        up = Upstream(5, 5)
        with pytest.raises(ConnectionRefusedError):
            await up.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}", {})

    run(main())


def test_read_timeouts_before_the_head_and_between_chunks():
    async def main() -> None:
        async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            await r.read()

        async def stalls(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
            await r.read()

        # A connect timeout far above the read timeout: only the read timeout can end the wait
        # within the upper bound, which leaves a loaded machine plenty of room.
        up = Upstream(30, 0.3)
        async with Raw(silent) as srv:
            t = time.monotonic()
            with pytest.raises(TimeoutError):
                await up.post(srv.url, b"{}", {})
            assert 0.25 < time.monotonic() - t < 10
        async with Raw(stalls) as srv:
            with await up.post(srv.url, b"{}", {}) as resp:
                assert await resp.read_chunk() == b"ab"
                with pytest.raises(TimeoutError):
                    await resp.read_chunk()
        up.close()

    run(main())


def test_cancelled_reader_closes_the_connection():
    async def main() -> None:
        closed = asyncio.Event()

        async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
            await r.read()  # returns when the client closes its end
            closed.set()

        got_first = asyncio.Event()

        async def reader() -> None:
            with await up.post(srv.url, b"{}", {}) as resp:
                await resp.read_chunk()
                got_first.set()
                await resp.read_chunk()  # waits for a chunk that never comes

        async with Raw(handler) as srv:
            up = Upstream(5, 60)
            task = asyncio.create_task(reader())
            await got_first.wait()  # the reader ran on into the second read, and waits there
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await closed.wait()  # `run`'s bound stops it if the connection stays open
            assert not any(up._pools.values())  # not kept for reuse either
            up.close()

    run(main())


def test_an_answer_read_whole_is_capped():
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"400\r\n"
        + b"x" * 1024
        + b"\r\n" * 2
    )

    async def main() -> None:
        up = Upstream(5, 5, max_body=1000)
        for answer in (big, chunked):
            async with Raw(answering(answer)) as srv:
                resp = await up.post(srv.url, b"{}", {})
                with resp, pytest.raises(BadResponse, match="over 1000"):
                    await resp.read()
        up.close()

    run(main())


def test_endless_interim_answers_are_refused():
    async def main() -> None:
        async with Raw(answering(b"HTTP/1.1 100 Continue\r\n\r\n" * 20 + OK)) as srv:
            up = Upstream(5, 5)
            with pytest.raises(BadResponse, match="interim"):
                await up.post(srv.url, b"{}", {})
            up.close()

    run(main())


def test_good_chunks_come_out_before_the_error_that_follows_them():
    async def main() -> None:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n-1\r\n"
        async with Raw(answering(answer)) as srv:
            up = Upstream(5, 5)
            with await up.post(srv.url, b"{}", {}) as resp:
                assert await resp.read_chunk() == b"ab"
                with pytest.raises(BadResponse, match="chunk size"):
                    await resp.read_chunk()
            up.close()

    run(main())
