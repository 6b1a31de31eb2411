"""Fuzzing the router's parsers: a request parses or is a ClientError, an answer an UpstreamError.

Fixed seed and budget (FLEETCTL_FUZZ_EXAMPLES examples per test, 300 by default, a few
seconds each on two cores). A longer local run:

    FLEETCTL_FUZZ_EXAMPLES=20000 python -m pytest -q tests/daemon/test_router_fuzz.py
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetctl.daemon.tokens import prompt_text
from fleetctl.daemon.upstream import Response, Upstream, UpstreamError, _Conn
from fleetctl.routing.request import MAX_TOKENS, ClientError, parse_request

EXAMPLES = int(os.environ.get("FLEETCTL_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    derandomize=True,  # the same examples on every run: CI failures reproduce
    database=None,
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
MODELS = {"llama-3-8b": frozenset({"bf16", "gptq-int4"}), "qwen": frozenset({"fp8"})}
KNOWN = frozenset({"awq-int4", "bf16", "fp16", "fp8", "gptq-int4", "int8"})
CLASSES = 10


def mutate(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """Apply (position, bytes to delete, bytes to insert) edits: flips, cuts and splices."""
    out = bytearray(data)
    for pos, cut, insert in edits:
        at = pos % (len(out) + 1)
        out[at : at + cut] = insert
    return bytes(out)


EDITS = st.lists(
    st.tuples(st.integers(0, 10_000), st.integers(0, 8), st.binary(max_size=8)), max_size=4
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
HINTS = st.one_of(
    st.sampled_from(["0", "9", "10", "-1", "1e20", "1.5", "true", " 3 ", "٣", "+1", "1_0", ""]),
    st.text(max_size=12),
)
PRECISIONS = st.one_of(
    st.sampled_from(
        ["int4", "int4;strict", "bf16;prefer", "banana", "FP8", "fp8-;x", ";strict", "16bit"]
    ),
    st.text(max_size=16),
)
FIELDS = {  # each drawn valid about as often as not, so deeper checks are reached
    "priority": st.integers(0, CLASSES - 1),
    "max_tokens": st.integers(1, 100),
    "max_completion_tokens": st.integers(1, 100),
    "user": st.text(max_size=8),
    "stream": st.booleans(),
}
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system"]),
            "content": st.one_of(
                st.text(max_size=20),
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": JSON}), max_size=2
                ),
                JSON,
            ),
        }
    ),
    max_size=3,
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str], bool]:
    chat = draw(st.booleans())
    body: dict[str, object] = {}
    # Mostly well-formed where a check would stop the rest: what follows gets checked too.
    if draw(st.integers(0, 9)) < 8:
        body["model"] = draw(st.sampled_from(sorted(MODELS)))
    elif draw(st.booleans()):
        body["model"] = draw(st.sampled_from(["nope", ""]) | JSON)
    if chat:
        body["messages"] = draw(MESSAGES | JSON)
    else:
        body["prompt"] = draw(
            st.text(max_size=30) | st.lists(st.integers(0, 99) | st.text(max_size=5)) | JSON
        )
    for key, valid in FIELDS.items():
        if draw(st.booleans()):
            body[key] = draw(valid | JSON)
    raw = json.dumps(body, allow_nan=True).encode()
    how = draw(st.integers(0, 9))
    if how == 8:
        raw = mutate(raw, draw(EDITS))
    elif how == 9:
        raw = draw(st.binary(max_size=64))
    headers = {}
    for name, values in (
        ("X-Priority", HINTS),
        ("X-Fleet-Precision", PRECISIONS),
        ("X-Session-ID", st.text(max_size=8)),
    ):
        if draw(st.booleans()):
            headers[name] = draw(values)
    return raw, headers, chat


@FUZZ
@given(requests())
def test_request_parsing_ends_in_a_request_or_a_client_error(case):
    raw, headers, chat = case
    try:
        p = parse_request(raw, headers, chat, MODELS, KNOWN, CLASSES)
    except ClientError as e:
        assert e.status in (400, 404) and e.message and "\n" not in e.message
        return
    assert p.model in MODELS
    assert type(p.priority) is int and 0 <= p.priority < CLASSES
    assert p.max_tokens is None or 1 <= p.max_tokens <= MAX_TOKENS
    assert p.precision is None or re.fullmatch(r"[a-z0-9][a-z0-9-]*", p.precision)
    assert p.session is None or isinstance(p.session, str)
    text, ids = prompt_text(p.body, chat)
    assert isinstance(text, str) and type(ids) is int


# --- the backend's answer ------------------------------------------------------------------


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """HTTP/1.x answers built from their grammar, some of it wrong, then mutated."""
    status = draw(
        st.sampled_from(
            [
                b"HTTP/1.1 200 OK",
                b"HTTP/1.0 404 Nope",
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK",
                b"HTTP/1.1 204",
                b"HTTP/1.1 \xb2\xb20 X",
                b"HTTP/2 200",
                b"HTTP/1.1 999 X",
            ]
        )
    )
    body = draw(st.binary(max_size=40))
    framing = draw(st.sampled_from(["length", "chunked", "close", "both", "twice"]))
    headers = [b"Content-Type: application/json"]
    if framing in ("length", "both", "twice"):
        n = draw(
            st.sampled_from(
                [str(len(body)).encode(), b"-1", b"\xb2", b"1e3", b"9" * 30, b" 3 ", b"0x10"]
            )
        )
        headers.append(b"Content-Length: " + n)
        if framing == "twice":
            headers.append(b"Content-Length: %d" % draw(st.integers(0, 50)))
    if framing in ("chunked", "both"):
        headers.append(
            b"Transfer-Encoding: "
            + draw(st.sampled_from([b"chunked", b"gzip, chunked", b"chunked, gzip", b"xchunked"]))
        )
        sizes = draw(
            st.lists(
                st.sampled_from(
                    [b"%x" % len(body), b"-2", b"0x3", b"zz", b"f" * 20, b"3;ext=1", b" 3"]
                ),
                min_size=1,
                max_size=3,
            )
        )
        body = (
            b"".join(s + b"\r\n" + body + b"\r\n" for s in sizes)
            + b"0\r\n"
            + draw(st.sampled_from([b"", b"T: 1\r\n"]))
            + b"\r\n"
        )
    if framing == "close":
        headers.append(b"Connection: close")
    headers += draw(
        st.lists(
            st.sampled_from(
                [
                    b"X-A: b",
                    b"X-Evil: a\nb",
                    b"Bad Name: x",
                    b"NoColon",
                    b" folded",
                    b"X-Nul: \x00",
                    b"X-Latin: \xe9",
                ]
            ),
            max_size=3,
        )
    )
    data = status + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + body
    return mutate(data, draw(EDITS)) if draw(st.booleans()) else data


async def read_answer(pieces: list[bytes], reset: bool) -> Response:
    """Feed `pieces` to a connection as if they arrived one by one, then end it; return the
    answer with its body read, or raise what the parser raised."""
    up = Upstream(1, 1)
    conn = _Conn(collections.deque())

    async def feed() -> None:
        for p in pieces:
            await asyncio.sleep(0)
            conn.data_received(p)
        await asyncio.sleep(0)
        conn.connection_lost(ConnectionResetError() if reset else None)

    feeder = asyncio.ensure_future(feed())
    try:
        resp = await up._head(conn)
        resp.body = await resp.read()  # type: ignore[attr-defined]
        return resp
    finally:
        await feeder


@FUZZ
@given(answers() | st.binary(max_size=200), st.lists(st.integers(1, 64), max_size=6), st.booleans())
def test_answer_parsing_ends_in_an_answer_or_an_upstream_error(data, cuts, reset):
    pieces, at = [], 0
    for n in cuts:
        pieces.append(data[at : at + n])
        at += n
    pieces.append(data[at:])
    try:
        resp = asyncio.run(read_answer(pieces, reset))
    except UpstreamError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert 200 <= resp.status <= 599
    for name, value in resp.headers.items():
        assert re.fullmatch(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", name)
        assert not re.search(r"[\x00-\x08\x0a-\x1f\x7f]", value)
    assert isinstance(resp.body, bytes)  # type: ignore[attr-defined]
