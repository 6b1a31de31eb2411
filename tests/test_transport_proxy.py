"""Both transports behind the real proxy: route-serve's app, in process, in front of an
emulated vLLM server, answers whole and streamed requests through each."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from fleetctl.inventory import load_inventory
from fleetctl.router.daemon import DaemonConfig
from fleetctl.router.serve import build_router
from fleetctl.router.transport import TRANSPORTS
from fleetctl.statedir import StateDir
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
