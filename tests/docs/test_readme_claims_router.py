"""README claims about `fleetctl route-serve`, each pinned by a test that fails if it breaks.

The router runs as a real `python -m fleetctl route-serve` process in front of real HTTP
backends on loopback whose `/metrics` page, answers and pace the test sets (`Stub`). Each
test waits on events (a backend's scrape count, a request arriving, a log line), not on
sleeps. tests/README.md maps each claim to its test.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from fleetctl.daemon.live import LiveState
from fleetctl.routing.types import Backend
from tests.conftest import REPO
from tests.procs import NAME, free_port, http_request, stop_process

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
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 64}
router: {aging: {factor: 1000.0, window_s: 30}}
"""
A100, RTX = "A100-SXM4-80GB", "RTX-4090"
WAIT_S = 30.0  # only stops a hang: every wait below ends on its event


def until(cond: Callable[[], bool], what: str, deadline_s: float = WAIT_S) -> None:
    """Poll a condition that an event makes true; fails with `what` if it never does."""
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


class Stub:
    """A vLLM stand-in on 127.0.0.1 whose /metrics figures, answers and pace the test sets."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv = 0.0
        self.running = 0
        self.waiting = 0
        self.read_bytes = 0.0
        self.read_step = 0.0  # added to the read-bytes counter at every scrape
        self.gpu_blocks: int | None = None  # vllm:cache_config_info's num_gpu_blocks
        self.status = 200  # completions' answer; 0: the connection drops
        self.gate = threading.Event()  # completions wait on it while `hold` is set
        self.hold = False
        self.bodies: list[dict] = []
        self.has_models = True  # False: /v1/models answers 404 (a server without it)
        self.scrapes = 0
        self.scraped_at: list[float] = []  # monotonic time of each /metrics answer
        self._ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def page(self) -> str:
        labels = f'{{engine="0",model_name="{NAME}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{labels} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{labels} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{labels} {self.kv}",
            "# TYPE vllm:estimated_read_bytes_per_gpu_total counter",
            f"vllm:estimated_read_bytes_per_gpu_total{labels} {self.read_bytes}",
        ]
        if self.gpu_blocks is not None:
            lines += [
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="16",engine="0",'
                f'num_gpu_blocks="{self.gpu_blocks}"}} 1.0',
            ]
        return "\n".join(lines) + "\n"

    async def metrics(self, request: web.Request) -> web.Response:
        self.read_bytes += self.read_step
        text = self.page()
        self.scraped_at.append(time.monotonic())
        self.scrapes += 1
        return web.Response(text=text, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        if not self.has_models:
            raise web.HTTPNotFound()
        return web.json_response({"object": "list", "data": [{"id": NAME, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.bodies.append(body)
        if self.hold:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.gate.wait, WAIT_S)
        if self.status == 0:  # the connection drops before any byte of an answer
            assert request.transport is not None
            request.transport.abort()
            raise web.HTTPInternalServerError()
        if self.status != 200:
            return web.json_response({"error": {"message": "busy"}}, status=self.status)
        n = int(body.get("max_tokens") or 1)
        answer = {
            "id": "cmpl-stub",
            "object": "text_completion",
            "model": NAME,
            "choices": [{"index": 0, "text": " ok" * n, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
        }
        return web.json_response(answer)

    def wait_scrapes(self, n: int = 2) -> None:
        """Until the router has read this page `n` more times (the next decision sees it)."""
        target = self.scrapes + n
        until(lambda: self.scrapes >= target, f"{n} scrapes of {self.url}")


def entry(stub: Stub, node: str, gpu: str = RTX, **kw: object) -> dict:
    return {"url": stub.url, "node": node, "gpu_type": gpu, "model": NAME, "variant": "bf16", **kw}


class Router:
    """One `python -m fleetctl route-serve` process on --listen 127.0.0.1:PORT."""

    def __init__(self, tmp: Path, backends: list[dict], *extra: str) -> None:
        self.port = free_port()
        self.inv = tmp / "inventory.yaml"
        self.inv.write_text(INVENTORY)
        self.backends_path = tmp / "backends.yaml"
        self.write_backends(backends)
        self.log = tmp / "router.log"
        cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(self.inv)]
        cmd += ["--backends", str(self.backends_path), "--no-request-log"]
        cmd += ["--listen", f"127.0.0.1:{self.port}", *extra]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        end = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                self.request("GET", "/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < end, self.log.read_text()
                time.sleep(0.05)

    def write_backends(self, backends: list[dict]) -> None:
        self.backends_path.write_text(json.dumps({"backends": backends}))

    def request(self, method, path, body=None, headers=None, timeout=30.0):
        return http_request(self.port, method, path, body, headers, timeout)

    def complete(self, headers: dict | None = None, **body: object):
        full = {"model": NAME, "prompt": "hello " * 20, "max_tokens": 8, **body}
        return self.request("POST", "/v1/completions", full, headers)

    def metric(self, name: str) -> float:
        """The sum of one family's samples on the router's own /metrics."""
        status, _, page = self.request("GET", "/metrics")
        assert status == 200
        total = 0.0
        for line in page.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def stubs():
    made: list[Stub] = []

    def make(n: int) -> list[Stub]:
        new = [Stub() for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for s in made:
        s.gate.set()


@pytest.fixture
def router(tmp_path):
    made: list[Router] = []

    def make(backends: list[dict], *extra: str) -> Router:
        r = Router(tmp_path, backends, *extra)
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


def served(stubs: list[Stub]) -> list[int]:
    return [len(s.bodies) for s in stubs]


def route_five(r: Router, stubs: list[Stub], **body: object) -> list[int]:
    """Five requests one after another; how many each stub received."""
    before = served(stubs)
    for _ in range(5):
        status, _, answer = r.complete(**body)
        assert status == 200, answer
    return [a - b for a, b in zip(served(stubs), before, strict=True)]


# --- routing on scraped /metrics ----------------------------------------------------------------


def test_kv_aware_follows_scraped_kv_usage(stubs, router):
    """README "The routing daemon": each backend's /metrics is scraped
    (vllm:kv_cache_usage_perc, running and waiting requests). kv-aware sends every request to
    the backend whose page reports the emptier KV cache (then the fewer waiting), and follows
    when the pages swap."""
    one, two = stubs(2)
    r = router([entry(one, "rtx-1"), entry(two, "rtx-2")], "--policy", "kv-aware")
    # KV usage first; with equal usage, vllm:num_requests_waiting decides.
    phases = [
        ((0.9, 0), (0.1, 0), [0, 5]),
        ((0.1, 0), (0.9, 0), [5, 0]),
        ((0.5, 4), (0.5, 0), [0, 5]),
        ((0.5, 0), (0.5, 4), [5, 0]),
    ]
    for (one.kv, one.waiting), (two.kv, two.waiting), expect in phases:
        one.wait_scrapes()
        two.wait_scrapes()
        assert route_five(r, [one, two]) == expect


def test_hardware_aware_avoids_scraped_bandwidth_saturation(stubs, router):
    """README: bandwidth use from the rate of vllm:estimated_read_bytes_per_gpu_total; a
    server above the saturation threshold (0.85) pays a penalty in hardware-aware's
    estimate, so the default policy sends requests to the other, and follows a swap."""
    one, two = stubs(2)
    r = router([entry(one, "rtx-1"), entry(two, "rtx-2")])
    for busy, idle, expect in ((one, two, [0, 5]), (two, one, [5, 0])):
        busy.read_step, idle.read_step = 1e15, 0.0  # ~4 PB/s against a 4090's ~1 TB/s
        busy.wait_scrapes(3)
        idle.wait_scrapes(3)
        assert route_five(r, [one, two], max_tokens=64) == expect


def test_hardware_aware_uses_scraped_kv_capacity(stubs, router):
    """README: the real KV capacity from vllm:cache_config_info. A server whose page says its
    KV cache holds 32 tokens would overflow with a 100-token request: hardware-aware sends it
    to the other server of the class, and follows when the pages swap."""
    one, two = stubs(2)
    r = router([entry(one, "rtx-1"), entry(two, "rtx-2")])
    for small, large, expect in ((one, two, [0, 5]), (two, one, [5, 0])):
        small.gpu_blocks, large.gpu_blocks = 2, 100_000
        small.wait_scrapes()
        large.wait_scrapes()
        assert route_five(r, [one, two], max_tokens=64) == expect


def test_metrics_are_scraped_every_250_ms(stubs, router):
    """README: each backend's /metrics is scraped every 250 ms. The median gap between a
    stand-in's scrapes over a dozen of them is 250 ms (give or take a busy machine's delays)."""
    (one,) = stubs(1)
    router([entry(one, "rtx-1")])
    one.wait_scrapes(13)
    at = one.scraped_at[-13:]
    gaps = sorted(b - a for a, b in itertools.pairwise(at))
    median = gaps[len(gaps) // 2]
    assert 0.2 <= median <= 0.4, gaps


def test_figures_older_than_2_s_are_dropped():
    """README: figures older than 2 s are dropped and routing falls back to the router's own
    counts. LiveState keeps a page's figures up to 2 s after the scrape and clears them
    past it (the scrape loop calls `expire_all` after every round)."""
    b = Backend("http://127.0.0.1:1", "rtx-1", RTX, NAME, "bf16", kv_tokens=100_000)
    live = LiveState([b])
    page = (
        f'vllm:num_requests_running{{model_name="{NAME}"}} 7\n'
        f'vllm:num_requests_waiting{{model_name="{NAME}"}} 3\n'
        f'vllm:kv_cache_usage_perc{{model_name="{NAME}"}} 0.9\n'
    )
    live.apply(b, page, 100.0)
    live.expire_all(101.9)
    assert (b.running, b.waiting, b.kv_usage) == (7, 3, 0.9)
    live.expire_all(102.1)
    assert (b.running, b.waiting, b.kv_usage) == (0, 0, 0.0)


# --- retries, ejection, backoff -------------------------------------------------------------------


def test_5xx_before_first_byte_retried_twice_at_most(stubs, router):
    """README: 5xx answers before the first byte are retried on another backend (twice at
    most): with four backends all answering 503, one request makes exactly 3 attempts, each
    on a different backend, and the client gets an error."""
    four = stubs(4)
    for s in four:
        s.status = 503
    r = router([entry(s, f"rtx-{i + 1}") for i, s in enumerate(four)])
    status, _, _ = r.complete()
    assert status >= 500
    assert sorted(served(four)) == [0, 1, 1, 1]


def test_a_dropped_connection_is_retried_on_another_backend_twice_at_most(stubs, router):
    """README: connection failures before the first byte are retried on another backend
    (twice at most). Backends that drop the connection as the request arrives: with two of
    them ranked first, the third attempt answers; with every backend dropping, exactly 3
    attempts, then a 502."""
    four = stubs(4)
    r = router([entry(s, f"rtx-{i + 1}") for i, s in enumerate(four)], "--policy", "kv-aware")
    # kv-aware ranks by scraped KV usage: two droppers first, then a good one.
    for i, s in enumerate(four):
        s.status, s.kv = (0 if i < 2 else 200), 0.1 * i
    for s in four:
        s.wait_scrapes()
    status, _, answer = r.complete()
    assert status == 200, answer
    assert served(four) == [1, 1, 1, 0]
    # Every backend drops: three attempts, then the client's error.
    for s in four:
        s.status = 0
    before = served(four)
    status, _, _ = r.complete()
    assert status >= 500
    # Three backends tried, the fourth never. (A backend whose kept-alive connection drops may
    # see the request twice: the upstream client sends it once more on a fresh connection.)
    tried = [a - b for a, b in zip(served(four), before, strict=True)]
    assert [n > 0 for n in tried] == [True, True, True, False], tried


def test_ejection_backoff_doubles():
    """README: three failures in a row eject a backend, with a doubling backoff, until a scrape
    succeeds. Ejected for 1 s, readmitted by a scrape after it, ejected again for 2 s, then
    4 s; a request that goes through resets it to 1 s."""
    b = Backend("http://127.0.0.1:1", "rtx-1", RTX, NAME, "bf16", kv_tokens=100_000)
    live = LiveState([b])
    now = 0.0
    for expected in (1.0, 2.0, 4.0, 8.0):
        fails = 3 if expected == 1.0 else 1  # after a probe, half-open: one failure ejects
        for _ in range(fails):
            assert b.healthy
            live.failed(b, now)
        assert not b.healthy
        assert live.state(b).ejected_until == pytest.approx(now + expected)
        live.probed(b, now + expected - 0.01)
        assert not b.healthy  # still backing off
        now += expected
        live.probed(b, now)
        assert b.healthy
    live.succeeded(b)
    for _ in range(3):
        live.failed(b, now)
    assert live.state(b).ejected_until == pytest.approx(now + 1.0)


# --- the request body's priority and user ---------------------------------------------------------


@pytest.mark.parametrize("how", ["body priority", "X-Priority"])
def test_priority_orders_the_queue(stubs, router, how):
    """README: `X-Priority: 2` or the body's `priority` (0 is the most urgent): with the one
    server full (max_num_seqs 1), a request of priority 0 that queued after one of priority 9
    is sent first."""
    (one,) = stubs(1)
    one.hold = True
    r = router([entry(one, "rtx-1", max_num_seqs=1)])
    results: dict[str, int] = {}

    def send(tag: str, priority: int | None = None) -> threading.Thread:
        def go() -> None:
            prompt = f"{tag} " * 10
            if priority is None:
                results[tag] = r.complete(prompt=prompt)[0]
            elif how == "body priority":
                results[tag] = r.complete(prompt=prompt, priority=priority)[0]
            else:
                results[tag] = r.complete({"X-Priority": str(priority)}, prompt=prompt)[0]

        t = threading.Thread(target=go)
        t.start()
        return t

    threads = [send("first")]
    until(lambda: len(one.bodies) == 1, "the first request at the backend")
    threads.append(send("late", 9))
    until(lambda: r.metric("fleetctl_queue_depth") == 1, "one request queued")
    threads.append(send("urgent", 0))
    until(lambda: r.metric("fleetctl_queue_depth") == 2, "two requests queued")
    one.hold = False
    one.gate.set()
    for t in threads:
        t.join(WAIT_S)
    assert results == {"first": 200, "late": 200, "urgent": 200}
    order = [str(b["prompt"]).split()[0] for b in one.bodies]
    assert order == ["first", "urgent", "late"]


@pytest.mark.parametrize("how", ["body user", "X-Session-ID"])
def test_session_stays_on_its_class_when_loaded(stubs, router, how):
    """README "How routing decides": every turn of a session stays on the node class of its
    first turn, waiting for room there rather than switching; the session comes from
    `X-Session-ID` or the body's `user`. The first turn goes to the idle A100; with the A100
    then saturated, a request without a session goes to the 4090, the session's stays."""
    a100, rtx = stubs(2)
    r = router([entry(a100, "a100-1", A100), entry(rtx, "rtx-1", RTX)])

    def turn(session: str | None) -> str:
        if session is None:
            status, headers, _ = r.complete(max_tokens=64)
        elif how == "body user":
            status, headers, _ = r.complete(max_tokens=64, user=session)
        else:
            status, headers, _ = r.complete({"X-Session-ID": session}, max_tokens=64)
        assert status == 200
        return dict(headers)["X-Fleet-Class"]

    a100.wait_scrapes()
    assert turn("conv-1").startswith(A100)
    a100.read_step = 1e15
    a100.wait_scrapes(3)
    assert turn(None).startswith(RTX)  # the load is seen
    for _ in range(3):
        assert turn("conv-1").startswith(A100)
    assert turn("conv-2").startswith(RTX)  # a new session starts where it is best


def test_a_session_waits_for_room_on_its_class_rather_than_switching(stubs, router):
    """README: every turn of a session stays on its first turn's class, waiting for room there
    rather than switching. The A100 (max_num_seqs 1) is full with a held request: the
    session's turn waits in the router's queue while a request without a session goes to the
    idle 4090; once the A100 has room, the turn is served there."""
    a100, rtx = stubs(2)
    r = router([entry(a100, "a100-1", A100, max_num_seqs=1), entry(rtx, "rtx-1", RTX)])
    status, headers, _ = r.complete(user="conv-1")
    assert status == 200 and dict(headers)["X-Fleet-Class"].startswith(A100)
    a100.hold = True
    results: list[tuple] = []
    threads = [threading.Thread(target=lambda: results.append(r.complete()))]
    threads[0].start()
    try:
        until(lambda: len(a100.bodies) == 2, "a request filling the A100")
        threads.append(threading.Thread(target=lambda: results.append(r.complete(user="conv-1"))))
        threads[1].start()
        until(lambda: r.metric("fleetctl_queue_depth") == 1, "the session's turn queued")
        status, headers, _ = r.complete()
        assert status == 200 and dict(headers)["X-Fleet-Class"].startswith(RTX)  # room there
        assert len(rtx.bodies) == 1 and len(a100.bodies) == 2  # the turn still waits
    finally:
        a100.hold = False
        a100.gate.set()
        for t in threads:
            t.join(WAIT_S)
    assert [res[0] for res in results] == [200, 200]
    assert len(a100.bodies) == 3 and len(rtx.bodies) == 1
    assert all(dict(res[1])["X-Fleet-Class"].startswith(A100) for res in results)


def test_session_stays_on_its_node_when_that_costs_little(stubs, router):
    """README: on the same node when that costs little (warm prefix cache). Two 4090s; the
    session's first turn lands on one and is held in flight there, which makes that node a
    little slower (a sessionless request goes to the other); the session's next turn stays.
    With the node saturated (its steps many times slower), the session moves to the other node
    of its class."""
    one, two = stubs(2)
    r = router([entry(one, "rtx-1"), entry(two, "rtx-2")])
    one.wait_scrapes()
    two.wait_scrapes()
    one.hold = two.hold = True
    held = threading.Thread(target=r.complete, kwargs={"prompt": "hold " * 500, "user": "conv-1"})
    held.start()
    try:
        until(lambda: len(one.bodies) + len(two.bodies) == 1, "the first turn at a node")
        home = one if len(one.bodies) == 1 else two
        other = two if home is one else one
        other.hold = False
        n_other = len(other.bodies)
        assert r.complete(prompt="free " * 20)[0] == 200
        assert len(other.bodies) == n_other + 1  # the home node is the costlier one now
        home.hold = False  # later requests answer at once; the held one still waits
        assert r.complete(user="conv-1")[0] == 200
        assert len(home.bodies) == 2  # stayed home
        home.read_step = 1e15
        home.wait_scrapes(3)
        n_other = len(other.bodies)
        assert r.complete(user="conv-1", max_tokens=512)[0] == 200
        assert len(other.bodies) == n_other + 1  # too costly now: moved within the class
    finally:
        home.gate.set()
        held.join(WAIT_S)


# --- body limit, reload -----------------------------------------------------------------------


def test_max_body_mb_answers_413(stubs, router):
    """README: 413 for a body over `--max-body-mb`: at 1 MB, a 1.2 MiB body is refused with an
    OpenAI-style error before it reaches a backend, a 0.8 MiB one goes through."""
    (one,) = stubs(1)
    r = router([entry(one, "rtx-1")], "--max-body-mb", "1")
    pad = "x" * int(1.2 * 2**20)
    status, _, answer = r.complete(max_tokens=1, pad=pad)
    assert status == 413, answer
    assert "error" in json.loads(answer)
    assert one.bodies == []
    status, _, _ = r.complete(max_tokens=1, pad="x" * int(0.8 * 2**20))
    assert status == 200


def test_sighup_reload_keeps_requests_in_flight(stubs, router):
    """README: `kill -HUP` reloads the backends without dropping requests in flight: a request
    held at the old backend finishes with 200 after a reload that adds a second backend, and
    the new backend then gets traffic."""
    one, two = stubs(2)
    one.hold = True
    r = router([entry(one, "rtx-1")])
    result: list[tuple] = []
    t = threading.Thread(target=lambda: result.append(r.complete(max_tokens=4)))
    t.start()
    until(lambda: len(one.bodies) == 1, "the request in flight")
    r.write_backends([entry(one, "rtx-1"), entry(two, "rtx-2")])
    os.kill(r.proc.pid, signal.SIGHUP)
    until(lambda: "reloaded: 2 backends" in r.log.read_text(), "the reload's log line")
    one.gate.set()
    t.join(WAIT_S)
    assert result and result[0][0] == 200, result
    assert json.loads(result[0][2])["choices"][0]["text"] == " ok" * 4
    # The reload took: with rtx-1 failing now, requests are answered by rtx-2 (once its
    # /health admitted it), each retried there from rtx-1.
    one.status = 503
    until(lambda: r.complete()[0] == 200, "a request answered by the new backend")
    assert two.bodies


def test_kill_usr1_prints_every_threads_stack_and_serves_on(stubs, router):
    """README: `kill -USR1` prints every thread's stack to the log, for a daemon that seems
    stuck. The log gets faulthandler's dump of all threads ("Current thread ...", with
    route-serve's own frames in it), and the daemon goes on serving (SIGUSR1's default
    action would end it)."""
    (one,) = stubs(1)
    r = router([entry(one, "rtx-1")])
    assert r.complete()[0] == 200
    # The dump is a snapshot of whatever the main thread runs when the signal lands. Caught
    # inside a callback that uvloop (C) called, CPython 3.11 shows only the frames above the C
    # call (seen in CI: aiohttp's connection_lost, then asyncio's runner), so a dump that lacks
    # route-serve's frames is sent again, a few times at most.
    for _ in range(5):
        seen = len(r.log.read_text())
        os.kill(r.proc.pid, signal.SIGUSR1)
        until(
            lambda seen=seen: (
                r.proc.poll() is not None or "most recent call first" in r.log.read_text()[seen:]
            ),
            "the stack dump",
        )
        assert r.proc.poll() is None, r.log.read_text()
        dump = r.log.read_text()[seen:]
        # all_threads: each thread is "Thread 0x..." or "Current thread 0x..."; one thread
        # alone would be "Stack (most recent call first)".
        assert "Current thread 0x" in dump and "Stack (most recent call first)" not in dump, dump
        if "fleetctl" in dump:
            break
    assert 'File "' in dump and "fleetctl" in dump, dump
    status, _, body = r.request("GET", "/health")
    assert status == 200, body
    assert r.complete()[0] == 200 and len(one.bodies) == 2


# --- binds 127.0.0.1 by default -------------------------------------------------------------------


def listening(pid: int) -> list[str]:
    """The TCP sockets listening in `pid`'s network namespace, as HEXADDR:HEXPORT."""
    out = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                out.append(fields[1])
    return out


def in_own_netns(cmd: list[str], log: Path) -> subprocess.Popen:
    """Run `cmd` in a network namespace of its own (loopback up), so that its default port
    is free whatever else runs on this machine."""
    script = 'ip link set lo up && exec "$@"'
    with log.open("w") as out:
        return subprocess.Popen(
            ["unshare", "--net", "sh", "-c", script, "sh", *cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def loopback_hex(port: int) -> str:
    return f"0100007F:{port:04X}"


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace needs root")
@pytest.mark.parametrize("command", ["route-serve", "emulate"])
def test_binds_127_0_0_1_by_default(tmp_path, command):
    """README: route-serve serves on 127.0.0.1:8080 unless --listen or router.listen says
    otherwise; `fleetctl emulate` (vLLM's flags) on 127.0.0.1:8000 unless --host. Started
    without any address, each listens on loopback only: no wildcard socket."""
    if command == "route-serve":
        inv = tmp_path / "inventory.yaml"
        inv.write_text(INVENTORY)
        backends = tmp_path / "backends.yaml"
        stand_in = {"url": "http://127.0.0.1:9", "node": "rtx-1", "gpu_type": RTX}
        backends.write_text(
            json.dumps({"backends": [{**stand_in, "model": NAME, "variant": "bf16"}]})
        )
        args = ["route-serve", str(inv), "--backends", str(backends), "--no-request-log"]
        port = 8080
    else:
        args = ["emulate", "--gpu", RTX, "--model", NAME, "--served-model-name", NAME]
        port = 8000
    proc = in_own_netns([sys.executable, "-m", "fleetctl", *args], tmp_path / "server.log")
    try:
        # unshare execs sh, which execs the server: one pid, once in the new namespace.
        ours = os.readlink("/proc/self/ns/net")

        def bound() -> bool:
            if proc.poll() is not None:
                return True
            try:
                moved = os.readlink(f"/proc/{proc.pid}/ns/net") != ours
            except OSError:
                return False
            return moved and any(a.endswith(f":{port:04X}") for a in listening(proc.pid))

        until(bound, "a listening socket", 60)
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        assert listening(proc.pid) == [loopback_hex(port)]
    finally:
        stop_process(proc)


def test_the_inventorys_router_listen_and_priority_classes_reach_route_serve(stubs, tmp_path):
    """README: route-serve listens where `--listen` or the inventory's `router.listen` says; a
    priority that is not a whole number from 0 to `router.priority_classes - 1` is a 400 that
    says what is allowed. With `router: {listen: 127.0.0.1:PORT, priority_classes: 4}` and no
    --listen, it answers on PORT; priority 3 is served, 4 (served with the default 10 classes)
    is a 400 naming 0 to 3."""
    (one,) = stubs(1)
    port = free_port()
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        INVENTORY.replace(
            "router: {", f"router: {{listen: '127.0.0.1:{port}', priority_classes: 4, "
        )
    )
    backends = tmp_path / "backends.yaml"
    backends.write_text(json.dumps({"backends": [entry(one, "rtx-1")]}))
    log = tmp_path / "router.log"
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv), "--backends", str(backends)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--no-request-log"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        )
    try:

        def answers() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return http_request(port, "GET", "/health", timeout=2)[0] == 200
            except OSError:
                return False

        until(answers, "route-serve on router.listen", 60)
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        status, _, answer = http_request(port, "POST", "/v1/completions", {**body, "priority": 3})
        assert status == 200, answer
        status, _, answer = http_request(port, "POST", "/v1/completions", {**body, "priority": 4})
        assert status == 400, answer
        assert "from 0 (most urgent) to 3" in json.loads(answer)["error"]["message"], answer
        assert len(one.bodies) == 1
    finally:
        stop_process(proc)


# --- secrets, workers ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--api-key-file", "--backend-api-key-file"])
def test_a_key_file_readable_by_others_is_refused(tmp_path, flag):
    """README: `--api-key-file` (mode 0600). A key file that group or others can read stops
    route-serve before it serves: exit 2, one line naming the file and `chmod 600`."""
    key = tmp_path / "key"
    key.write_text("sk-readable-0123456789\n")
    key.chmod(0o644)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    backends = tmp_path / "backends.yaml"
    stand_in = {"url": "http://127.0.0.1:9", "node": "rtx-1", "gpu_type": RTX}
    backends.write_text(json.dumps({"backends": [{**stand_in, "model": NAME, "variant": "bf16"}]}))
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv), "--backends", str(backends)]
    cmd += ["--listen", f"127.0.0.1:{free_port()}", "--no-request-log", flag, str(key)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=WAIT_S)  # a route-serve that serves never ends
    finally:
        stop_process(proc)
    assert proc.returncode == 2, out
    assert b"readable by others" in out and f"chmod 600 {key}".encode() in out


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def test_a_dead_worker_is_started_again(stubs, router):
    """README "Router replicas": the first process starts a worker again if it dies; the port
    keeps answering."""
    (one,) = stubs(1)
    r = router([entry(one, "rtx-1")], "--workers", "2")
    until(lambda: len(children(r.proc.pid)) == 2, "two workers")
    first = children(r.proc.pid)
    os.kill(first[0], signal.SIGKILL)
    until(
        lambda: len([p for p in children(r.proc.pid) if p != first[0]]) == 2,
        "a new worker in its place",
    )
    assert r.proc.poll() is None
    assert "starting another" in r.log.read_text()
    assert r.complete()[0] == 200


def test_workers_restart_until_five_die_within_30_s(stubs, router):
    """README "Router replicas": the first process starts a worker again if it dies; five
    deaths within 30 s stop route-serve, exit 1."""
    (one,) = stubs(1)
    r = router([entry(one, "rtx-1")], "--workers", "2")
    killed: list[int] = []

    def alive() -> list[int]:
        return [p for p in children(r.proc.pid) if p not in killed]

    while True:
        # Both workers up (a death was replaced), or route-serve gave up.
        until(lambda: r.proc.poll() is not None or len(alive()) == 2, "a new worker or the end")
        if r.proc.poll() is not None:
            break
        pid = alive()[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        assert len(killed) <= 10, r.log.read_text()
    assert r.proc.returncode == 1, r.log.read_text()
    assert "too many workers died" in r.log.read_text()
    assert len(killed) == 5, f"route-serve stopped after {len(killed)} worker deaths"


# --- expected output length -------------------------------------------------------------------------


def test_expected_output_is_max_tokens_else_a_moving_average_from_the_workload(stubs, router):
    """README "How routing decides": expected output length is `max_tokens` when the client
    sets it, else a per-model moving average of what the model really generated, starting from
    the inventory's workload (mean_output_tokens: 64). Seen in the tokens the router reserves
    on the backend while a request is in flight (prompt + expected output)."""
    (one,) = stubs(1)
    one.hold = True
    r = router([entry(one, "rtx-1")])

    def reserved_while_held(**body: object) -> float:
        one.gate.clear()
        before = len(one.bodies)
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(r.complete(**body)[0]))
        t.start()
        until(lambda: len(one.bodies) == before + 1, "the request at the backend")
        reserved = r.metric("fleetctl_backend_reserved_tokens")
        one.gate.set()
        t.join(WAIT_S)
        assert result == [200]
        until(lambda: r.metric("fleetctl_backend_reserved_tokens") == 0, "the room given back")
        return reserved

    first = reserved_while_held(max_tokens=None)  # nothing observed yet: the workload's 64
    with_max = reserved_while_held(max_tokens=8)
    prompt = with_max - 8
    assert first - prompt == 64
    # The stand-in generated 1 and 8 tokens: the average has moved from 64 toward them.
    expected = reserved_while_held(max_tokens=None) - prompt
    assert 8 < expected < 64


def test_workers_each_reload_on_sighup(stubs, router):
    """README "Router replicas": the first process forwards SIGHUP to its workers; each
    reloads (every worker logs the reload)."""
    one, two = stubs(2)
    r = router([entry(one, "rtx-1")], "--workers", "2")
    # A worker that answered has its SIGHUP handler (set as its app starts, before it listens).
    answered: set[int] = set()

    def both_answered() -> bool:
        status, _, body = r.request("GET", "/health")
        if status == 200:
            answered.add(json.loads(body)["worker"])
        return answered == {0, 1}

    until(both_answered, "an answer from each worker")
    r.write_backends([entry(one, "rtx-1"), entry(two, "rtx-2")])
    os.kill(r.proc.pid, signal.SIGHUP)
    until(lambda: r.log.read_text().count("reloaded: 2 backends") == 2, "both workers reloaded")
    assert r.proc.poll() is None


@pytest.mark.parametrize(("count", "code"), [(100, 0), (101, 2)])
def test_warmup_requests_at_most_100(cli, tmp_path, count, code):
    """README: `router.warmup_requests: N` (default 0, at most 100)."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY.replace("router: {", f"router: {{warmup_requests: {count}, "))
    r = cli("validate", inv)
    assert r.code == code, r.out + r.err
    if code:
        assert "warmup_requests" in r.err


# --- hardware-aware's thresholds (the pure policy, as route-serve and simulate run it) -------------


def _a100_slower_by(catalog, ha, rtx, request, ratio: float):
    """An A100 whose backlog makes its estimate `ratio` times the idle 4090's (bisection)."""
    from tests.routing.test_policy import backend

    lo, hi = 0, 1_000_000
    target = ratio * ha.estimate(rtx, request)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ha.estimate(backend(catalog, "a100", pending_prefill=mid), request) < target:
            lo = mid
        else:
            hi = mid
    return backend(catalog, "a100", pending_prefill=hi)


def test_long_requests_need_a_small_kv_server_four_times_sooner(catalog):
    """README "How routing decides": prompt + expected output over long_context_tokens (4096)
    prefers the large-KV class: a small-KV server must promise the first token four times as
    soon to win it. At 3.8x the A100 keeps it, at 4.2x the 4090 wins; at 4096 tokens a
    request is not long, at 4097 it is."""
    from fleetctl.routing.policy import HardwareAware
    from tests.routing.test_policy import backend, req

    ha = HardwareAware()
    rtx = backend(catalog, "rtx", gpu="RTX-4090")
    # Two output tokens: the first token is all that differs (a long answer would weigh the
    # A100's faster decode too).
    long = req(prompt=5000, out=2)
    assert ha.choose(long, [_a100_slower_by(catalog, ha, rtx, long, 3.8), rtx]).backend.name == (
        "a100"
    )
    assert ha.choose(long, [_a100_slower_by(catalog, ha, rtx, long, 4.2), rtx]).backend.name == (
        "rtx"
    )
    a100 = backend(catalog, "a100")
    assert "length:short" in ha.choose(req(prompt=3996, out=100), [a100, rtx]).reason
    assert "length:long" in ha.choose(req(prompt=3997, out=100), [a100, rtx]).reason


@pytest.mark.parametrize("signal_name", ["bandwidth_util", "compute_util"])
def test_saturation_penalty_starts_above_0_85(catalog, signal_name):
    """README: decode steps slower by the share of memory bandwidth or compute in use past its
    saturation threshold (0.85): at 0.84 the decode estimate is the idle one's, at 0.86 it is
    higher; the first token is not touched."""
    from fleetctl.routing.policy import HardwareAware
    from tests.routing.test_policy import backend, req

    ha = HardwareAware()
    r = req(prompt=500, out=200)
    idle = ha.predict(backend(catalog, "b"), r)
    below = ha.predict(backend(catalog, "b", **{signal_name: 0.84}), r)
    above = ha.predict(backend(catalog, "b", **{signal_name: 0.86}), r)
    assert below.tpot_s == idle.tpot_s and above.tpot_s > idle.tpot_s
    assert above.ttft_s == below.ttft_s == idle.ttft_s


def test_a_server_without_v1_models_is_judged_by_metrics_and_requests(stubs, router):
    """README: a server without `/v1/models` is judged by its `/metrics` and requests alone:
    it stays in routing and serves."""
    (one,) = stubs(1)
    one.has_models = False
    r = router([entry(one, "rtx-1")])
    one.wait_scrapes()
    status, _, body = r.request("GET", "/health")
    assert status == 200, body
    assert r.complete()[0] == 200 and len(one.bodies) == 1
