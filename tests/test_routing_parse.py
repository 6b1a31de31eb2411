"""Request parsing is a pure function: body bytes and headers to a Request, or a ClientError
that says what is wrong. No server here."""

from __future__ import annotations

import json

import pytest

from fleetctl.routing.request import ClientError, parse_request
from fleetctl.routing.types import Decision

MODELS = {"llama-3-8b": frozenset({"bf16", "gptq-int4"})}


def parse(body: object, headers: dict[str, str] | None = None, chat: bool = False):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, headers or {}, chat, MODELS, known_formats=("fp8",))


def refused(body: object, headers: dict[str, str] | None = None, chat: bool = False):
    with pytest.raises(ClientError) as e:
        parse(body, headers, chat)
    return e.value


def test_a_completion_becomes_a_request_with_its_hints():
    p = parse(
        {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 7, "user": "u1"},
        {"X-Priority": "3", "X-Fleet-Precision": "int4;strict"},
    )
    req = p.request(prompt_tokens=12, prompt_chars=2, default_output=256, arrival=5.0)
    assert (req.model, req.prompt_tokens, req.output_tokens, req.priority) == (
        "llama-3-8b",
        12,
        7,
        3,
    )
    assert (req.session, req.precision, req.strict, req.arrival) == ("u1", "int4", True, 5.0)
    assert req.prompt_chars == 2 and req.exclude == frozenset()


def test_without_max_tokens_the_expected_output_stands_in():
    p = parse({"model": "llama-3-8b", "messages": []}, chat=True)
    assert p.max_tokens is None
    assert p.request(1, 0, default_output=99, arrival=0.0).output_tokens == 99


def test_the_session_header_wins_over_the_body_user():
    p = parse({"model": "llama-3-8b", "prompt": "x", "user": "body"}, {"X-Session-ID": "hdr"})
    assert p.session == "hdr"


@pytest.mark.parametrize(
    ("body", "headers", "status", "param", "words"),
    [
        (b"{not json", None, 400, None, "not valid JSON"),
        (b"[1, 2]", None, 400, None, "JSON object"),
        ({"prompt": "x"}, None, 400, "model", "missing 'model'"),
        ({"model": "gpt-9", "prompt": "x"}, None, 404, "model", "does not exist"),
        ({"model": "llama-3-8b"}, None, 400, "prompt", "missing 'prompt'"),
        ({"model": "llama-3-8b", "prompt": "x", "max_tokens": 0}, None, 400, "max_tokens", "1 to"),
        ({"model": "llama-3-8b", "prompt": "x", "user": 5}, None, 400, "user", "'user'"),
        ({"model": "llama-3-8b", "prompt": "x"}, {"X-Priority": "10"}, 400, "priority", "0 (most"),
        (
            {"model": "llama-3-8b", "prompt": "x"},
            {"X-Fleet-Precision": "banana"},
            400,
            "precision",
            "runs bf16, gptq-int4",
        ),
    ],
)
def test_a_bad_request_is_a_typed_rejection(body, headers, status, param, words):
    e = refused(body, headers)
    assert (e.status, e.param) == (status, param) and words in e.message, e.message
    assert e.body()["error"] == {
        "message": e.message,
        "type": e.kind,
        "param": param,
        "code": status,
    }


def test_chat_needs_a_list_of_messages():
    assert refused({"model": "llama-3-8b", "messages": "hi"}, chat=True).param == "messages"


def test_nesting_past_the_limit_is_refused_without_recursion():
    raw = b'{"model": "llama-3-8b", "prompt": "x", "e": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "deeper than 64" in refused(raw).message


def test_a_catalog_format_the_model_does_not_run_is_a_known_hint():
    assert (
        parse({"model": "llama-3-8b", "prompt": "x"}, {"X-Fleet-Precision": "fp8"}).precision
        == "fp8"
    )


def test_a_decision_renders_its_reason_from_fields():
    d = Decision(None, "hardware-aware", ("affinity:class", "length:short"), ttft_s=0.1234)
    assert d.label == "hardware-aware affinity:class length:short"
    assert d.reason == "hardware-aware affinity:class length:short ttft~0.123s"
    assert Decision(None, "least-outstanding", detail="(3)").label == "least-outstanding"
    r = Decision.rejected("no healthy backend serves x")
    assert r.reject and r.backend is None and r.reason == "no healthy backend serves x"
