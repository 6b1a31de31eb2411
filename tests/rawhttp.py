"""One raw HTTP/1.1 server for the tests that need bytes no real server would send: it runs on
127.0.0.1 in a thread of its own, reads each request's head and body, and a subclass's
`answer` writes whatever the test wants, well-formed or not."""

from __future__ import annotations

import asyncio
import threading

from harness.procs import free_port


class RawServer:
    """Subclasses answer each request (`answer`); `release()` sets `go`, an event an answer
    may wait on (e.g. until the test's client has a first chunk)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.go = asyncio.Event()
        self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.go.set)

    def stop(self) -> None:
        """End every connection's task inside the loop, then stop it: a task left pending
        would be finalized later, with its loop gone, in whatever code runs then."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while await self._one(r, w):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def _one(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        head = await r.readuntil(b"\r\n\r\n")
        headers = []
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        length = next((int(v) for n, v in headers if n == b"content-length"), 0)
        await r.readexactly(length)
        return await self.answer(head, headers, r, w)

    async def answer(
        self,
        head: bytes,
        headers: list[tuple[bytes, bytes]],
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
    ) -> bool:
        """Write the answer to the request that begins `head`; False ends the connection."""
        raise NotImplementedError
