"""A stand-in vLLM backend that answers at once, so that a router's own cost shows.

An aiohttp server (one process: `python benchmarks/router_overhead.py backend --port P`)
answering /v1/completions streamed (`max_tokens` SSE chunks `gap_ms` apart, or NN ms apart
when the prompt starts with "GAP=NN:") or as one short JSON answer; also /v1/models,
/health, /metrics (a real vLLM 0.32 page) and the /server_info, /model_info probes
sglang-router makes when it registers a worker.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from .procs import REPO

CAPTURE = REPO / "tests" / "data" / "vllm-0.32.0-cpu-metrics.txt"
DONE = b"data: [DONE]\n\n"


def sse_event(model: str, i: int, last: bool) -> bytes:
    choice = {
        "index": 0,
        "text": f" tok{i}",
        "logprobs": None,
        "finish_reason": "length" if last else None,
    }
    body = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def gap_prefix(gap_ms: float) -> str:
    """A prompt that starts with this makes the stand-in backend pace its chunks so."""
    return f"GAP={gap_ms:g}:"


def run_backend(port: int, default_gap_ms: float, model: str) -> None:
    events = [sse_event(model, i, False) for i in range(4096)]
    metrics_page = CAPTURE.read_text()
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # sglang's gRPC probe

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        n = max(1, min(4096, int(body.get("max_tokens") or 16)))
        prompt = body.get("prompt")
        gap_ms = default_gap_ms
        if isinstance(prompt, str) and prompt.startswith("GAP="):
            gap_ms = float(prompt[4 : prompt.index(":")])
        gap = gap_ms / 1000
        if not body.get("stream"):
            answer = {
                "id": "cmpl-bench",
                "object": "text_completion",
                "created": 0,
                "model": model,
                "choices": [
                    {"index": 0, "text": " ok" * n, "logprobs": None, "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
            }
            return web.json_response(answer)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for i in range(n - 1):
            await resp.write(events[i])
            await asyncio.sleep(gap)
        await resp.write(sse_event(model, n - 1, True) + DONE)
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        item = {"id": model, "object": "model", "created": 0, "owned_by": "bench"}
        return web.json_response({"object": "list", "data": [item]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics_page, content_type="text/plain")

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": model, "served_model_name": model})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, info)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)
