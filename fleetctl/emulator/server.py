"""The HTTP side: vLLM 0.32's OpenAI-compatible endpoints, auth, faults, and serving the app."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleetctl.base import names
from fleetctl.daemon import listen
from fleetctl.emulator import prompts as naming
from fleetctl.emulator import protocol as proto
from fleetctl.emulator.config import VLLM_VERSION, EmulatorConfig
from fleetctl.emulator.driver import ABORTED, Driver, Job, Update
from fleetctl.emulator.kv_publisher import KvEventPublisher
from fleetctl.emulator.kv_transfer import (
    NOTIFY_PATH,
    HeldBlocks,
    answer_params,
    notify_prefill_server,
    remote_prefill,
    wants_remote_decode,
)
from fleetctl.emulator.lora import Adapters
from fleetctl.emulator.metrics import CacheInfo, Recorder, render
from fleetctl.emulator.sleep import GpuLedger, Sleeper, attach
from fleetctl.model.perf import cuda_total
from fleetctl.sim.engine import WAITING

log = logging.getLogger("fleetctl.emulator")
# uvicorn's access line, which is what vLLM prints; never headers, so never the API key.
ACCESS_LOG_FORMAT = '%a - "%r" %s'
DIE_AFTER_CHUNKS = 3  # --die-mid-stream: chunks sent before the connection drops
CRASH_DELAY_S = 0.05  # --crash-after: let the last response leave the socket first
# On SIGTERM or SIGINT, requests in flight get this long to finish before they are cut: an
# emulator is a test fixture, stopped to end a run, whose client should not wait on it.
DRAIN_S = 0.25
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class State:
    """One server's mutable state, shared by the handlers."""

    config: EmulatorConfig
    recorder: Recorder
    cache: CacheInfo
    driver: Driver | None = None
    task: asyncio.Task[None] | None = None
    publisher: KvEventPublisher | None = None
    started: float = field(default_factory=time.monotonic)
    rng: random.Random = field(default_factory=random.Random)
    completion_requests: int = 0
    streams: int = 0
    completed: int = 0
    hung: bool = False
    held: HeldBlocks = field(default_factory=HeldBlocks)  # KV kept for decode servers
    sleeper: Sleeper | None = None
    adapters: Adapters | None = None  # with --enable-lora
    lora_jobs: dict[int, tuple[str, Job]] = field(default_factory=dict)  # id(job) -> adapter

    def lora_names(self) -> tuple[list[str], list[str]]:
        """The adapters with requests running (scheduled) and waiting, each named once."""
        running: dict[str, None] = {}
        waiting: dict[str, None] = {}
        for name, job in self.lora_jobs.values():
            if not job.finished:  # a preempted one waits again, as vLLM counts it
                (waiting if job.seq.state == WAITING else running)[name] = None
        return list(running), list(waiting)

    @property
    def loading(self) -> bool:
        return time.monotonic() - self.started < self.config.faults.startup_delay

    @property
    def engine_dead(self) -> bool:
        return self.task is not None and self.task.done()

    def run(self) -> Driver:
        """The driver, or vLLM's EngineDeadError answer once its task has died."""
        assert self.driver is not None, "the app has not started"
        if self.engine_dead:
            raise proto.ApiError(500, ENGINE_DEAD, "InternalServerError")
        return self.driver


STATE = web.AppKey("state", State)


def make_app(config: EmulatorConfig) -> web.Application:
    """The aiohttp application of one emulated vLLM server (its engine starts with the app)."""
    state = State(
        config,
        Recorder(config.max_model_len),
        CacheInfo(
            config.kv_cache_dtype,
            config.gpu_memory_utilization,
            config.kv_cache_bytes,
            config.budget.kv_tokens,
            config.max_model_len,
        ),
        rng=random.Random(config.faults.seed),
        adapters=Adapters(config.lora) if config.lora is not None else None,
    )
    app = web.Application(middlewares=[_hang_mw, _errors_mw, _auth_mw, _loading_mw])
    app[STATE] = state
    app.router.add_get("/health", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post(NOTIFY_PATH, _notified)
    if config.lora is not None and config.lora.runtime:  # vLLM serves them only then
        app.router.add_post("/v1/load_lora_adapter", _load_lora)
        app.router.add_post("/v1/unload_lora_adapter", _unload_lora)
    state.sleeper = _sleeper(config)
    if config.dev_mode:
        attach(app, state.sleeper, state.run)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    app.on_response_prepare.append(_server_header)
    return app


def _sleeper(c: EmulatorConfig) -> Sleeper:
    """The server's sleep state; with --gpu-ledger, on the memory of the GPU it shares."""
    total = cuda_total(c.gpu)
    ledger = None
    if c.gpu_ledger is not None:
        ledger = GpuLedger(c.gpu_ledger, f"{c.host}_{c.port}", total)
    return Sleeper(
        c.sleep_mode,
        c.wake_seconds,
        awake_bytes=int(total * c.gpu_memory_utilization),
        asleep_bytes=c.budget.non_torch,
        time_scale=c.time_scale,
        ledger=ledger,
    )


async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    c = state.config
    state.started = time.monotonic()
    if state.sleeper is not None:
        state.sleeper.start()
    if c.kv_events is not None and c.prefix_caching:
        state.publisher = KvEventPublisher(c.kv_events)
        log.info("publishing KV events on %s", c.kv_events.endpoint)
    state.driver = Driver(c.engine(), c.time_scale, state.recorder, publisher=state.publisher)
    state.task = asyncio.create_task(state.driver.run())
    state.task.add_done_callback(_engine_died)


def _engine_died(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("the engine loop died", exc_info=task.exception())


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE]
    if state.sleeper is not None:
        state.sleeper.stop()
    task = state.task
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if state.publisher is not None:
        await asyncio.to_thread(state.publisher.close)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "uvicorn"  # what a real vLLM answers with


def _json(body: Any, status: int = 200) -> web.Response:
    # Compact, as Starlette's JSONResponse (vLLM's) writes it.
    return web.json_response(body, status=status, dumps=proto.dumps)


# --- middlewares ---------------------------------------------------------------------------


async def _hang_forever() -> None:
    await asyncio.get_running_loop().create_future()


@web.middleware
async def _hang_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.app[STATE].hung:
        await _hang_forever()
    return await handler(request)


@web.middleware
async def _auth_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
    # vLLM checks the key on /v1 paths only (not /health or /metrics), and lets OPTIONS through.
    keys = request.app[STATE].config.api_keys
    if keys and request.path.startswith("/v1") and request.method != "OPTIONS":
        given = request.headers.get("Authorization", "")
        if given not in {f"Bearer {k}" for k in keys}:
            return _json({"error": "Unauthorized"}, 401)
    return await handler(request)


@web.middleware
async def _loading_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.app[STATE].loading:
        if request.path == "/health":
            return web.Response(status=503)
        if request.path.startswith("/v1"):
            raise proto.ApiError(503, "The model is still loading.", "ServiceUnavailableError")
    return await handler(request)


@web.middleware
async def _errors_mw(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except proto.ApiError as e:
        return _json(e.body(), e.status)
    except web.HTTPException as e:
        if e.status in (404, 405):  # FastAPI's bodies for unknown routes and methods
            return _json({"detail": e.reason}, e.status)
        raise
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away
    except Exception as e:
        log.exception("internal error")
        return _json(proto.error_body(500, str(e), "InternalServerError"), 500)


# --- simple endpoints ------------------------------------------------------------------------


async def _health(request: web.Request) -> web.StreamResponse:
    return web.Response(status=503 if request.app[STATE].engine_dead else 200)


async def _version(request: web.Request) -> web.StreamResponse:
    # The version of vLLM being emulated, so clients that check it see a supported server.
    return _json({"version": VLLM_VERSION})


async def _models(request: web.Request) -> web.StreamResponse:
    c = request.app[STATE].config
    created = int(time.time())
    cards = [_model_card(name, c, created) for name in c.served_names]
    adapters = request.app[STATE].adapters
    if adapters is not None:
        cards += adapters.cards(c.name, created, cards[0]["permission"][0])
    return _json({"object": "list", "data": cards})


def _model_card(name: str, c: EmulatorConfig, created: int) -> dict[str, Any]:
    permission = {
        "id": f"modelperm-{os.urandom(16).hex()}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": c.source,
        "parent": None,
        "max_model_len": c.max_model_len,
        "permission": [permission],
    }


async def _metrics(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    sleeper = state.sleeper
    text = render(
        state.config.name,
        state.run().engine,
        state.recorder,
        state.cache,
        state.config.time_scale,
        sleeper.state_gauge() if sleeper is not None else None,
    )
    if sleeper is not None:
        text += sleeper.metrics() + _arrival_metrics(state.run().arrivals)
    if state.config.kv_transfer is not None:
        text += _held_metrics(state.held)
    if state.adapters is not None:
        text += state.adapters.metric(*state.lora_names())
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def _arrival_metrics(arrivals: dict[str, int]) -> str:
    """The emulator's own counter (vLLM has none): requests that arrived while it served,
    and those parked because it slept (a router that knows the state sends none of those)."""
    name = "fleetctl_emulator_arrivals_total"
    lines = [
        f"# HELP {name} Requests that arrived, by whether the engine slept then (parked).",
        f"# TYPE {name} counter",
        *(f'{name}{{engine_state="{k}"}} {v}' for k, v in sorted(arrivals.items())),
    ]
    return "\n".join(lines) + "\n"


def _held_metrics(held: HeldBlocks) -> str:
    """The emulator's own gauges (vLLM has none): what it holds for decode servers."""
    requests, blocks = held.count()
    return (
        "# HELP fleetctl_emulator_kv_held_requests Requests whose KV blocks this prefill "
        "server keeps for a decode server.\n"
        "# TYPE fleetctl_emulator_kv_held_requests gauge\n"
        f"fleetctl_emulator_kv_held_requests {requests}\n"
        "# HELP fleetctl_emulator_kv_held_blocks KV blocks this prefill server keeps for "
        "decode servers.\n"
        "# TYPE fleetctl_emulator_kv_held_blocks gauge\n"
        f"fleetctl_emulator_kv_held_blocks {blocks}\n"
    )


async def _load_lora(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    assert state.adapters is not None
    c = state.config
    assert c.lora is not None
    engine = state.run().engine
    # vLLM reads a runtime-loaded adapter from disk into its CPU cache; the first step that
    # batches it copies it into a GPU slot (the engine's load).
    seconds = c.lora.load_s
    if seconds is None:
        assert engine.lora is not None
        seconds = engine.lora.disk_s(c.lora.max_rank)
    body = await _read_body(request)
    text = await state.adapters.load(body, c.served_names, c.time_scale, seconds)
    engine.add_lora(body["lora_name"], c.lora.max_rank)
    return web.Response(text=text)


async def _unload_lora(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    assert state.adapters is not None
    body = await _read_body(request)
    text = state.adapters.unload(body)
    state.run().engine.remove_lora(body["lora_name"])
    return web.Response(text=text)


async def _notified(request: web.Request) -> web.StreamResponse:
    """The side channel: a decode server is done with a request's blocks."""
    try:
        rid = (await request.json())["remote_request_id"]
    except (ValueError, KeyError, TypeError):
        raise proto.bad_request("a notification names remote_request_id") from None
    freed = request.app[STATE].held.free(str(rid))
    return _json({"freed": freed})


# --- completions -----------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


@dataclass
class Plan:
    """What one completion request asks for, checked."""

    reply: proto.Reply
    prompts: list[int]
    outputs: list[int]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    named: list[naming.Named] = field(default_factory=list)  # per prompt, for the cache


async def _read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise proto.bad_request(f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise proto.bad_request("the request body must be a JSON object")
    return body


def _plan(
    body: dict[str, Any], c: EmulatorConfig, chat: bool, adapters: Adapters | None = None
) -> Plan:
    model = body.get("model")
    loaded = adapters.loaded if adapters is not None else {}
    adapter = model if isinstance(model, str) and model in loaded else None
    if model is not None and model not in c.served_names and adapter is None:
        # vllm/entrypoints/serve/engine/serving.py, _check_model
        valid = ", ".join(c.served_names)
        raise proto.ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {valid}.",
            "NotFoundError",
            "model",
        )
    prompts = [proto.chat_prompt(body)] if chat else proto.completion_prompts(body)
    outputs = [proto.output_tokens(body, p, c.max_model_len, chat) for p in prompts]
    n = body.get("n") or 1
    if not isinstance(n, int) or n < 1:
        raise proto.bad_request("n must be at least 1.", "n")
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    return Plan(
        proto.Reply(chat, adapter or c.name),  # vLLM answers under the adapter's name
        prompts,
        outputs,
        n,
        bool(body.get("stream")),
        bool(options.get("include_usage")),
        bool(options.get("continuous_usage_stats")),
    )


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    faults = state.config.faults
    state.completion_requests += 1
    if faults.hang_after is not None and state.completion_requests > faults.hang_after:
        state.hung = True
        await _hang_forever()
    body = await _read_body(request)
    plan = _plan(body, state.config, chat, state.adapters)
    plan.named = await _name_prompts(body, plan, state.config, chat)
    if faults.error_rate and state.rng.random() < faults.error_rate:
        raise proto.ApiError(500, "Emulated server error (--error-rate)", "InternalServerError")
    _record_params(state.recorder, plan)
    external, producer = await _kv_transfer(body, plan, state.config)
    queue: asyncio.Queue[Update] = asyncio.Queue()
    driver = state.run()
    model = body.get("model")
    loaded = state.adapters.loaded if state.adapters is not None else {}
    adapter = model if isinstance(model, str) and model in loaded else None
    jobs = [
        driver.submit(
            prompt, out, queue, i * plan.n + j, named.blocks, named.ids, external, adapter
        )
        for i, (prompt, out, named) in enumerate(
            zip(plan.prompts, plan.outputs, plan.named, strict=True)
        )
        for j in range(plan.n)
    ]
    if adapter is not None:
        state.lora_jobs.update((id(job), (adapter, job)) for job in jobs)
    try:
        if plan.stream:
            state.streams += 1
            die = state.streams == faults.die_mid_stream
            response, whole = await _stream(request, plan, jobs, queue, die)
        else:
            answer = _producer_params(request, plan, jobs, state.config) if producer else None
            response, whole = await _respond(request, plan, jobs, queue, answer), True
    finally:
        for job in jobs:
            driver.abort(job)  # no-op for finished ones; a client that left frees its KV
            state.lora_jobs.pop(id(job), None)
    if whole:
        _completed(state)
    return response


async def _kv_transfer(body: dict[str, Any], plan: Plan, c: EmulatorConfig) -> tuple[int, bool]:
    """A disaggregated request's phase, as vLLM's NixlConnector takes it: (prompt tokens whose
    KV arrived from a prefill server, after the modelled transfer; whether this server keeps
    its KV cache for a decode server). Without --kv-transfer-config vLLM ignores the
    parameters, and so does this."""
    params = body.get("kv_transfer_params")
    if c.kv_transfer is None or params is None:
        return 0, False
    try:
        remote = remote_prefill(params)
    except ValueError as e:
        raise proto.bad_request(str(e), "kv_transfer_params") from None
    if remote is None:
        return 0, wants_remote_decode(params)
    try:
        if len(plan.prompts) != 1:
            raise proto.bad_request("kv_transfer_params goes with one prompt", "kv_transfer_params")
        prompt = plan.prompts[0]
        perf = c.perf
        seconds = c.kv_transfer.link.seconds(perf.kv_token_bytes * perf.tp * prompt)
        await asyncio.sleep(seconds / c.time_scale)  # the blocks cross the network
    finally:  # pulled, refused or aborted: the prefill server may free them
        notify_prefill_server(remote)
    return max(0, prompt - 1), False


def _producer_params(
    request: web.Request, plan: Plan, jobs: list[Job], c: EmulatorConfig
) -> dict[str, Any]:
    assert c.kv_transfer is not None
    prompt = plan.prompts[0]
    blocks = -(-prompt // c.block_size)
    rid = request.headers.get("X-Request-Id") or "emulated"
    request.app[STATE].held.hold(f"cmpl-{rid}-0", blocks, c.kv_transfer.lease_s)
    return answer_params(c.kv_transfer, f"cmpl-{rid}-0", blocks, prompt, jobs[0].seq.cached)


async def _name_prompts(
    body: dict[str, Any], plan: Plan, c: EmulatorConfig, chat: bool
) -> list[naming.Named]:
    """Each prompt's blocks for the prefix cache (none when it is off); long token-id
    prompts are hashed off the event loop."""
    if not c.prefix_caching:
        return [naming.Named(None)] * len(plan.prompts)
    items = list(zip(naming.sources(body, chat), plan.prompts, strict=True))
    if naming.id_count(items) >= naming.THREAD_OVER_IDS:
        return await asyncio.to_thread(naming.name_all, items, c.block_size, c.hash_algo)
    return naming.name_all(items, c.block_size, c.hash_algo)


def _record_params(rec: Recorder, plan: Plan) -> None:
    for out in plan.outputs:
        rec.observe("request_params_n", plan.n)
        rec.observe("request_params_max_tokens", out)
        rec.observe("request_max_num_generation_tokens", out)


def _completed(state: State) -> None:
    state.completed += 1
    limit = state.config.faults.crash_after
    if limit is not None and state.completed >= limit:
        log.error("crashing after %d completed requests (--crash-after)", state.completed)
        asyncio.get_running_loop().call_later(CRASH_DELAY_S, os._exit, 1)


def _usage(plan: Plan, completion: int) -> dict[str, Any]:
    return proto.usage(sum(plan.prompts), completion)


async def _respond(
    request: web.Request,
    plan: Plan,
    jobs: list[Job],
    queue: asyncio.Queue[Update],
    kv_transfer_params: dict[str, Any] | None = None,
) -> web.StreamResponse:
    remaining = {job.index: job.seq.output for job in jobs}
    made = {job.index: 0 for job in jobs}
    cut: set[int] = set()  # aborted by a sleep: finished by "abort" with what they had
    while remaining:
        index, n = await queue.get()
        if n == ABORTED:
            cut.add(index)
            del remaining[index]
            continue
        made[index] = n
        if n >= remaining[index]:
            del remaining[index]
    texts = [proto.tokens_text(0, made[job.index]) for job in jobs]
    reasons = ["abort" if job.index in cut else "length" for job in jobs]
    body = plan.reply.full(texts, _usage(plan, sum(made.values())), reasons)
    if kv_transfer_params is not None:  # a prefill server's: where its KV cache waits
        body["kv_transfer_params"] = kv_transfer_params
    response = _json(body)
    await response.prepare(request)  # written here so --crash-after counts it as sent
    await response.write_eof()
    return response


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else proto.dumps(obj)
    return f"data: {data}\n\n".encode()


async def _stream(
    request: web.Request, plan: Plan, jobs: list[Job], queue: asyncio.Queue[Update], die: bool
) -> tuple[web.StreamResponse, bool]:
    """Stream tokens as the engine makes them; False when --die-mid-stream cut it short."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    outputs = {job.index: job.seq.output for job in jobs}
    sent = dict.fromkeys(outputs, 0)
    chunks = 0
    while any(sent[i] < outputs[i] for i in outputs):
        index, n = await queue.get()
        if n == ABORTED:  # the server went to sleep: vLLM ends the choice with "abort"
            await response.write(_sse(plan.reply.chunk(index, "", True, reason="abort")))
            outputs[index] = sent[index]
            continue
        data = b"".join(_token_chunks(plan, index, sent[index], n, outputs[index]))
        chunks += n - sent[index]
        sent[index] = n
        await response.write(data)
        if die and chunks >= min(DIE_AFTER_CHUNKS, sum(outputs.values()) - 1):
            _drop_connection(request)
            return response, False
    tail = _sse("[DONE]")
    if plan.include_usage:
        tail = _sse(plan.reply.usage_chunk(_usage(plan, sum(outputs.values())))) + tail
    await response.write(tail)
    await response.write_eof()
    return response, True


def _token_chunks(plan: Plan, index: int, start: int, stop: int, output: int) -> list[bytes]:
    reply, out = plan.reply, []
    for k in range(start, stop):
        if reply.chat and k == 0:
            out.append(_sse(reply.chunk(index, "", False, role=True)))
        chunk = reply.chunk(index, proto.token_text(k), k == output - 1)
        if plan.continuous_usage:
            chunk["usage"] = proto.usage(plan.prompts[index // plan.n], k + 1, details=False)
        out.append(_sse(chunk))
    return out


def _drop_connection(request: web.Request) -> None:
    """--die-mid-stream: close the socket mid-body, as a crashed server would."""
    if request.transport is not None:
        request.transport.close()


# --- serving ----------------------------------------------------------------------------------


def _describe(c: EmulatorConfig) -> str:
    fits = c.budget.kv_tokens / c.max_model_len
    return (
        f"emulating vLLM {VLLM_VERSION}: {c.model.name} {c.fmt.name} on {c.gpu.name} "
        f"(TP {c.tp}), KV cache {c.budget.kv_tokens:,} tokens ({fits:.2f}x max_model_len "
        f"{c.max_model_len}), time scale {c.time_scale:g}"
    )


async def _serve(config: EmulatorConfig, socks: list[socket.socket]) -> None:
    first, second = asyncio.Event(), asyncio.Event()
    listen.stop_signals(first, second)
    runner = await listen.start(
        make_app(config),
        socks,
        handler_cancellation=True,  # a client that disconnects cancels its request, as in vLLM
        access_log_format=ACCESS_LOG_FORMAT,
    )
    log.info(_describe(config))
    log.info("serving on %s", names.http_url(config.host, config.port))
    try:
        await first.wait()
        log.info("shutting down")
    finally:
        await listen.stop(runner, DRAIN_S, second)


def serve(config: EmulatorConfig) -> None:
    """Serve until SIGTERM or SIGINT (exit status 0), on uvloop when it is installed. The
    port is bound first: one taken is a UserError (exit code 2)."""
    fix = "pick another with --port, or stop the process that holds it"
    socks = listen.bind(config.host, config.port, False, fix)
    _run(_serve(config, socks))


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        uvloop: Any = importlib.import_module("uvloop")
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
