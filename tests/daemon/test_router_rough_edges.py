"""Rough edges a new user hit with route-serve and emulate: a port in use, a prompt too long
for every server, paths the router does not serve, and stopping on SIGINT."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from harness.commands import emulate_cmd
from harness.procs import free_port
from tests.conftest import REPO
from tests.daemon.test_route_serve import (
    CAPTURE,
    INVENTORY,
    Router,
    _router_state,
    _wait_for,
    entry,
)
from tests.procs import NAME, SCALE, SOURCE, Emulator, http_request

LENGTH = 1024  # the stand-in's max_model_len
MODELS_DELAY_S = 0.5  # under route-serve's 1 s scrape timeout
FIRST = b'data: {"choices": [{"text": "a"}]}\n\n'
REST = b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'
# Under 2.1 s, what the emulator took with a stream in flight before it cut streams (60 s for
# route-serve); 1.0 s was missed by 6% on a 2-core machine at load average 8.
EXIT_BOUND_S = 1.6


class StandIn:
    """A vLLM-like backend in a thread: its /v1/models answers MODELS_DELAY_S late (the
    window in which route-serve did not know its max_model_len yet), and it records every
    completion it receives. A completion streams FIRST, then REST once `release` is set."""

    def __init__(self) -> None:
        self.port = free_port()
        self.received: list[bytes] = []
        self.release = threading.Event()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)  # a scrape that fails would eject it
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def models(self, request: web.Request) -> web.Response:
        await asyncio.sleep(MODELS_DELAY_S)
        return web.json_response(
            {"object": "list", "data": [{"id": NAME, "object": "model", "max_model_len": LENGTH}]}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=CAPTURE)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append(raw)
        if json.loads(raw)["prompt"] != "hi":  # too long: vLLM's 400
            message = f"This model's maximum context length is {LENGTH} tokens."
            return web.json_response({"error": {"message": message, "code": 400}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(FIRST)
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
        await resp.write(REST)
        await resp.write_eof()
        return resp

    def stop(self) -> None:
        self.release.set()
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _files(tmp: Path, port: int) -> tuple[Path, Path]:
    inv, backends = tmp / "inventory.yaml", tmp / "backends.yaml"
    inv.write_text(INVENTORY)
    entry = {"url": f"http://127.0.0.1:{port}", "node": "rtx-1", "gpu_type": "RTX-4090"}
    backends.write_text(json.dumps({"backends": [{**entry, "model": NAME}]}))
    return inv, backends


def _route_serve(tmp: Path, backend_port: int, port: int, *extra: str) -> list[str]:
    inv, backends = _files(tmp, backend_port)
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv), "--backends", str(backends)]
    cmd += ["--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp / "state")]
    return [*cmd, "--no-request-log", *extra]


class RouteServe:
    def __init__(self, tmp: Path, backend_port: int, *extra: str) -> None:
        self.port = free_port()
        self.log = tmp / f"route-serve-{self.port}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                _route_serve(tmp, backend_port, self.port, *extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        _wait_port(self.port, self.proc, self.log)

    def request(self, method: str, path: str, body: object = None) -> tuple:
        return http_request(self.port, method, path, body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _wait_port(port: int, proc: subprocess.Popen, log: Path) -> None:
    """Until the port accepts a connection (the event), or the process dies."""
    end = time.monotonic() + 60  # only stops a hang
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < end, log.read_text()
            time.sleep(0.02)


@pytest.fixture
def standin():
    s = StandIn()
    yield s
    s.stop()


# --- 1. a port in use ---------------------------------------------------------------------


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _one_line_error(cmd: list[str], flag: str, port: int) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=60)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 2, out
    assert out.splitlines()[-1] == (
        f"error: cannot listen on 127.0.0.1:{port}: address already in use "
        f"(pick another with {flag}, or stop the process that holds it)"
    ), out
    assert "route-serve on" not in out  # no banner before the error
    assert "Traceback" not in out and "internal error" not in out, out


@pytest.mark.parametrize("workers", ["1", "2"])
def test_route_serve_on_a_port_in_use_says_so_in_one_line(tmp_path, taken_port, workers):
    cmd = _route_serve(tmp_path, free_port(), taken_port, "--workers", workers)
    _one_line_error(cmd, "--listen", taken_port)


def test_emulate_on_a_port_in_use_says_so_in_one_line(taken_port):
    cmd = emulate_cmd(taken_port, "RTX-4090", NAME, SOURCE, NAME, SCALE)
    _one_line_error(cmd, "--port", taken_port)


# --- 2. a prompt too long for every server --------------------------------------------------


def test_a_prompt_too_long_for_every_server_is_refused_before_any_sees_it(tmp_path, standin):
    """The backends file gives no max_model_len and the server lists it late: the first
    request, sent as soon as the port accepts, is the router's 400, and the server gets
    nothing (before, the router listened before it knew, and forwarded it)."""
    r = RouteServe(tmp_path, standin.port)
    try:
        body = {"model": NAME, "prompt": "word " * 2000, "max_tokens": 16}
        status, headers, answer = r.request("POST", "/v1/completions", body)
        assert standin.received == []  # before: forwarded, and the 400 was the server's
        assert status == 400, answer
        assert headers["Content-Type"].startswith("application/json")
        err = json.loads(answer)["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert f"the longest {NAME} serves is {LENGTH}" in err["message"], err
    finally:
        r.stop()


# --- 3. paths the router does not serve ------------------------------------------------------


def test_unserved_paths_and_methods_are_json_errors(tmp_path, standin):
    r = RouteServe(tmp_path, standin.port)
    try:
        # vLLM's dev endpoints (sleep mode, with VLLM_SERVER_DEV_MODE=1) stop or free a
        # server: a client must never reach them through the router.
        dev = [("POST", "/sleep?level=2"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]
        dev += [("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache")]
        for method, path in [("POST", "/v1/embeddings"), ("GET", "/nope"), ("DELETE", "/"), *dev]:
            status, headers, answer = r.request(method, path, {})
            assert status == 404, (method, path, answer)
            assert headers["Content-Type"].startswith("application/json")
            err = json.loads(answer)["error"]
            assert err["type"] == "not_found_error" and err["code"] == 404
            assert path.split("?")[0] in err["message"] and "POST /v1/completions" in err["message"]
        status, headers, answer = r.request("GET", "/v1/chat/completions")
        assert status == 405, answer
        assert headers["Content-Type"].startswith("application/json")
        assert headers["Allow"] == "POST"
        err = json.loads(answer)["error"]
        assert err["code"] == 405 and "POST" in err["message"]
        assert standin.received == []
    finally:
        r.stop()


# --- 4. stopping on SIGINT --------------------------------------------------------------------


def _sigint_exit(proc: subprocess.Popen, port: int | None = None) -> tuple[int, float]:
    """(exit code, seconds from the first SIGINT to exit); with `log`, a second SIGINT once
    the first was taken: the port no longer accepts (two sent at once may arrive as one)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    if port is not None:
        _wait_closed(port, proc)
        proc.send_signal(signal.SIGINT)
    code = proc.wait(30)
    return code, time.monotonic() - start


def _wait_closed(port: int, proc: subprocess.Popen) -> None:
    """Until the port refuses a connection (the server stopped accepting), or `proc` ends."""
    end = time.monotonic() + 30  # only stops a hang
    while proc.poll() is None and time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.005)


def _stream(port: int, max_tokens: int = 16) -> socket.socket:
    """A streamed completion through `port`, its first chunk read."""
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": max_tokens, "stream": True})
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    assert s.recv(65536).startswith(b"HTTP/1.1 200"), "no answer"
    return s


def _rest(s: socket.socket) -> bytes:
    got = b""
    while data := s.recv(65536):
        got += data
    return got


def test_idle_route_serve_and_emulator_stop_promptly_on_sigint(tmp_path):
    """A guard, not a discriminator: idle, both stopped in 0.1-0.4 s before too."""
    emu = Emulator(tmp_path)
    try:
        emu.wait_healthy()
        r = RouteServe(tmp_path, emu.port)
        assert r.request("GET", "/health")[0] in (200, 503)
        code, took = _sigint_exit(r.proc)
        assert code == 0 and took < EXIT_BOUND_S, (code, took, r.log.read_text())
        code, took = _sigint_exit(emu.proc)
        assert code == 0 and took < EXIT_BOUND_S, (code, took, emu.log.read_text())
    finally:
        emu.stop()


def test_emulator_cuts_a_stream_in_flight_promptly_on_sigint(tmp_path):
    emu = Emulator(tmp_path, "--time-scale", "1")
    try:
        emu.wait_healthy()
        s = _stream(emu.port, 4000)  # ~40 s at --time-scale 1
        code, took = _sigint_exit(emu.proc)
        assert code == 0 and took < EXIT_BOUND_S, (code, took, emu.log.read_text())
        assert not _rest(s).endswith(b"0\r\n\r\n")  # cut: no last chunk
    finally:
        emu.stop()


def test_route_serve_lets_a_stream_in_flight_finish_on_sigint(tmp_path, standin):
    r = RouteServe(tmp_path, standin.port)
    try:
        s = _stream(r.port)
        r.proc.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            r.proc.wait(0.3)  # still serving the stream (before: the same)
        standin.release.set()
        rest = _rest(s)
        assert b"data: [DONE]" in rest and rest.endswith(b"0\r\n\r\n"), rest
        assert r.proc.wait(30) == 0, r.log.read_text()
    finally:
        r.stop()


def test_route_serve_cuts_a_stream_in_flight_on_a_second_sigint(tmp_path, standin):
    """Before, a second SIGINT did nothing: aiohttp waited up to 60 s for the stream."""
    r = RouteServe(tmp_path, standin.port)
    try:
        s = _stream(r.port)
        code, took = _sigint_exit(r.proc, r.port)
        assert code == 0 and took < EXIT_BOUND_S, (code, took, r.log.read_text())
        rest = _rest(s)
        assert b'"text": "b"' not in rest and b'"code": 503' in rest, rest  # cut, and told
    finally:
        r.stop()


def test_route_serve_cuts_a_stream_in_flight_after_its_drain_timeout(tmp_path, standin):
    r = RouteServe(tmp_path, standin.port, "--drain-timeout", "0.2")
    try:
        s = _stream(r.port)
        code, took = _sigint_exit(r.proc)
        assert code == 0 and took < EXIT_BOUND_S, (code, took, r.log.read_text())
        rest = _rest(s)
        assert b'"text": "b"' not in rest and b'"code": 503' in rest, rest  # cut, and told
    finally:
        r.stop()


def test_requests_cut_by_the_drain_are_told_why_and_logged_as_they_were(tmp_path):
    """Before, a stream cut at the drain's end stopped without an error event or its last
    chunk (curl: exit 18), a whole answer not begun got no reply at all, and both were
    logged `status 499, output_length 0` however many tokens had reached the client."""
    emu = Emulator(tmp_path, "--time-scale", "1")  # 4000 tokens: ~85 s, past the test
    r = None
    try:
        emu.wait_healthy()
        r = Router(tmp_path, [entry(emu, "rtx-1", "RTX-4090")], "--drain-timeout", "0.3")
        body = {"model": NAME, "prompt": "hi", "max_tokens": 4000}
        streamed = http.client.HTTPConnection("127.0.0.1", r.port, timeout=30)
        streamed.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
        resp = streamed.getresponse()
        got = b""
        while got.count(b"data: {") < 20:  # tokens reach the client
            got += resp.readline()
        whole: list[tuple[int, bytes]] = []
        waiter = threading.Thread(
            target=lambda: whole.append(r.request("POST", "/v1/completions", body)[::2])
        )
        waiter.start()
        _wait_for(lambda: _router_state(r)[0] == 2, "both requests at the backend")
        r.proc.send_signal(signal.SIGTERM)
        got += resp.read()  # the last chunk comes: the stream ends cleanly
        streamed.close()
        waiter.join(30)
        assert r.proc.wait(30) == 0, r.log.read_text()
        error = b'data: {"error": {"message": "route-serve stopped before the answer ended'
        events = got.split(b"\n\n")
        assert events[-3].startswith(error) and events[-2:] == [b"data: [DONE]", b""], got[-400:]
        assert json.loads(events[-3][6:])["error"]["code"] == 503
        sent = got.count(b'"choices"')  # the emulator's events: one token each
        (status, answer) = whole[0]
        assert status == 503 and json.loads(answer)["error"]["code"] == 503, answer
        (log,) = (tmp_path / ".fleetctl" / "requests").glob("*.jsonl")
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(x["status"], x["outcome"]) for x in rows] == [(503, "cut_by_drain")] * 2, rows
        assert sorted(x["output_length"] for x in rows) == [0, sent], (rows, sent)
        assert r.log.read_text().count(" cut\n") == 2  # the access log says so too
    finally:
        if r is not None:
            r.stop()
        emu.stop()
