"""`fleetctl route-serve` over real HTTP, in front of emulated vLLM servers and a raw one."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DATA, REPO
from tests.procs import NAME, Emulator, free_port, http_request, stop_process

KEY = "sk-route-test-0123456789"
CAPTURE = (DATA / "vllm-0.32.0-cpu-metrics.txt").read_text()

INVENTORY = """\
nodes:
  - name: a100-1
    gpus: {type: A100-SXM4-80GB, count: 1}
  - name: rtx-[1:4]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
      gptq-int4: {source: x/llama-3-8b-gptq}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 64}
router: {aging: {factor: 1.0, window_s: 30}}
"""


class Router:
    """One `python -m fleetctl route-serve` subprocess."""

    def __init__(
        self,
        tmp: Path,
        backends: list[dict],
        *extra: str,
        name: str = "router",
        inventory: str = INVENTORY,
    ):
        self.port = free_port()
        inv = tmp / f"{name}-inventory.yaml"
        inv.write_text(inventory)
        path = tmp / f"{name}-backends.yaml"
        path.write_text(json.dumps({"backends": backends}))
        self.log = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv), "--backends", str(path)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", *extra]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        end = time.monotonic() + 60  # only stops a hang: it answers as soon as it listens
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.request("GET", "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < end, self.log.read_text()
                time.sleep(0.05)

    def request(self, method, path, body=None, headers=None, timeout=30):
        return http_request(self.port, method, path, body, headers, timeout)

    def complete(self, prompt="hello " * 20, max_tokens=8, headers=None, **body):
        return self.request(
            "POST",
            "/v1/completions",
            {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, **body},
            headers,
        )

    def metrics(self):
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        return body.decode()

    def stop(self):
        stop_process(self.proc)


def entry(emu: Emulator, node: str, gpu: str, variant: str = "bf16", **kw) -> dict:
    return {"url": emu.base, "node": node, "gpu_type": gpu, "model": NAME, "variant": variant, **kw}


class RawBackend:
    """A real HTTP server that streams fixed bytes in odd chunks and says when.

    After the first chunk it waits until the test says its client has that chunk
    (`client_has_first`): a router that buffered would hold the first chunk back until the
    last one, and the client would see them all at once, after the last was sent."""

    CHUNKS: ClassVar[list[bytes]] = [
        b'data: {"a": 1}\n\n',
        b'data: {"b":',
        b" 2}\n\n",
        b"data: [DONE]\n\n",
    ]
    GAP_S = 0.05
    WAIT_S = 30  # how long the backend waits for the client's first chunk (a buffering router)

    def __init__(self):
        self.port = free_port()
        self.sent_at: list[float] = []
        self.client_has_first = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    async def metrics(self, request):
        return web.Response(text=CAPTURE)

    async def completions(self, request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, chunk in enumerate(self.CHUNKS):
            self.sent_at.append(time.monotonic())
            await resp.write(chunk)
            if i == 0:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.client_has_first.wait, self.WAIT_S)
            await asyncio.sleep(self.GAP_S)
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("route")
    emus = {
        "a100": Emulator(tmp, gpu="A100-SXM4-80GB"),
        "rtx1": Emulator(tmp),
        "rtx2": Emulator(tmp),
        "int4": Emulator(tmp, "--variant", "gptq-int4", "--quantization", "gptq_marlin"),
        "flaky": Emulator(tmp, "--error-rate", "1.0"),
        "dying": Emulator(tmp, "--die-mid-stream", "1"),
        "narrow": Emulator(tmp, "--max-num-seqs", "1"),
    }
    routers: list[Router] = []
    try:
        for e in emus.values():
            e.wait_healthy()
        key_file = tmp / "key"
        key_file.write_text(KEY + "\n")
        key_file.chmod(0o600)
        main = [
            entry(emus["a100"], "a100-1", "NVIDIA A100-SXM4-80GB"),
            entry(emus["rtx1"], "rtx-1", "RTX-4090"),
            entry(emus["rtx2"], "rtx-2", "RTX-4090"),
            entry(emus["int4"], "rtx-3", "RTX-4090", "gptq-int4"),
        ]
        routers.append(Router(tmp, main, "--api-key-file", str(key_file), name="main"))
        dead_port = free_port()
        faulty = [
            entry(emus["flaky"], "rtx-1", "RTX-4090"),
            {
                "url": f"http://127.0.0.1:{dead_port}",
                "node": "rtx-2",
                "gpu_type": "RTX-4090",
                "model": NAME,
            },
            entry(emus["rtx1"], "rtx-3", "RTX-4090"),
        ]
        # Round-robin, so the failing server surely gets its share of requests.
        routers.append(Router(tmp, faulty, "--policy", "round-robin", name="faulty"))
        routers.append(Router(tmp, [entry(emus["dying"], "rtx-1", "RTX-4090")], name="dying"))
        raw = RawBackend()
        raw_entry = {
            "url": f"http://127.0.0.1:{raw.port}",
            "node": "raw",
            "gpu_type": "RTX-4090",
            "model": NAME,
        }
        routers.append(Router(tmp, [raw_entry], name="raw"))
        narrow = [entry(emus["narrow"], "rtx-4", "RTX-4090", max_num_seqs=1)]
        routers.append(Router(tmp, narrow, name="narrow"))
        yield {
            "emus": emus,
            "main": routers[0],
            "faulty": routers[1],
            "dying": routers[2],
            "raw": (routers[3], raw),
            "narrow": routers[4],
        }
    finally:
        for r in routers:
            r.stop()
        for e in emus.values():
            e.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


# Each node of the main router: its emulator and the class its answers must name.
MAIN = {
    "a100-1": ("a100", "A100-SXM4-80GB/bf16"),
    "rtx-1": ("rtx1", "RTX-4090/bf16"),
    "rtx-2": ("rtx2", "RTX-4090/bf16"),
    "rtx-3": ("int4", "RTX-4090/gptq-int4"),
}


def _served(emu: Emulator) -> float:
    """Requests the emulator has finished, whatever their reason."""
    return sum(s.value for s in emu.metrics()["vllm:request_success"].samples)


def test_completion_through_the_router_says_where_it_went(fleet):
    """README: answers say where they went (X-Fleet-Backend, X-Fleet-Class,
    X-Fleet-Precision). The headers name the one emulator whose counters show the request,
    and that node's class and format as the backends file gives them."""
    r = fleet["main"]
    emus = {node: fleet["emus"][name] for node, (name, _) in MAIN.items()}
    for _ in range(4):
        before = {node: _served(emu) for node, emu in emus.items()}
        status, headers, body = r.complete(headers=AUTH)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 8
        grew = [node for node, emu in emus.items() if _served(emu) != before[node]]
        assert grew == [headers["X-Fleet-Backend"]], (grew, headers)
        cls = MAIN[grew[0]][1]
        assert headers["X-Fleet-Class"] == cls
        assert headers["X-Fleet-Precision"] == cls.split("/")[1]
    status, _, body = r.request("GET", "/v1/models", headers=AUTH)
    assert status == 200 and json.loads(body)["data"][0]["id"] == NAME


def test_openai_client_streams_chat_through_the_router(fleet):
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{fleet['main'].port}/v1", api_key=KEY, max_retries=0
    )
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text.split()) == 12


def test_streaming_is_byte_exact_and_unbuffered(fleet):
    router, raw = fleet["raw"]
    raw.client_has_first.clear()
    raw.sent_at.clear()
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=2 * RawBackend.WAIT_S)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": NAME, "prompt": "x", "stream": True}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    first = resp.read1(64)
    got_first_at = time.monotonic()
    raw.client_has_first.set()  # the backend sends the rest only now
    rest = resp.read()
    conn.close()
    assert first + rest == b"".join(RawBackend.CHUNKS)
    # The first chunk reached the client before the backend had sent the last one.
    assert got_first_at < raw.sent_at[-1]


def test_strict_and_prefer_precision(fleet):
    """README: `X-Fleet-Precision: int4` (prefer) or `bf16;strict`. Both go only to servers
    of the hinted format while one is up (rtx-3 alone runs gptq-int4; the others bf16), so
    on this fleet one of the two formats is not where the policy would send the request
    unhinted; a format no server runs is a 400 when strict and served elsewhere when
    preferred."""
    r = fleet["main"]
    int4, bf16 = {"rtx-3"}, {"a100-1", "rtx-1", "rtx-2"}
    for hint, nodes, variant in [
        ("int4;strict", int4, "gptq-int4"),
        ("int4", int4, "gptq-int4"),
        ("bf16;strict", bf16, "bf16"),
        ("bf16", bf16, "bf16"),
    ]:
        for _ in range(4):
            status, headers, body = r.complete(headers={**AUTH, "X-Fleet-Precision": hint})
            assert status == 200, body
            assert headers["X-Fleet-Backend"] in nodes, (hint, headers["X-Fleet-Backend"])
            assert headers["X-Fleet-Precision"] == variant, hint
    status, _, body = r.complete(headers={**AUTH, "X-Fleet-Precision": "fp8;strict"})
    assert (
        status == 400
        and "no backend serves llama-3-8b in fp8" in json.loads(body)["error"]["message"]
    )
    status, headers, body = r.complete(headers={**AUTH, "X-Fleet-Precision": "fp8"})
    assert status == 200, body  # prefer mode falls back
    assert headers["X-Fleet-Backend"] in int4 | bf16


def test_bad_requests_get_openai_errors(fleet):
    r = fleet["main"]
    cases = [
        (b"{not json", AUTH, 400, "not valid JSON"),
        ({"prompt": "x"}, AUTH, 400, "missing 'model'"),
        ({"model": "nope", "prompt": "x"}, AUTH, 404, "does not exist"),
        ({"model": NAME, "prompt": "x"}, {}, 401, "API key"),
        ({"model": NAME, "prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, "API key"),
        ({"model": NAME, "prompt": "x"}, {**AUTH, "X-Priority": "high"}, 400, "priority"),
        ({"model": NAME, "prompt": "x"}, {**AUTH, "X-Fleet-Precision": "int4;always"}, 400, "mode"),
        ({"model": NAME, "prompt": "x", "max_tokens": -1}, AUTH, 400, "max_tokens"),
        ({"model": NAME}, AUTH, 400, "prompt"),
    ]
    for body, headers, status, words in cases:
        got, _, answer = r.request("POST", "/v1/completions", body, headers)
        assert got == status, (body, answer)
        err = json.loads(answer)["error"]
        assert words in err["message"] and err["code"] == status
    big = json.dumps({"model": NAME, "prompt": "x" * (33 * 2**20)}).encode()
    got, _, _ = r.request("POST", "/v1/completions", big, AUTH)
    assert got == 413


def test_a_request_too_long_for_every_server_is_the_routers_400_without_lengths_given(fleet):
    """The main router's backends file gives no max_model_len: route-serve reads each
    server's from its /v1/models (vLLM lists it), so a request no server can take is
    refused by the router itself, naming the longest length served, and never reaches a
    backend (before, it went through and the 400 was vLLM's)."""
    r = fleet["main"]
    body = {"model": NAME, "prompt": "hi", "max_tokens": 9000}

    def refused_by_router() -> bool:
        status, _, answer = r.request("POST", "/v1/completions", body, AUTH)
        assert status == 400, answer
        return "the longest llama-3-8b serves is 8192" in json.loads(answer)["error"]["message"]

    _wait_for(refused_by_router, "route-serve to read the servers' max_model_len")


def test_retries_and_ejection(fleet):
    r = fleet["faulty"]
    for _ in range(10):
        status, headers, body = r.complete()
        assert status == 200, body
        assert headers["X-Fleet-Backend"] == "rtx-3"
    families = {f.name: f for f in text_string_to_metric_families(r.metrics())}
    up = {s.labels["backend"]: s.value for s in families["fleetctl_backend_up"].samples}
    dead = next(b for b in up if b != fleet["emus"]["flaky"].base and up[b] == 0.0)
    ejected = {s.labels["backend"]: s.value for s in families["fleetctl_backend_ejections"].samples}
    assert ejected[dead] >= 1  # the server that is not there stays out
    # The failing one was ejected; after its backoff a good /metrics lets it back in half-open,
    # so whether it is out at this instant depends on timing: its ejection count does not.
    assert ejected.get(fleet["emus"]["flaky"].base, 0) >= 1
    assert sum(s.value for s in families["fleetctl_retries"].samples) >= 1


def test_backend_dying_mid_stream_ends_with_an_error_event(fleet):
    r = fleet["dying"]
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=20)
    body = {"model": NAME, "prompt": "x", "max_tokens": 50, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()  # must end, not hang
    conn.close()
    assert b'"error"' in data and b"mid-stream" in data


def _aborted(emu: Emulator) -> float:
    """Requests the emulator ended because their client went away."""
    family = emu.metrics()["vllm:request_success"]
    return sum(s.value for s in family.samples if s.labels.get("finished_reason") == "abort")


def _generated(emu: Emulator) -> float:
    """Tokens the emulator has generated so far (counted as it generates them)."""
    return sum(s.value for s in emu.metrics()["vllm:generation_tokens"].samples)


@pytest.fixture
def slow(tmp_path):
    """route-serve in front of one emulated vLLM at real speed (time scale 1): ~47 tokens/s
    for llama-3-8b on a 4090, so a 4000-token answer takes well over a minute. One per test:
    a request a broken router left running must not reach the next test."""
    tmp = tmp_path
    emu = Emulator(tmp, "--time-scale", "1")
    router = None
    try:
        emu.wait_healthy()
        router = Router(tmp, [entry(emu, "rtx-1", "RTX-4090")], name="slow")
        yield router, emu
    finally:
        if router is not None:
            router.stop()
        emu.stop()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_disconnects_makes_the_backend_abort_its_request(slow, stream):
    """README: a client that disconnects closes the upstream request, so vLLM aborts it.
    The client asks for 4000 tokens (over a minute of generation), then leaves: after its
    first event (streamed), or once the backend runs the request (whole: nothing reaches the
    client before the end, so only the router's cancellation of its handler can notice).
    The emulator must count the request aborted having generated under a quarter of the
    tokens. A router that read the answer to its end instead (or let the backend finish a
    whole answer for nobody) fails on the token count, whatever the machine's speed."""
    r, emu = slow
    max_tokens = 4000
    aborted, generated = _aborted(emu), _generated(emu)
    assert emu.metrics()["vllm:num_requests_running"].samples[0].value == 0
    data = json.dumps({"model": NAME, "prompt": "x", "max_tokens": max_tokens, "stream": stream})
    sock = socket.create_connection(("127.0.0.1", r.port), timeout=30)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data.encode())
        )
        if stream:
            got = b""
            while b"data: " not in got:
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 "), got
        else:
            _wait_for(
                lambda: emu.metrics()["vllm:num_requests_running"].samples[0].value == 1,
                "the request running on the backend",
            )
    finally:
        sock.close()  # the client leaves
    # The bound only stops a hang: the token count is what tells an abort from a drain.
    end = time.monotonic() + 120
    while True:
        made = _generated(emu) - generated
        if _aborted(emu) != aborted:  # read second: an abort in between is seen
            break
        assert made < max_tokens / 4, f"the backend went on generating ({made:g} tokens)"
        assert time.monotonic() < end, "the backend never aborted the request"
        time.sleep(0.05)
    assert _aborted(emu) == aborted + 1
    assert _generated(emu) - generated < max_tokens / 4
    assert emu.metrics()["vllm:num_requests_running"].samples[0].value == 0


def _router_state(r: Router) -> tuple[float, float, float]:
    """(requests on the backend, low-priority requests queued, aging boosts so far)."""
    families = {f.name: f for f in text_string_to_metric_families(r.metrics())}

    def total(name: str, **labels: str) -> float:
        family = families.get(name)
        samples = family.samples if family else []
        return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))

    return (
        total("fleetctl_backend_outstanding_requests"),
        total("fleetctl_queue_depth", priority="5"),
        total("fleetctl_aging_boosts"),
    )


def _wait_for(check, what: str, timeout: float = 60) -> None:
    """Wait for a condition; the timeout only stops a test that would hang."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_aging_lets_low_priority_through(fleet):
    r = fleet["narrow"]  # one backend, one request at a time
    results: dict[str, int] = {}
    done_at: dict[str, float] = {}

    def call(name, prio, tokens, stream=False):
        headers = {"X-Priority": str(prio)}
        results[name] = r.complete(max_tokens=tokens, headers=headers, stream=stream)[0]
        done_at[name] = time.monotonic()

    _, _, boosts_before = _router_state(r)
    # The arrival order is set by waiting on the router's own metrics, not by sleeps: a long
    # high-priority request holds the backend (about 2 s at time scale 20), the low-priority
    # one queues behind it, and only then do eleven more high-priority ones arrive. The first
    # streams, so its first token gives aging a TTFT (the threshold) long before it ends.
    first = threading.Thread(target=call, args=("hi0", 0, 2000, True))
    first.start()
    _wait_for(lambda: _router_state(r)[0] == 1, "the first request on the backend")
    low = threading.Thread(target=call, args=("low", 5, 4))
    low.start()

    def low_arrived() -> bool:
        # Queued at priority 5, or already boosted out of it (the only way out while the
        # backend is busy).
        _, queued_low, boosts = _router_state(r)
        return queued_low == 1 or boosts > boosts_before

    _wait_for(low_arrived, "the low-priority request in the queue")
    assert "hi0" not in results, "the backend was free again before the backlog formed"
    hi = [threading.Thread(target=call, args=(f"hi{i}", 0, 400)) for i in range(1, 12)]
    for t in hi:
        t.start()
    for t in [first, low, *hi]:
        t.join(120)
    assert results["low"] == 200 and all(results[f"hi{i}"] == 200 for i in range(12))
    # Without aging, priority 0 always goes first and the low one would end last. Boosted,
    # it keeps its place in arrival order: ahead of every high-priority request after it.
    later = [f"hi{i}" for i in range(1, 12)]
    assert all(done_at["low"] < done_at[h] for h in later), done_at
    assert _router_state(r)[2] >= boosts_before + 1


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One metric's samples from a /metrics page, by their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


@pytest.mark.parametrize("tpot_ms, met", [(10_000, "true"), (0.001, "false")])
def test_metrics_show_tpot_and_slo_attainment_per_node_class(fleet, tmp_path, tpot_ms, met):
    """README: route-serve's /metrics has each class's TPOT and SLO attainment. Every streamed
    answer is counted under the class its X-Fleet-Class header names, as met when its TPOT
    is within an objective no answer misses (10 s), as missed under one none meets (1 us);
    a whole (non-streamed) answer has no TPOT to time and is not counted."""
    emus = fleet["emus"]
    slo = f"    slo: {{ttft_p99_s: 60, tpot_p99_ms: {tpot_ms}}}\n"
    inventory = INVENTORY.replace("    max_context: 8192\n", "    max_context: 8192\n" + slo)
    backends = [
        entry(emus["a100"], "a100-1", "NVIDIA A100-SXM4-80GB"),
        entry(emus["rtx1"], "rtx-1", "RTX-4090"),
    ]
    r = Router(tmp_path, backends, "--policy", "round-robin", name="slo", inventory=inventory)
    try:
        classes: dict[str, int] = {}
        for _ in range(4):
            status, headers, body = r.complete(max_tokens=6, stream=True)
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
            cls = headers["X-Fleet-Class"]
            classes[cls] = classes.get(cls, 0) + 1
        assert r.complete(max_tokens=6)[0] == 200  # whole: not counted
        assert set(classes) == {"A100-SXM4-80GB/bf16", "RTX-4090/bf16"}
        text = r.metrics()
        counted = _samples(text, "fleetctl_slo_requests_total")
        timed = _samples(text, "fleetctl_tpot_seconds_count")
        share = _samples(text, "fleetctl_slo_attainment")
        for cls, n in classes.items():
            key = (("met", met), ("model", NAME), ("node_class", cls))
            assert counted[key] == n
            other = "false" if met == "true" else "true"
            assert counted[(("met", other), ("model", NAME), ("node_class", cls))] == 0
            assert timed[(("model", NAME), ("node_class", cls))] == n
            assert share[(("model", NAME), ("node_class", cls))] == (1.0 if met == "true" else 0.0)
        tpot_sum = sum(_samples(text, "fleetctl_tpot_seconds_sum").values())
        assert 0 < tpot_sum < 4 * 10.0
    finally:
        r.stop()


def test_metrics_count_slo_attainment_by_the_derived_slo_when_none_is_stated(fleet, tmp_path):
    """A model whose inventory states no SLO is judged by the default derived from its
    servers (fleetctl/fleet/slo.py): every streamed answer is counted, met or not."""
    emus = fleet["emus"]
    assert "slo:" not in INVENTORY
    backends = [
        entry(emus["a100"], "a100-1", "NVIDIA A100-SXM4-80GB"),
        entry(emus["rtx1"], "rtx-1", "RTX-4090"),
    ]
    r = Router(tmp_path, backends, "--policy", "hardware-aware", name="derived-slo")
    try:
        served = 0
        for _ in range(3):
            status, _, body = r.complete(max_tokens=6, stream=True)
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
            served += 1
        counted = _samples(r.metrics(), "fleetctl_slo_requests_total")
        assert sum(counted.values()) == served
        assert {dict(k)["model"] for k in counted} == {NAME}
    finally:
        r.stop()


def test_secrets_never_reach_logs_or_metrics(fleet):
    """README: keys and headers never reach logs or metrics. The request is served and
    logged (its access line is there to look at), and neither holds the key."""
    r = fleet["main"]
    seen = len(r.log.read_text())
    status, headers, body = r.complete(headers=AUTH)
    assert status == 200, body
    where = f"class={headers['X-Fleet-Class']}"
    _wait_for(lambda: where in r.log.read_text()[seen:], "the request's access log line")
    assert "POST /v1/completions" in r.log.read_text()[seen:]
    assert KEY not in r.metrics()
    assert KEY not in r.log.read_text()
    assert "Authorization" not in r.log.read_text()


def redis_server_binary() -> str:
    """Debian's redis-server; installed here when missing (the tests run as root in CI)."""
    import shutil

    found = shutil.which("redis-server")
    if found is None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "redis-server"],
            check=True,
            capture_output=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        found = shutil.which("redis-server")
    assert found, "redis-server is not installed and could not be installed"
    return found


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 60  # only stops a hang
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < end and proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(5)


def test_two_replicas_share_session_affinity_through_redis(fleet, redis_url, tmp_path):
    emus = fleet["emus"]
    backends = [
        entry(emus["a100"], "a100-1", "A100-SXM4-80GB"),
        entry(emus["int4"], "rtx-3", "RTX-4090", "gptq-int4"),
    ]
    a = Router(tmp_path, backends, "--session-store", redis_url, name="replica-a")
    b = Router(tmp_path, backends, "--session-store", redis_url, name="replica-b")
    try:
        for s in range(6):
            headers = {"X-Session-ID": f"shared-{s}"}
            # The first turn picks the class with a strict hint (alternating), on replica A.
            first_hint = "int4;strict" if s % 2 else "bf16;strict"
            status, h, _ = a.complete(
                max_tokens=4, headers={**headers, "X-Fleet-Precision": first_hint}
            )
            assert status == 200
            first = h["X-Fleet-Class"]
            # Later turns carry no hint and alternate replicas: they must stay on that class.
            for turn in range(4):
                replica = b if turn % 2 == 0 else a
                status, h, _ = replica.complete(max_tokens=4, headers=headers)
                assert status == 200 and h["X-Fleet-Class"] == first, (s, turn)
    finally:
        a.stop()
        b.stop()


def test_shared_ttft_window_in_redis(redis_url):
    from fleetctl.daemon.shared import RedisShared

    async def go():
        one, two = RedisShared(redis_url, "ttft-test"), RedisShared(redis_url, "ttft-test")
        one.up = two.up = True
        a, b = one.ttft_window(60.0), two.ttft_window(60.0)
        for v in (0.1, 0.2, 0.9):
            a.add(time.monotonic(), v)
        b.add(time.monotonic(), 0.3)
        await one.sync_ttft()  # each replica sends its second, then merges every replica's
        await two.sync_ttft()
        await one.close()
        await two.close()
        return b.median(time.monotonic())

    assert asyncio.run(go()) == pytest.approx(0.25)


def _backend_count(router: Router) -> int:
    _, _, body = router.request("GET", "/health")
    return json.loads(body)["backends"]


def test_sighup_reloads_the_backends_file(fleet, tmp_path):
    import signal

    emus = fleet["emus"]
    r = Router(tmp_path, [entry(emus["rtx1"], "rtx-1", "RTX-4090")], name="hup")
    try:
        assert _backend_count(r) == 1
        path = tmp_path / "hup-backends.yaml"
        both = [entry(emus["rtx1"], "rtx-1", "RTX-4090"), entry(emus["rtx2"], "rtx-2", "RTX-4090")]
        path.write_text(json.dumps({"backends": both}))
        r.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: _backend_count(r) == 2, "the reload")
        # A broken file is refused and the old backends stay.
        path.write_text("backends: [{url: nope}]")
        r.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: "reload failed" in r.log.read_text(), "the failed reload's log line")
        assert _backend_count(r) == 2
        assert r.complete()[0] == 200
    finally:
        r.stop()


def test_backends_come_from_applied_state_and_follow_it(fleet, tmp_path, catalog):
    import dataclasses

    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.planner import plan_fleet

    emus = fleet["emus"]
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(
        INVENTORY.replace(
            "  - name: rtx-[1:4]\n", "  - name: rtx-[1:4]\n    host: 127.0.0.[1:4]\n"
        ).replace("  - name: a100-1\n", "  - name: a100-1\n    host: 127.0.9.1\n")
    )
    plan = plan_fleet(load_inventory(inv_path, catalog))
    rtx = [d for d in plan.deployments if d.gpu_type == "RTX-4090"][:2]
    deps = [
        dataclasses.replace(d, host="127.0.0.1", port=e.port)
        for d, e in zip(rtx, (emus["rtx1"], emus["rtx2"]), strict=True)
    ]
    state_dir = tmp_path / ".fleetctl"
    StateDir(state_dir).save_state(State(1, (deps[0],)))
    port = free_port()
    log = tmp_path / "state-router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetctl",
                "route-serve",
                str(inv_path),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    r = Router.__new__(Router)
    r.port, r.proc, r.log = port, proc, log
    try:
        end = time.monotonic() + 60  # only stops a hang
        while True:
            try:
                assert _backend_count(r) == 1
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, log.read_text()
                time.sleep(0.05)
        status, headers, _ = r.complete()
        assert status == 200 and headers["X-Fleet-Backend"] == deps[0].node
        StateDir(state_dir).save_state(State(2, tuple(deps)))  # `fleetctl apply` added a server
        _wait_for(lambda: _backend_count(r) == 2, "the state file's new backend")
    finally:
        r.stop()
