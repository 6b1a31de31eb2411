"""Both transports behind the real proxy: route-serve's app, in process, in front of an
emulated vLLM server, answers whole and streamed requests through each."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from fleetctl.daemon.router import DaemonConfig
from fleetctl.daemon.serve import build_router
from fleetctl.daemon.transport import TRANSPORTS
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.statedir import StateDir
from tests.conftest import write
from tests.procs import NAME, Emulator, free_port

INVENTORY = """\
nodes:
  - name: rtx-1
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    e = Emulator(tmp_path_factory.mktemp("transport"))
    try:
        e.wait_healthy()
        yield e
    finally:
        e.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_whole_and_streamed_answers_through_each_transport(emu, tmp_path, catalog, transport):
    inv = load_inventory(write(tmp_path, INVENTORY), catalog)
    entry = {"url": emu.base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
    backends = write(tmp_path, json.dumps({"backends": [entry]}), "backends.yaml")
    router = build_router(
        inv,
        catalog,
        backends_file=backends,
        state_dir=StateDir(tmp_path / ".fleetctl"),
        policy="round-robin",
        config=DaemonConfig(transport=transport),
        scrape_interval=0.25,
    )

    async def main() -> None:
        runner = web.AppRunner(router.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": NAME, "prompt": "hello " * 10, "max_tokens": 4}
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(3):  # the second and third on a kept-alive upstream connection
                    async with s.post(url, json=body) as r:
                        assert r.status == 200, await r.text()
                        assert r.headers["X-Fleet-Backend"] == "rtx-1"
                        assert json.loads(await r.read())["choices"]
                async with s.post(url, json={**body, "stream": True}) as r:
                    assert r.status == 200
                    events = (await r.read()).split(b"\n\n")
                    assert events[-2] == b"data: [DONE]" and len(events) >= 4
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_that_leaves_mid_stream_aborts_the_upstream_answer_at_once(
    tmp_path, catalog, transport
):
    """The backend's answer would stream for 40 s; the client reads its first event and
    leaves. The router must drop the upstream connection (vLLM aborts the request on that)
    within a second or two, not read the answer to its end: the bound is a tenth of the
    answer's length, and the test waits on the backend seeing the drop, never a sleep."""
    chunks, every = 160, 0.25  # 40 s of answer
    seen = {"sent": 0}

    async def main() -> None:
        gone = asyncio.Event()
        ended = asyncio.Event()  # the answer ran to its end: the router drained it

        async def completions(request: web.Request) -> web.StreamResponse:
            await request.read()
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            try:
                for i in range(chunks):
                    await out.write(b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % i)
                    seen["sent"] = i + 1
                    await asyncio.sleep(every)
                await out.write(b"data: [DONE]\n\n")
                ended.set()
            except (ConnectionError, asyncio.CancelledError):
                gone.set()  # the write found the connection dropped, or the handler was cancelled
                raise
            return out

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": NAME, "object": "model"}]})

        backend = web.Application()
        backend.router.add_post("/v1/completions", completions)
        backend.router.add_get("/health", health)
        backend.router.add_get("/metrics", health)
        backend.router.add_get("/v1/models", models)
        up_runner = web.AppRunner(backend, handler_cancellation=True)
        await up_runner.setup()
        up_port = free_port()
        await web.TCPSite(up_runner, "127.0.0.1", up_port).start()

        inv = load_inventory(write(tmp_path, INVENTORY), catalog)
        entry = {
            "url": f"http://127.0.0.1:{up_port}",
            "node": "rtx-1",
            "gpu_type": "RTX-4090",
            "model": NAME,
        }
        backends = write(tmp_path, json.dumps({"backends": [entry]}), "backends.yaml")
        router = build_router(
            inv,
            catalog,
            backends_file=backends,
            state_dir=StateDir(tmp_path / ".fleetctl"),
            policy="round-robin",
            config=DaemonConfig(transport=transport),
            scrape_interval=0.25,
        )
        runner = web.AppRunner(router.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 4000, "stream": True})
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode())
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"data: " in await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
            writer.transport.abort()  # the client leaves after its first event
            left = asyncio.get_running_loop().time()
            await asyncio.wait_for(gone.wait(), chunks * every / 10)
            waited = asyncio.get_running_loop().time() - left
            assert not ended.is_set()
            assert seen["sent"] < chunks / 4, (seen, waited)
        finally:
            await runner.cleanup()
            await up_runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))
