"""route-serve owns every KV transfer of a split model: a client's `kv_transfer_params`
reach no server on any path and a server's never reach the client; a session's later turns
stay split; a failed prefill is retried only on a prefill server, else served whole; and no
prefill server keeps a prompt's blocks for a request that ended, or the router counts them.

Backends are stand-ins that speak vLLM 0.32's protocol and record every body they receive
(`PdStub`, one thread each), and emulated vLLM servers where the blocks a prefill server
holds are observed (`fleetctl emulate`, its side channel on its own port). The property test
at the end runs the split path against any body, header and fault of either server: a fixed
seed and a small budget (FLEETCTL_FUZZ_EXAMPLES / 6 examples, 50 by default).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import Callable

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetctl.daemon.disagg import PREFILL_PARAMS
from fleetctl.routing.policy import HardwareAware
from fleetctl.routing.scheduler import Aging, Scheduler
from fleetctl.routing.types import Request
from harness.procs import free_port
from tests.daemon.test_disaggregation_route import counter
from tests.daemon.test_route_serve import Router
from tests.procs import NAME, Emulator
from tests.routing.test_policy import backend

A100, H100, RTX = "A100-SXM4-80GB", "H100-SXM-80GB", "RTX-4090"
WAIT_S = 30.0  # only stops a hang: every wait below ends on its event
LEASE_S = 30.0  # the stand-ins' lease, vLLM 0.32's default kv_lease_duration
# What a hostile client sends to steer a decode server's NIXL connector at its own host.
EVIL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_host": "10.9.9.9",
    "remote_port": 4444,
    "remote_engine_id": "evil",
    "remote_block_ids": [0, 1, 2],
    "remote_request_id": "evil-1",
}
PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
PROMPT = "hello " * 400


def until(cond: Callable[[], bool], what: str, deadline_s: float = WAIT_S) -> None:
    """Poll a condition that an event makes true; fails with `what` if it never does."""
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


# Blocks the stand-in prefill servers keep for a decode server: request id -> lease end.
HELD: dict[str, float] = {}
HELD_LOCK = threading.Lock()
_ids = itertools.count()


def held_now() -> int:
    now = time.monotonic()
    with HELD_LOCK:
        return sum(1 for end in HELD.values() if end > now)


def free(params: object) -> None:
    """A decode server is done with a prefill server's blocks (pulled, refused, aborted)."""
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        with HELD_LOCK:
            HELD.pop(str(params.get("remote_request_id")), None)


class PdStub:
    """A vLLM 0.32 server with a NIXL connector, as far as the router sees it. `mode`:
    "ok"; "500" (its engine dead: it frees nothing); "400" (it refuses the body, and frees
    a prefill server's blocks, as vLLM's rejection cleanup does); "hang" (until the router
    gives up; the abort frees the blocks); "drop" (the connection drops, nothing freed);
    "leak" (answers with transfer details of its own, whole and streamed)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = f"engine-{self.port}"
        self.mode = "ok"
        self.metrics_status = 200
        self.bodies: list[dict] = []
        self.on_request: Callable[[], None] = lambda: None  # called as each one arrives
        self._ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{NAME}"}}'
        text = f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} 0\n"
        return web.Response(text=text, status=self.metrics_status, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": NAME, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        self.on_request()
        params = body.get("kv_transfer_params")
        mode = self.mode
        try:
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "drop":
                assert request.transport is not None
                request.transport.abort()
                raise web.HTTPInternalServerError()
            if mode == "500":
                return web.json_response(error("EngineCore died", 500), status=500)
            free(params)  # pulled, or refused before its engine saw it
            if mode == "400":
                return web.json_response(error("bad body", 400), status=400)
            return await self.answer(request, body, params)
        except asyncio.CancelledError:
            free(params)  # the router closed the connection: vLLM aborts, and says so
            raise

    async def answer(self, request: web.Request, body: dict, params: object) -> web.StreamResponse:
        own = None
        if isinstance(params, dict) and params.get("do_remote_decode") and self.role != "decode":
            rid = f"{self.engine}-{next(_ids)}"
            with HELD_LOCK:
                HELD[rid] = time.monotonic() + LEASE_S
            own = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [0, 1],
                "remote_engine_id": self.engine,
                "remote_request_id": rid,
                "remote_host": "127.0.0.1",
                "remote_port": self.port,
            }
        if self.mode == "leak":
            own = {"remote_engine_id": self.engine, "remote_host": "127.0.0.1", "remote_port": 1}
        n = body.get("max_tokens") if type(body.get("max_tokens")) is int else 4
        n = max(1, min(n, 4))
        choice = {"index": 0, "text": " hi" * n, "finish_reason": "length"}
        answer = {"id": "cmpl-1", "object": "text_completion", "model": NAME, "choices": [choice]}
        answer["usage"] = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        if own is not None:
            answer["kv_transfer_params"] = own
        if not body.get("stream"):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            event = {"id": "cmpl-1", "object": "text_completion", "model": NAME}
            event["choices"] = [{"index": 0, "text": " hi", "finish_reason": None}]
            if own is not None and i == n - 1:
                event["kv_transfer_params"] = own
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def error(message: str, code: int) -> dict:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": code}}


def stub_entry(stub: PdStub, node: str, gpu: str, role: str) -> dict:
    return {"url": stub.url, "node": node, "gpu_type": gpu, "model": NAME, "role": role}


def prefill_backend(headers: dict) -> str | None:
    return headers.get("X-Fleet-Prefill-Backend")


def router_held(router: Router) -> float:
    """fleetctl_prefill_kv_held over every prefill server."""
    total = 0.0
    for line in router.metrics().splitlines():
        if line.startswith("fleetctl_prefill_kv_held{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def reached_a_server(body: dict, engines: set[str]) -> bool:
    """Whether a body a server received carries transfer fields the router did not set: the
    prefill request's own, or a prefill server's answer (its engine, on loopback)."""
    if "ec_transfer_params" in body:
        return True
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and ({"kv_transfer_params", "ec_transfer_params"} & set(xargs)):
        return True
    kv = body.get("kv_transfer_params")
    if kv is None or kv == PREFILL_PARAMS:
        return False
    ours = isinstance(kv, dict) and kv.get("remote_engine_id") in engines
    return not (ours and kv.get("remote_host") == "127.0.0.1")


@pytest.fixture
def pd(tmp_path):
    """One stand-in prefill server (an RTX 4090) and one decode server (an A100)."""
    p, d = PdStub("prefill"), PdStub("decode")
    yield tmp_path, p, d


def test_a_sessions_later_turns_stay_split_and_carry_no_client_params(pd):
    tmp, p, d = pd
    entries = [stub_entry(p, "rtx-1", RTX, "prefill"), stub_entry(d, "a100-1", A100, "decode")]
    router = Router(tmp, entries, name="affinity")
    try:
        for turn in range(4):
            p.bodies.clear()
            d.bodies.clear()
            by_header = {"X-Session-ID": "s-42"} if turn % 2 else None
            extra = {} if turn % 2 else {"user": "alice"}
            status, headers, body = router.complete(
                max_tokens=4, headers=by_header, kv_transfer_params=EVIL, **extra
            )
            assert status == 200, body
            # Split every turn: a one-token prefill on the prefill server, the answer from
            # the decode server pulling what that prefill server answered.
            assert [b["kv_transfer_params"] for b in p.bodies] == [PREFILL_PARAMS], turn
            assert [b["kv_transfer_params"]["remote_engine_id"] for b in d.bodies] == [p.engine]
            assert headers["X-Fleet-Backend"] == "a100-1"
            assert prefill_backend(headers) == p.url.removeprefix("http://")
            assert b"10.9.9.9" not in json.dumps(p.bodies + d.bodies).encode()
    finally:
        router.stop()


def test_a_session_is_pinned_to_the_class_that_decodes_it(catalog):
    """Pure: the scheduler and hardware-aware, as route-serve and the simulator run them."""
    p = backend(catalog, "rtx-1", RTX, role="prefill")
    a100 = backend(catalog, "a100-1", A100, role="decode")
    h100 = backend(catalog, "h100-1", H100, role="decode")
    policy = HardwareAware()
    sched = Scheduler(policy, Aging())
    fleet = [p, a100, h100]

    def turn(i: int) -> tuple[str, str]:
        req = Request(i, NAME, 500, 50, session="s-1")
        sched.submit(req)
        sent, _ = sched.dispatch(float(i), fleet)
        first = sent[0].decision.backend
        decode = sched.decode_for(req, fleet)
        assert first is not None and decode is not None and decode.backend is not None
        return first.name, decode.backend.name

    h100.healthy = False  # the first turn decodes on the A100s
    assert turn(1) == ("rtx-1", "a100-1")
    assert policy.sessions.get("s-1").node_class == a100.node_class
    h100.healthy = True  # faster now, but the session stays on its class, and split
    assert [turn(i) for i in (2, 3)] == [("rtx-1", "a100-1")] * 2
    assert turn(4) == ("rtx-1", "a100-1")
    # Without a session, the H100 decodes (its steps are the shortest).
    req = Request(9, NAME, 500, 50)
    assert sched.decode_for(req, fleet).backend is h100


def test_with_the_prefill_servers_ejected_the_decode_server_never_sees_client_params(pd):
    tmp, p, d = pd
    p.metrics_status = 500  # its /metrics fails: the router ejects it
    entries = [stub_entry(p, "rtx-1", RTX, "prefill"), stub_entry(d, "a100-1", A100, "decode")]
    router = Router(tmp, entries, name="ejected")
    try:

        def ejected() -> bool:
            health = json.loads(router.request("GET", "/health")[2])
            return any(name.startswith("rtx-1") for name in health.get("unhealthy", {}))

        until(ejected, "the prefill server's ejection")
        for extra in ({"kv_transfer_params": EVIL}, {"vllm_xargs": {"kv_transfer_params": "x"}}):
            status, headers, body = router.complete(max_tokens=4, **extra)
            assert status == 200, body
            assert p.bodies == []
            got = d.bodies.pop()
            assert "kv_transfer_params" not in got and "kv_transfer_params" not in got.get(
                "vllm_xargs", {}
            )
            assert got["max_tokens"] == 4  # served whole: the decode server prefills it
            assert prefill_backend(headers) is None
    finally:
        router.stop()


def test_a_client_asking_for_remote_decode_gets_no_transfer_details_back(tmp_path):
    # A colocated server with a NIXL connector (kv_both) answers with its transfer details
    # to whoever asks: the router neither asks for the client nor passes them on.
    both = Emulator(tmp_path, "--kv-transfer-config", PRODUCER.replace("producer", "both"))
    leaky = PdStub("both")
    leaky.mode = "leak"
    try:
        both.wait_healthy()
        router = Router(
            tmp_path,
            [{"url": both.base, "node": "rtx-1", "gpu_type": RTX, "model": NAME}],
            name="ask",
        )
        leaking = Router(tmp_path, [stub_entry(leaky, "rtx-2", RTX, "both")], name="leak")
        try:
            ask = {"kv_transfer_params": {"do_remote_decode": True}}
            status, _, body = router.complete(PROMPT, max_tokens=2, **ask)
            assert status == 200, body
            # vLLM's own null stays; no engine, host or blocks of the server's.
            assert json.loads(body)["kv_transfer_params"] is None
            assert b"remote_engine_id" not in body and b"remote_host" not in body
            # A server that answers with them unasked: dropped from whole answers and streams.
            for stream in (False, True):
                status, _, body = leaking.complete(max_tokens=3, stream=stream)
                assert status == 200 and b"choices" in body, body
                assert b"kv_transfer_params" not in body and leaky.engine.encode() not in body
        finally:
            router.stop()
            leaking.stop()
    finally:
        both.stop()


@pytest.mark.parametrize("fault", ["500", "hang"])
def test_a_failed_prefill_is_never_retried_on_a_decode_server(pd, fault):
    tmp, p, d = pd
    p.mode = fault
    entries = [stub_entry(p, "rtx-1", RTX, "prefill"), stub_entry(d, "a100-1", A100, "decode")]
    router = Router(tmp, entries, "--upstream-timeout", "1", name=f"prefill-{fault}")
    try:
        status, headers, body = router.complete(max_tokens=4, kv_transfer_params=EVIL)
        assert status in (200, 503), body
        assert prefill_backend(headers) in (None, p.url.removeprefix("http://"))
        if status == 200:  # served whole by the decode server, which prefilled it
            assert headers["X-Fleet-Backend"] == "a100-1"
            assert [b.get("kv_transfer_params") for b in d.bodies] == [None]
            assert d.bodies[0]["max_tokens"] == 4
        else:
            assert json.loads(body)["error"]["code"] == 503
    finally:
        router.stop()


def test_a_failed_prefill_with_no_server_left_is_a_clear_503(pd):
    tmp, p, d = pd
    p.mode = "hang"

    def decode_server_fails() -> None:  # its /metrics fails from now: ejected within 0.75 s
        d.metrics_status = 500

    p.on_request = decode_server_fails
    entries = [stub_entry(p, "rtx-1", RTX, "prefill"), stub_entry(d, "a100-1", A100, "decode")]
    router = Router(tmp, entries, "--upstream-timeout", "3", name="none-left")
    try:
        status, headers, body = router.complete(max_tokens=4)
        err = json.loads(body)["error"]
        assert status == 503 and err["code"] == 503 and err["type"] == "server_error", body
        assert "every prefill server tried failed" in err["message"]
        assert d.bodies == [] and prefill_backend(headers) is None
    finally:
        router.stop()


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """Emulated prefill servers whose side channel is their own port, one with vLLM's lease
    (30 s) and one with a lease of 2 s; an A100 decode server and one that fails."""
    tmp = tmp_path_factory.mktemp("held")
    short = PRODUCER[:-1] + ',"kv_connector_extra_config":{"kv_lease_duration":2}}'
    emus = {
        "p": Emulator(tmp, "--kv-transfer-config", PRODUCER, side_channel=True),
        "p-short": Emulator(tmp, "--kv-transfer-config", short, side_channel=True),
        "d": Emulator(tmp, "--kv-transfer-config", CONSUMER, gpu=A100),
        "failing": Emulator(tmp, "--kv-transfer-config", CONSUMER, "--error-rate", "1", gpu=A100),
    }
    try:
        for e in emus.values():
            e.wait_healthy()
        yield tmp, emus
    finally:
        for e in emus.values():
            e.stop()


def gauge(emu: Emulator, name: str) -> float:
    return next(s.value for s in emu.metrics()[name].samples)  # type: ignore[attr-defined]


def emu_entry(emu: Emulator, node: str, gpu: str, role: str) -> dict:
    return {"url": emu.base, "node": node, "gpu_type": gpu, "model": NAME, "role": role}


def test_a_decode_server_that_never_got_the_request_passes_the_blocks_on(emulated):
    tmp, emus = emulated
    p, d = emus["p"], emus["d"]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the connection is refused
    entries = [emu_entry(p, "rtx-1", RTX, "prefill"), emu_entry(d, "a100-1", A100, "decode")]
    # On an H100 its decode steps are the shortest: the router tries it first.
    entries.append(
        {"url": dead, "node": "h100-1", "gpu_type": H100, "model": NAME, "role": "decode"}
    )
    router = Router(tmp, entries, "--scrape-interval", "60", name="dead-decode")
    try:
        pulled = counter(d, "vllm:prompt_tokens_by_source", source="external_kv_transfer")
        status, headers, body = router.complete(PROMPT, max_tokens=4)
        assert status == 200, body
        assert headers["X-Fleet-Backend"] == "a100-1"
        assert prefill_backend(headers) == p.base.removeprefix("http://")
        # The A100 got the prefill server's parameters and pulled the blocks, then told the
        # prefill server, which holds nothing (well before its 30 s lease); the router
        # counts nothing held.
        now = counter(d, "vllm:prompt_tokens_by_source", source="external_kv_transfer")
        assert now - pulled == json.loads(body)["usage"]["prompt_tokens"]
        until(lambda: gauge(p, "fleetctl_emulator_kv_held_requests") == 0, "the blocks freed")
        assert router_held(router) == 0
    finally:
        router.stop()


def test_a_decode_server_failing_after_the_prefill_leaves_the_blocks_counted(emulated):
    tmp, emus = emulated
    p, failing = emus["p-short"], emus["failing"]
    entries = [emu_entry(p, "rtx-2", RTX, "prefill"), emu_entry(failing, "a100-9", A100, "decode")]
    router = Router(tmp, entries, name="failed-decode")
    try:
        status, _, body = router.complete(PROMPT, max_tokens=4)
        assert status == 502 and json.loads(body)["error"]["code"] == 502, body
        # vLLM's decode server that fails without a word (its engine dead) frees nothing: the
        # prefill server holds the blocks until its lease ends, and the router counts them.
        assert router_held(router) == 1
        assert gauge(p, "fleetctl_emulator_kv_held_requests") == 1
        until(lambda: gauge(p, "fleetctl_emulator_kv_held_requests") == 0, "the lease's end")
    finally:
        router.stop()


def test_a_batch_of_prompts_is_served_whole_without_a_prefill(emulated):
    tmp, emus = emulated
    p, d = emus["p"], emus["d"]
    entries = [emu_entry(p, "rtx-1", RTX, "prefill"), emu_entry(d, "a100-1", A100, "decode")]
    router = Router(tmp, entries, name="batch")
    try:
        sent = counter(p, "vllm:request_success")
        for extra in ({"prompt": [PROMPT, "bye " * 50]}, {"prompt": PROMPT, "n": 2}):
            status, headers, body = router.request(
                "POST", "/v1/completions", {"model": NAME, "max_tokens": 3, **extra}
            )
            assert status == 200, body
            assert len(json.loads(body)["choices"]) == 2
            assert prefill_backend(headers) is None and headers["X-Fleet-Backend"] == "a100-1"
        assert counter(p, "vllm:request_success") == sent  # no prefill ran
        assert gauge(p, "fleetctl_emulator_kv_held_requests") == 0
    finally:
        router.stop()


# --- the property: any body, any header, any fault --------------------------------------------

EXAMPLES = max(10, int(os.environ.get("FLEETCTL_FUZZ_EXAMPLES", "300")) // 6)
FUZZ = settings(
    derandomize=True,
    database=None,
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
WORDS = st.text(alphabet="abcdefgh ", min_size=1, max_size=40)
TRANSFER = st.one_of(
    st.just(EVIL),
    st.just({"do_remote_decode": True}),
    st.just({"do_remote_decode": True, "do_remote_prefill": True, "remote_host": "10.9.9.9"}),
    st.dictionaries(st.sampled_from(sorted(EVIL)), st.sampled_from([None, True, "10.9.9.9", 7])),
    st.sampled_from(["10.9.9.9", 1, None, [EVIL]]),
)
BODY = st.fixed_dictionaries(
    {"prompt": st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=3))},
    optional={
        "max_tokens": st.one_of(st.integers(1, 6), st.sampled_from([0, "3"])),
        "stream": st.booleans(),
        "n": st.integers(1, 2),
        "user": WORDS,
        "min_tokens": st.integers(0, 3),
        "stream_options": st.just({"include_usage": True}),
        "kv_transfer_params": TRANSFER,
        "ec_transfer_params": TRANSFER,
        "vllm_xargs": st.fixed_dictionaries({}, optional={"kv_transfer_params": TRANSFER}),
    },
)
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "X-Session-ID",
            "X-Priority",
            "X-Fleet-Precision",
            "X-Request-Id",
            "X-Fleet-Prefill-Backend",
            "kv_transfer_params",
        ]
    ),
    st.one_of(
        st.sampled_from(["0", "9", "bf16", "int4;strict", "s-1"]),
        st.text(alphabet="abc019.;-", min_size=1, max_size=12),
    ),
    max_size=3,
)
# Mostly answering: a backend failing three times in a row is ejected (for 1 s, doubling),
# and a fleet all ejected answers every example with the same 503.
MODES = st.sampled_from(["ok", "500", "ok", "400", "ok", "hang", "ok", "drop"])


def openai_shaped(status: int, headers: dict, body: bytes) -> bool:
    """A JSON answer (choices, or an error object), or a stream of JSON events that ends
    with [DONE] or an error event."""
    if status == 200 and headers.get("Content-Type", "").startswith("text/event-stream"):
        events = [e for e in body.split(b"\n\n") if e.strip()]
        if not events:
            return False
        for e in events:
            if not e.startswith(b"data: "):
                return False
            if e != b"data: [DONE]":
                json.loads(e[6:])
        return events[-1] == b"data: [DONE]" or b'"error"' in events[-1]
    doc = json.loads(body)
    if status == 200:
        return isinstance(doc, dict) and isinstance(doc.get("choices"), list)
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "code" in err


class Fleet:
    """Two stand-in prefill servers and two decode servers of two classes behind one
    route-serve, whose faults each example sets. A backend that failed three times in a row
    is ejected (for 1 s, doubling): an example that finds one ejected starts a fresh
    route-serve, so that every example meets the whole fleet."""

    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.stubs = {
            "rtx-1": PdStub("prefill"),
            "rtx-2": PdStub("prefill"),
            "a100-1": PdStub("decode"),
            "h100-1": PdStub("decode"),
        }
        gpus = {"rtx-1": RTX, "rtx-2": RTX, "a100-1": A100, "h100-1": H100}
        self.entries = [stub_entry(s, n, gpus[n], s.role) for n, s in self.stubs.items()]
        self.router = self._start()
        self.starts = 1

    def _start(self) -> Router:
        return Router(self.tmp, self.entries, "--upstream-timeout", "0.5", name="fuzz")

    def whole(self) -> Router:
        health = json.loads(self.router.request("GET", "/health")[2])
        if health["healthy"] < len(self.stubs):
            self.router.stop()
            # What the stand-ins still hold was held against the stopped router's count
            # when its example ended; the new one counts from nothing.
            with HELD_LOCK:
                HELD.clear()
            self.router = self._start()
            self.starts += 1
        return self.router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fuzz"))
    try:
        yield f
    finally:
        f.router.stop()


@FUZZ
@given(
    body=BODY,
    headers=HEADERS,
    chat=st.booleans(),
    modes=st.tuples(MODES, MODES, MODES, MODES),
)
def test_the_split_path_holds_for_any_body_header_and_fault(fleet, body, headers, chat, modes):
    router, stubs = fleet.whole(), fleet.stubs
    for stub, mode in zip(stubs.values(), modes, strict=True):
        stub.mode = mode
        stub.bodies.clear()
    request = {"model": NAME, **body}
    if chat:
        prompt = request.pop("prompt")
        text = prompt if isinstance(prompt, str) else " ".join(prompt)
        request["messages"] = [{"role": "user", "content": text}]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, got, answer = router.request("POST", path, request, headers, timeout=30)
    engines = {s.engine for s in stubs.values()}
    for name, stub in stubs.items():
        for seen in stub.bodies:
            assert not reached_a_server(seen, engines), (name, seen)
    assert openai_shaped(status, got, answer), (status, answer[:300])
    assert b"remote_engine_id" not in answer and b"remote_host" not in answer
    prefill = prefill_backend(got)
    decoders = {stubs[n].url.removeprefix("http://") for n in ("a100-1", "h100-1")}
    assert prefill not in decoders
    # The request ended: whatever a prefill server still holds, the router counts (the
    # decode server that received it failed without a word), to drop at the lease's end.
    assert held_now() <= router_held(router)
