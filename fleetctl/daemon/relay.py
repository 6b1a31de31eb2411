"""Relaying a backend's answer to the client: whole, or streamed chunk by chunk as it comes.

Neither function handles a failure: an upstream error rises to the proxy's one handler
(proxy.py), which knows from `Stream.out` whether anything reached the client yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Protocol

from aiohttp import web

from fleetctl.daemon.transport import Answer
from fleetctl.routing.request import ROUTER_OWNED
from fleetctl.routing.types import Backend

log = logging.getLogger("fleetctl.router")

HOP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "content-encoding",
}


# Set on a request that route-serve cuts at the end of its drain (serve.py): its handler is
# then cancelled, and the request ends as cut rather than as a client that left.
CUT = web.RequestKey("fleetctl_cut", bool)
CUT_MESSAGE = "route-serve stopped before the answer ended (cut at the end of its drain)"
CUT_ERROR = {"message": CUT_MESSAGE, "type": "server_error", "param": None, "code": 503}

# The usage a stream ends with under stream_options.include_usage (or on every event with
# continuous_usage_stats): a key, never text, since JSON escapes the quotes inside a string.
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


# A server's own transfer details (engine id, side channel host and port, block ids) are never
# the client's to read: matched as bytes first, so an answer without them costs one scan
# (every field ROUTER_OWNED names ends so).
_OWNED = b'_transfer_params"'
assert all(f'{k}"'.endswith(_OWNED.decode()) for k in ROUTER_OWNED)
_EVENT = re.compile(rb"^data: (\{.*\})(?=\r?$)", re.MULTILINE)


def owned(data: bytes) -> bool:
    """Whether `data` may hold a field only the router sets (ROUTER_OWNED)."""
    return _OWNED in data


def without_owned(data: bytes, answer: dict[str, Any] | None = None) -> bytes:
    """A JSON answer without the fields only the router sets; as it was when it has none, or
    only nulls (vLLM writes `"kv_transfer_params": null` into every whole answer), or is not
    a JSON object (the caller judges that). `answer`: `data` already parsed."""
    if not owned(data):
        return data
    if answer is None:
        answer = parse_answer(data)
    if answer is None or all(answer.get(k) is None for k in ROUTER_OWNED):
        return data
    return json.dumps({k: v for k, v in answer.items() if k not in ROUTER_OWNED}).encode()


def events_without_owned(chunk: bytes) -> bytes:
    """SSE events without the fields only the router sets. vLLM puts none in a stream's
    events (a prefill is never streamed, and the door drops a client's request for them),
    so this is a second line: a field cut across two reads is not seen."""
    if not owned(chunk):
        return chunk
    return _EVENT.sub(lambda m: b"data: " + without_owned(m.group(1)), chunk)


class BackendFailed(Exception):
    """The backend's answer is not one to pass on (a 5xx, a broken 200): try another."""


class Outcome(Protocol):
    """What a relay reports, once each, about the attempt it relays (proxy.Lease)."""

    def first(self) -> None: ...

    def done(self, answer: dict[str, Any] | None, streamed: int | None = None) -> None: ...

    def cut(self, streamed: int) -> None: ...


def parse_answer(body: bytes) -> dict[str, Any] | None:
    """A 200 answer's JSON object, or None when it is not one (a broken backend). Parsed
    whole: only a parse proves it is JSON, and an answer holds the generated text, not the
    prompt, so it is small (~10 us for a 256-token completion)."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return answer if isinstance(answer, dict) else None


def streamed_tokens(tail: bytes, token_events: int, least: int = 1) -> int:
    """A stream's output tokens: the usage its last two chunks state (the usage event comes
    last, before `data: [DONE]`), else its token events; at least `least` (the proxy
    divides by a whole stream's)."""
    stated = COMPLETION_TOKENS.findall(tail)
    return max(least, int(stated[-1]) if stated else token_events)


def header_value(value: str) -> str:
    """`value` with CR, LF and other control characters escaped: whatever reaches a response
    header (or a log line) cannot split it, even when validation upstream missed one."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in value)


def answer_headers(up: Answer, b: Backend, extra: dict[str, str] | None = None) -> dict[str, str]:
    h = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
    h.update(extra or {})
    # The backend's own headers were checked as they were parsed (upstream.py); these come
    # from inventory, state or a backends file.
    h["X-Fleet-Backend"] = header_value(b.node)
    h["X-Fleet-Class"] = header_value(b.node_class)
    h["X-Fleet-Precision"] = header_value(b.variant)
    return h


async def relay_whole(
    up: Answer, b: Backend, outcome: Outcome, extra: dict[str, str] | None = None
) -> web.Response:
    data = await up.read()
    answer = parse_answer(data) if up.status == 200 else None
    if up.status == 200 and answer is None:
        log.warning("backend %s answered 200 with a body that is not a JSON object", b.name)
        raise BackendFailed("a 200 answer that is not a JSON object")
    outcome.first()
    body = without_owned(data, answer)
    out = web.Response(body=body, status=up.status, headers=answer_headers(up, b, extra))
    outcome.done(answer)
    return out


class Stream:
    """Relays an SSE answer. `out` is set once the client's response has started: from then
    on a failure cannot be retried, only reported in the stream (`end_with_error`)."""

    __slots__ = ("last", "out")

    def __init__(self) -> None:
        self.out: web.StreamResponse | None = None
        self.last = b""  # the last chunk written

    async def relay(
        self,
        request: web.Request,
        up: Answer,
        b: Backend,
        outcome: Outcome,
        extra: dict[str, str] | None = None,
    ) -> web.StreamResponse:
        # Whatever has arrived, at once (b"" at the end): this loop runs once per chunk.
        read = up.read_chunk
        chunk = await read()
        outcome.first()
        out = web.StreamResponse(status=up.status, headers=answer_headers(up, b, extra))
        events = 0
        # Not tokens: a chat stream's opening event (the role alone) and the usage event of
        # stream_options.include_usage (no choices). vLLM sends about one event per token else
        # (serving_completion.py, serving_chat.py), but a busy server folds tokens that came
        # out together into one event: a real vLLM 0.32 chat stream sent 7 tokens in 6 events
        # (tests/data/vllm-0.32.0-cpu-answers). Where the stream states its usage, that wins.
        not_tokens = 1 if request.path.endswith("/chat/completions") else 0
        before = b""
        try:
            await out.prepare(request)
            self.out = out
            write = out.write
            while chunk:
                events += chunk.count(b"data: {")
                not_tokens += chunk.count(b'"choices":[]')
                await write(events_without_owned(chunk))  # as it arrives: no buffering
                before, self.last = self.last, chunk
                chunk = await read()
            await out.write_eof()
        except asyncio.CancelledError:
            if not (request.get(CUT) and out.prepared):
                raise
            # Cut at the drain's end: the client learns why, and the log what it got.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.out = out
            outcome.cut(streamed_tokens(before + self.last, events - not_tokens, least=0))
            await self._end(CUT_ERROR, done=True)
            return out
        outcome.done(None, streamed=streamed_tokens(before + self.last, events - not_tokens))
        return out

    async def end_with_error(self, e: BaseException) -> None:
        """The backend died mid-stream: end the client's stream with an error event."""
        err = {
            "message": f"backend failed mid-stream ({type(e).__name__})",
            "type": "server_error",
            "code": 502,
        }
        await self._end(err)

    async def _end(self, err: dict[str, Any], done: bool = False) -> None:
        """End the client's stream with an error event (and `data: [DONE]`, as vLLM ends a
        stream after its own error event)."""
        assert self.out is not None
        # A blank line first ends an event the backend left half-written.
        sep = b"" if self.last.endswith(b"\n\n") else b"\n\n"
        event = sep + b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
        await self.out.write(event + (b"data: [DONE]\n\n" if done else b""))
        await self.out.write_eof()
