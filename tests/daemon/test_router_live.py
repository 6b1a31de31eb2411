"""The router's live state against real servers: the model name each backend serves, and the
log lines of ejection and readmission."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from fleetctl.daemon.backends import body_for, model_problem
from fleetctl.daemon.live import BUSY_GRACE_S, LiveState
from fleetctl.fleet.http import Client
from fleetctl.routing.types import Backend
from tests.conftest import REPO
from tests.procs import NAME, SOURCE, Emulator, free_port, http_request, stop_process

ONE_NODE = (
    "nodes:\n  - name: rtx-1\n    gpus: {type: RTX-4090, count: 1}\n"
    "models:\n  - name: llama-3-8b\n    profile: llama-3-8b\n"
    "    variants:\n      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}\n"
    "    max_context: 8192\n"
)
WRONG = f'serves "{SOURCE}", not "{NAME}": start vLLM with --served-model-name {NAME}'


@pytest.fixture(scope="module")
def emus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    # `right` serves the inventory's name; `hf` the Hugging Face id (vLLM's default when
    # started without --served-model-name).
    e = {"right": Emulator(tmp), "hf": Emulator(tmp, "--served-model-name", SOURCE)}
    try:
        for one in e.values():
            one.wait_healthy()
        yield e
    finally:
        for one in e.values():
            one.stop()


def backend(emu: Emulator, node: str, served_name: str = "") -> Backend:
    b = Backend(emu.base, node, "RTX-4090", NAME, "bf16", 10_000)
    b.served_name = served_name
    return b


def scrape(live: LiveState, *backends: Backend) -> None:
    async def main() -> None:
        client = Client(5.0)
        try:
            for b in backends:
                await live.scrape(client, b)
        finally:
            await client.close()

    asyncio.run(main())


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fleetctl.router"]


def test_a_backend_serving_another_name_is_left_out_with_the_fix(emus, caplog):
    caplog.set_level(logging.INFO, "fleetctl.router")
    right, wrong = backend(emus["right"], "rtx-1"), backend(emus["hf"], "rtx-3")
    live = LiveState([right, wrong])
    scrape(live, right, wrong)
    assert right.healthy and not wrong.healthy
    port = emus["hf"].port
    assert messages(caplog) == [
        f"rtx-3 {WRONG}, or set served_name in the backends file; left out of routing"
    ]
    assert live.unhealthy() == {f"rtx-3:{port}": live.state(wrong).wrong_model}
    assert WRONG in live.unhealthy()[f"rtx-3:{port}"]
    # Checked again (a scrape after its retry time): still out, and not logged again.
    live.state(wrong).models_due = 0.0
    scrape(live, wrong)
    assert not wrong.healthy and len(messages(caplog)) == 1
    # A /metrics scrape that goes through does not bring it back either (it would 404).
    assert live.state(wrong).scraped_at > 0


def test_served_name_renames_the_model_and_the_backend_answers(emus, caplog):
    caplog.set_level(logging.INFO, "fleetctl.router")
    aliased = backend(emus["hf"], "rtx-3", served_name=SOURCE)
    live = LiveState([aliased])
    scrape(live, aliased)
    assert aliased.healthy and messages(caplog) == []
    raw = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2}).encode()
    # As the client sent it the backend refuses it; renamed for it, it answers.
    status, _, _ = http_request(emus["hf"].port, "POST", "/v1/completions", raw)
    assert status == 404
    status, _, answer = http_request(
        emus["hf"].port, "POST", "/v1/completions", body_for(aliased, raw)
    )
    assert status == 200 and json.loads(answer)["choices"]
    assert body_for(backend(emus["right"], "rtx-1"), raw) is raw  # no alias: not even parsed


def test_a_wrong_served_name_is_named_and_fixed_on_the_next_check(emus, caplog):
    caplog.set_level(logging.INFO, "fleetctl.router")
    b = backend(emus["right"], "rtx-1", served_name="llama-typo")
    live = LiveState([b])
    scrape(live, b)
    assert not b.healthy
    (line,) = messages(caplog)
    assert line.startswith(f'rtx-1 serves "{NAME}", not "llama-typo" (its served_name for')
    # The file is fixed and reloaded: the new backend is checked at once and comes back.
    fixed = backend(emus["right"], "rtx-1")
    fixed.healthy = b.healthy  # as the daemon's reload keeps it
    live.backends = [fixed]
    scrape(live, fixed)
    assert fixed.healthy
    assert messages(caplog)[1:] == [f'readmitted rtx-1:{emus["right"].port}: it serves "{NAME}"']


def test_model_problem_lists_what_the_server_serves():
    b = Backend("http://h:8000", "rtx-3", "RTX-4090", "llama-3-8b", "bf16", 1000)
    assert model_problem(b, ["llama-3-8b"]) == ""
    assert model_problem(b, []).startswith('rtx-3 serves no model, not "llama-3-8b"')
    assert model_problem(b, ["a", "b"]).startswith('rtx-3 serves "a", "b", not "llama-3-8b"')


def test_an_answer_that_is_not_vllms_model_list_gives_no_verdict(caplog):
    """A server without /v1/models (a stand-in, a proxy) is judged by /metrics and requests."""
    caplog.set_level(logging.INFO, "fleetctl.router")
    dead = Backend(f"http://127.0.0.1:{free_port()}", "rtx-9", "RTX-4090", NAME, "bf16", 1000)
    live = LiveState([dead])
    scrape(live, dead)
    assert live.state(dead).wrong_model == ""


def test_ejection_and_readmission_are_logged_once_with_their_reason(emus, caplog):
    caplog.set_level(logging.INFO, "fleetctl.router")
    port = free_port()
    dead = Backend(f"http://127.0.0.1:{port}", "rtx-2", "RTX-4090", NAME, "bf16", 1000)
    live = LiveState([dead])
    for _ in range(3):
        scrape(live, dead)
        live.state(dead).ejected_until = 0.0  # no waiting out the backoff: probe again now
    assert not dead.healthy
    assert messages(caplog) == [
        f"ejected rtx-2:{port} for 1 s after 3 failures: /metrics connection refused"
    ]
    # A live server at the same place: the probe after the backoff readmits it, logged once.
    up = backend(emus["right"], "rtx-1")
    live = LiveState([up])
    for _ in range(3):
        live.failed(up, time.monotonic() - 60, "connection reset")  # backoff long over
    scrape(live, up)
    scrape(live, up)
    assert up.healthy
    assert messages(caplog)[1:] == [
        f"ejected rtx-1:{emus['right'].port} for 1 s after 3 failures: connection reset",
        f"readmitted rtx-1:{emus['right'].port}: /metrics answered (its next failure ejects it again)",
    ]


class Clock:
    """The monotonic clock LiveState reads, set by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_v1_models_is_read_again_every_10_s(monkeypatch):
    """README: each backend's /v1/models is read at start, after a reload and every 10 s.
    LiveState's scrapes against a real server that logs each /v1/models read, with the clock
    LiveState reads set by the test: a read at the first scrape, none at 9.9 s, one at 10 s,
    none at 19.9 s, one at 20 s; a reload (a new Backend for the same server) is read at once.
    """
    from aiohttp import web

    import fleetctl.daemon.live as live_module

    clock = Clock()
    monkeypatch.setattr(live_module, "time", clock)
    reads: list[float] = []

    async def main() -> None:
        async def models(_: web.Request) -> web.Response:
            reads.append(clock.now)
            return web.json_response({"object": "list", "data": [{"id": NAME, "object": "model"}]})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="# no series\n")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        b = Backend(f"http://127.0.0.1:{port}", "rtx-1", "RTX-4090", NAME, "bf16", 10_000)
        live = LiveState([b])
        client = Client(5.0)
        start = clock.now
        try:
            for t in (0.0, 0.25, 9.9, 10.0, 10.25, 19.9, 20.0):
                clock.now = start + t
                await live.scrape(client, b)
            assert b.healthy
            assert [r - start for r in reads] == [0.0, 10.0, 20.0]
            # A reload makes a new Backend: read at once, then 10 s on from there.
            again = Backend(b.name, "rtx-1", "RTX-4090", NAME, "bf16", 10_000)
            live.backends = [again]
            for t in (20.25, 30.0, 30.25):
                clock.now = start + t
                await live.scrape(client, again)
            assert [r - start for r in reads] == [0.0, 10.0, 20.0, 20.25, 30.25]
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_route_serve_leaves_out_a_backend_serving_another_name(emus, tmp_path):
    """End to end: route-serve reads /v1/models at start, logs the fix once, and sends every
    request to the backend that serves the name; a backend that is not there is ejected, and
    its log line says why."""
    dead = free_port()
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "nodes:\n  - name: rtx-[1:3]\n    gpus: {type: RTX-4090, count: 1}\n"
        "models:\n  - name: llama-3-8b\n    profile: llama-3-8b\n"
        "    variants:\n      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}\n"
        "    max_context: 8192\n"
    )
    entries = [
        {"url": emus["right"].base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME},
        {"url": emus["hf"].base, "node": "rtx-3", "gpu_type": "RTX-4090", "model": NAME},
        {"url": f"http://127.0.0.1:{dead}", "node": "rtx-2", "gpu_type": "RTX-4090", "model": NAME},
    ]
    (tmp_path / "backends.yaml").write_text(json.dumps({"backends": entries}))
    port = free_port()
    log = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
    cmd += ["--backends", str(tmp_path / "backends.yaml"), "--listen", f"127.0.0.1:{port}"]
    cmd += ["--state-dir", str(tmp_path / "state"), "--policy", "round-robin"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        end = time.monotonic() + 60  # only stops a hang
        while True:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            try:
                health = json.loads(http_request(port, "GET", "/health", timeout=2)[2])
                break
            except OSError:
                time.sleep(0.05)
        listening = time.monotonic()
        # "Read at start": the first scrape round reads /v1/models, so rtx-3 is out within a
        # few scrapes (250 ms each), not at the periodic re-read 10 s on (MODELS_EVERY_S). The
        # 5 s bound is half that, and 20 scrape intervals for a busy machine.
        while health.get("healthy") != 1 or f"rtx-3:{emus['hf'].port}" not in health.get(
            "unhealthy", {}
        ):
            assert time.monotonic() < listening + 5, (health, log.read_text())
            time.sleep(0.05)
            health = json.loads(http_request(port, "GET", "/health", timeout=2)[2])
        body = {"model": NAME, "prompt": "hello", "max_tokens": 2}
        for _ in range(6):  # round-robin would send two thirds of them elsewhere
            status, headers, _ = http_request(port, "POST", "/v1/completions", body)
            assert status == 200 and headers["X-Fleet-Backend"] == "rtx-1"
        text = log.read_text().splitlines()
        assert [line for line in text if "served-model-name" in line] == [
            f"rtx-3 {WRONG}, or set served_name in the backends file; left out of routing"
        ]
        assert [line for line in text if line.startswith("ejected")] == [
            f"ejected rtx-2:{dead} for 1 s after 3 failures: /metrics connection refused"
        ]
        # /health names each backend left out, and why, rather than a bare count.
        reasons = json.loads(http_request(port, "GET", "/health", timeout=5)[2])["unhealthy"]
        assert set(reasons) == {f"rtx-3:{emus['hf'].port}", f"rtx-2:{dead}"}, reasons
        assert "--served-model-name" in reasons[f"rtx-3:{emus['hf'].port}"]
    finally:
        stop_process(proc)


def test_route_serve_renames_the_model_for_a_backend_with_a_served_name(emus, tmp_path):
    """A vLLM started without --served-model-name answers 404 to the inventory's name; with
    served_name in the backends file, route-serve sends the name it serves, and it answers."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(ONE_NODE)
    entry = {"url": emus["hf"].base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
    (tmp_path / "backends.yaml").write_text(
        json.dumps({"backends": [{**entry, "served_name": SOURCE}]})
    )
    port = free_port()
    log = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
    cmd += ["--backends", str(tmp_path / "backends.yaml"), "--listen", f"127.0.0.1:{port}"]
    cmd += ["--state-dir", str(tmp_path / "state")]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        end = time.monotonic() + 60  # only stops a hang
        while True:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            try:
                http_request(port, "GET", "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.05)
        body = {"model": NAME, "prompt": "hello", "max_tokens": 2}
        status, _, answer = http_request(port, "POST", "/v1/completions", body)
        assert status == 200, answer
        assert json.loads(answer)["model"] == SOURCE  # "its answers carry that name too"
        assert "served-model-name" not in log.read_text()
    finally:
        stop_process(proc)


def test_a_busy_backends_slow_metrics_do_not_eject_it():
    """A /metrics that times out while requests on the backend keep going through is a busy
    server's (a loaded vLLM answers it late): it stays in routing. Once nothing went through
    for BUSY_GRACE_S, or nothing is in flight, the timeouts count again and eject it, unless
    it is the last of its model's servers in routing."""
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        b = Backend(f"http://127.0.0.1:{port}", "a100-1", "A100-SXM4-80GB", NAME, "bf16", 1000)
        other = Backend("http://127.0.0.1:1", "a100-2", "A100-SXM4-80GB", NAME, "bf16", 1000)
        live = LiveState([b, other], timeout=0.2)  # `other` is never scraped here

        def scrapes(n: int) -> None:
            async def main() -> None:
                client = Client(0.2)
                try:
                    for _ in range(n):
                        await live.scrape(client, b)
                        live.state(b).ejected_until = 0.0  # probe again now
                finally:
                    await client.close()

            asyncio.run(main())

        b.outstanding = 2
        live.succeeded(b)  # a request through it just now
        scrapes(4)
        assert b.healthy and live.state(b).failures == 0
        live.state(b).answered_at = time.monotonic() - BUSY_GRACE_S - 1  # long silent: hung
        scrapes(3)
        assert not b.healthy and "timed out" in live.state(b).last_error
        b.healthy, live.state(b).failures = True, 0
        live.succeeded(b)
        b.outstanding = 0  # nothing in flight: a slow /metrics is the only sign there is
        scrapes(3)
        assert not b.healthy
        # The last of its model's servers in routing stays, slow /metrics or not.
        b.healthy, live.state(b).failures, other.healthy = True, 0, False
        scrapes(3)
        assert b.healthy


def test_a_model_whose_servers_are_all_out_answers_503_not_400(tmp_path):
    """No fault of the client's: the router says 503 (OpenAI's server_error), as it does when
    no server had room in time; a prompt too long for every server stays a 400."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(ONE_NODE)
    dead = free_port()
    entry = {"url": f"http://127.0.0.1:{dead}", "node": "rtx-1", "gpu_type": "RTX-4090"}
    (tmp_path / "backends.yaml").write_text(json.dumps({"backends": [entry | {"model": NAME}]}))
    port = free_port()
    log = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
    cmd += ["--backends", str(tmp_path / "backends.yaml"), "--listen", f"127.0.0.1:{port}"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        end = time.monotonic() + 60  # only stops a hang: ejected after three scrapes
        while "ejected" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.05)
        body = {"model": NAME, "prompt": "hello", "max_tokens": 2}
        status, _, answer = http_request(port, "POST", "/v1/completions", body)
        assert status == 503, answer
        error = json.loads(answer)["error"]
        assert error["type"] == "server_error"
        assert error["message"] == f"no healthy backend serves {NAME}"
    finally:
        stop_process(proc)
