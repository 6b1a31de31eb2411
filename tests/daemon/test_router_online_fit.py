"""The router's online fit: from its own /metrics scrapes it learns each backend's speed.

Two real emulators of one RTX 4090 class, one of them running at half the model's speed
(`--truth-speed 0.5`); a LiveState scrapes both while requests run through them. The factor
it learns comes from the servers' emulated seconds, so the machine's load does not enter it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time

import pytest

from fleetctl.daemon.live import LiveState, where
from fleetctl.model.perf import EnginePerf
from fleetctl.routing.types import Backend
from tests.procs import NAME, Emulator

SKEW = 0.5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    logs = tmp_path_factory.mktemp("online-fit")
    started: dict[str, Emulator] = {}
    try:
        started["normal"] = Emulator(logs)
        started["slow"] = Emulator(logs, "--truth-speed", str(SKEW))
        for emu in started.values():
            emu.wait_healthy()
        yield started
    finally:
        for emu in started.values():
            emu.stop()


def _load(emu: Emulator, stop: threading.Event) -> None:
    """Requests back to back until `stop`; a failed one is the test's problem, not the load's."""
    body = {"model": NAME, "prompt": "word " * 200, "max_tokens": 64}
    while not stop.is_set():
        emu.request("POST", "/v1/completions", body, timeout=30)


def test_route_serve_learns_each_backends_speed_online(pair, catalog, caplog):
    caplog.set_level(logging.INFO, "fleetctl.router")
    model = EnginePerf(catalog.gpu("RTX-4090"), catalog.model(NAME), catalog.format("bf16"))
    backends = {
        key: Backend(emu.base, f"rtx-{key}", "RTX-4090", NAME, "bf16", 10_000, perf=model)
        for key, emu in pair.items()
    }
    live = LiveState(list(backends.values()))
    stop = threading.Event()
    load = [
        threading.Thread(target=_load, args=(emu, stop), daemon=True)
        for emu in pair.values()
        for _ in range(3)  # three at a time: batches of several sequences
    ]

    async def learn() -> None:
        task = asyncio.create_task(live.run())
        deadline = time.monotonic() + 40
        try:
            # Until both have a trusted factor fitted over enough windows to be steady.
            while not all(
                live.state(b).fit is not None and len(live.state(b).samples) >= 15
                for b in backends.values()
            ):
                assert time.monotonic() < deadline, {
                    k: (live.state(b).fit, len(live.state(b).samples)) for k, b in backends.items()
                }
                await asyncio.sleep(0.1)
        finally:
            task.cancel()

    for t in load:
        t.start()
    try:
        asyncio.run(learn())
    finally:
        stop.set()
        for t in load:
            t.join(timeout=30)
    normal, slow = backends["normal"], backends["slow"]
    assert normal.perf is not None and slow.perf is not None
    assert normal.perf.speed == pytest.approx(1.0, rel=0.25)
    assert slow.perf.speed == pytest.approx(SKEW, rel=0.25)
    fit = live.state(slow).fit
    assert fit is not None and fit.speed == slow.perf.speed
    # Decode speed only: live windows mis-measure prefill compute (the skewed fleet replay).
    assert fit.compute_speed is None and slow.perf.compute_speed is None
    # The model the router estimates with is the catalog's, only its speed replaced.
    assert slow.perf.gpu == model.gpu and slow.perf.model == model.model
    lines = [r.getMessage() for r in caplog.records if r.name == "fleetctl.router"]
    assert any(
        line.startswith(f"{where(slow)}: measured speed 0.") and "x the model's over" in line
        for line in lines
    ), lines


def _mixed_load(emu: Emulator, stop: threading.Event, k: int) -> None:
    """Distinct 400-700-token prompts (no prefix-cache hits) for 48-112 tokens each."""
    rng = random.Random(k)
    while not stop.is_set():
        prompt = [rng.randrange(100, 30_000) for _ in range(rng.randint(400, 700))]
        body = {"model": NAME, "prompt": prompt, "max_tokens": rng.randint(48, 112)}
        emu.request("POST", "/v1/completions", body, timeout=30)


def test_the_online_fit_tells_prefill_beside_the_decodes_from_decode_speed(tmp_path, catalog):
    """The same fit as `calibrate`'s: a backend at 0.7x its profile under whole prompts beside
    the decodes, six at a time, is learned at 0.7x within 15% (the prompts read as slow
    decoding once made it 0.56x)."""
    emu = Emulator(tmp_path, "--truth-speed", "0.7")
    model = EnginePerf(catalog.gpu("RTX-4090"), catalog.model(NAME), catalog.format("bf16"))
    backend = Backend(emu.base, "rtx-1", "RTX-4090", NAME, "bf16", 10_000, perf=model)
    live = LiveState([backend])
    stop = threading.Event()
    load = [
        threading.Thread(target=_mixed_load, args=(emu, stop, k), daemon=True) for k in range(6)
    ]

    async def learn() -> None:
        task = asyncio.create_task(live.run())
        deadline = time.monotonic() + 60
        try:
            while live.state(backend).fit is None or len(live.state(backend).samples) < 30:
                assert time.monotonic() < deadline, (live.state(backend).fit,)
                await asyncio.sleep(0.1)
        finally:
            task.cancel()

    try:
        emu.wait_healthy()
        for t in load:
            t.start()
        asyncio.run(learn())
    finally:
        stop.set()
        for t in load:
            t.join(timeout=30)
        emu.stop()
    fit = live.state(backend).fit
    assert fit is not None and fit.speed == pytest.approx(0.7, rel=0.15), fit
