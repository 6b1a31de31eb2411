"""Request parsing is a pure function: body bytes and headers to a Request, or a ClientError
that says what is wrong. No server here."""

from __future__ import annotations

import json

import pytest

from fleetctl.routing.request import (
    ClientError,
    parse_body,
    parse_precision,
    parse_priority,
    parse_request,
    shown,
)
from fleetctl.routing.sessions import session_key
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
    assert (req.session, req.precision, req.strict, req.arrival) == (
        session_key("u1"),
        "int4",
        True,
        5.0,
    )
    assert req.prompt_chars == 2 and req.exclude == frozenset()


def test_without_max_tokens_the_expected_output_stands_in():
    p = parse({"model": "llama-3-8b", "messages": []}, chat=True)
    assert p.max_tokens is None
    assert p.request(1, 0, default_output=99, arrival=0.0).output_tokens == 99


def test_the_fields_only_the_router_sets_are_dropped_at_the_door():
    evil = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 4444}
    body = {"model": "llama-3-8b", "prompt": "x", "kv_transfer_params": evil}
    body |= {"ec_transfer_params": evil, "vllm_xargs": {"kv_transfer_params": "x", "k": 1}}
    p = parse(body)
    assert p.stripped
    assert p.body == {"model": "llama-3-8b", "prompt": "x", "vllm_xargs": {"k": 1}}
    for one in ({"kv_transfer_params": None}, {"vllm_xargs": {"ec_transfer_params": 1}}):
        assert parse({"model": "llama-3-8b", "prompt": "x", **one}).stripped
    # Nothing of theirs: the body as received, forwarded byte for byte.
    plain = parse({"model": "llama-3-8b", "prompt": "x", "vllm_xargs": ["kv_transfer_params"]})
    assert not plain.stripped and plain.body["vllm_xargs"] == ["kv_transfer_params"]


def test_the_session_header_wins_over_the_body_user():
    p = parse({"model": "llama-3-8b", "prompt": "x", "user": "body"}, {"X-Session-ID": "hdr"})
    assert p.session == session_key("hdr")


def test_a_session_is_kept_as_a_fixed_size_digest_whatever_its_length():
    short = parse({"model": "llama-3-8b", "prompt": "x", "user": "a"}).session
    long = parse({"model": "llama-3-8b", "prompt": "x", "user": "a" * 2**20}).session
    surrogate = parse(b'{"model": "llama-3-8b", "prompt": "x", "user": "\\ud800"}').session
    assert short and long and surrogate
    assert len(short) == len(long) == len(surrogate) == 32 and short != long


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
        # vLLM reads "false" (and "0", "no", "off") as false, Python's bool() as true: the
        # router relayed a whole answer as a stream, past the whole answer's checks.
        ({"model": "llama-3-8b", "prompt": "x", "stream": "false"}, None, 400, "stream", "true or"),
        ({"model": "llama-3-8b", "prompt": "x", "stream": 1}, None, 400, "stream", "true or"),
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


# --- Boundaries and exact texts (each test below kills mutants of request.py) ---


def nested(levels: int) -> bytes:
    """A request whose containers nest `levels` deep: the body object is level 1, and each
    of the `levels - 1` containers under "e" (arrays and objects in turn: both count) one more."""
    inner = "0"
    for i in range(levels - 1):
        inner = f"[{inner}]" if i % 2 == 0 else f'{{"k": {inner}}}'
    return f'{{"model": "llama-3-8b", "prompt": "x", "e": {inner}}}'.encode()


def test_nesting_exactly_at_the_limit_passes_and_one_more_level_is_refused():
    # MAX_JSON_DEPTH is 64: 64 levels are allowed, 65 are not.
    assert parse(nested(64)).model == "llama-3-8b"
    e = refused(nested(65))
    assert (e.status, e.message) == (400, "request body nests arrays and objects deeper than 64")


def test_a_lower_depth_limit_is_the_one_applied_and_named():
    assert parse_body(b'{"a": [[1]]}', max_depth=3) == {"a": [[1]]}  # object, list, list: 3
    with pytest.raises(ClientError) as e:
        parse_body(b'{"a": [[{}]]}', max_depth=3)  # object, list, list, object: 4
    assert e.value.message == "request body nests arrays and objects deeper than 3"
    # Through parse_request too: its max_depth reaches the check.
    with pytest.raises(ClientError):
        parse_request(nested(3), {}, False, MODELS, max_depth=2)


def test_body_errors_say_what_is_wrong():
    for raw, message in [
        (b"{not json", "request body is not valid JSON"),
        (b'{"model": "\xff"}', "request body is not valid JSON"),  # not UTF-8
        (b'"a string"', "request body must be a JSON object"),
    ]:
        e = refused(raw)
        assert (e.status, e.message, e.kind, e.param) == (
            400,
            message,
            "invalid_request_error",
            None,
        )


def test_priority_from_header_or_body_bounded_by_the_classes():
    body = {"model": "llama-3-8b", "prompt": "x"}
    assert parse(body).priority == 0  # neither given: the top class
    assert parse(body, {"X-Priority": "9"}).priority == 9  # classes 0..9
    assert parse(body, {"X-Priority": " 0 "}).priority == 0  # surrounding blanks tolerated
    assert parse({**body, "priority": 9}).priority == 9
    assert parse({**body, "priority": 0}).priority == 0
    # The header wins over the body's field, even when the field is out of range.
    assert parse({**body, "priority": 42}, {"X-Priority": "2"}).priority == 2
    assert parse_priority(None, 2, classes=3) == 2


@pytest.mark.parametrize("header", ["10", "-1", "+3", "1_0", "\u0663", "", "3.0", "1234567890"])
def test_a_header_priority_that_is_not_plain_digits_in_range_is_refused(header):
    e = refused({"model": "llama-3-8b", "prompt": "x"}, {"X-Priority": header})
    assert (e.status, e.param) == (400, "priority")
    assert e.message == f"bad priority {header!r}: use an integer from 0 (most urgent) to 9"


@pytest.mark.parametrize("field", [10, -1, True, 1.0, "1", [1]])
def test_a_body_priority_that_is_not_an_int_in_range_is_refused(field):
    e = refused({"model": "llama-3-8b", "prompt": "x", "priority": field})
    assert e.message == f"bad priority {field!r}: use an integer from 0 (most urgent) to 9"


def test_the_priority_classes_set_the_bound_and_the_message():
    with pytest.raises(ClientError) as e:
        parse_priority("3", None, classes=3)
    assert e.value.message == "bad priority '3': use an integer from 0 (most urgent) to 2"
    with pytest.raises(ClientError):
        parse_priority(None, 3, classes=3)
    # Through parse_request: its priority_classes reaches the check.
    with pytest.raises(ClientError):
        parse_request(
            b'{"model": "llama-3-8b", "prompt": "x", "priority": 4}',
            {},
            False,
            MODELS,
            priority_classes=4,
        )


def test_shown_keeps_40_characters_and_cuts_longer_values():
    # repr("x" * 38) is 40 characters with its quotes: kept whole.
    assert shown("x" * 38) == "'" + "x" * 38 + "'"
    # 41 characters: the first 37 and "...", 40 in all.
    assert shown("x" * 39) == "'" + "x" * 36 + "..."
    assert shown(5) == "5"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (None, False)),
        ("", (None, False)),
        ("int4", ("int4", False)),
        ("INT4 ; Strict", ("int4", True)),
        ("bf16;prefer", ("bf16", False)),
        ("gptq-int4;strict", ("gptq-int4", True)),  # a format the model runs
        ("16bit", ("16bit", False)),  # a family
        ("int8", ("int8", False)),  # a family the model does not run, still a known name
        ("gptq", ("gptq", False)),  # the stem of gptq-int4
        ("fp8-per-channel", ("fp8-per-channel", False)),  # stem fp8 of a catalog format
    ],
)
def test_precision_hints_name_a_format_family_or_stem(value, expected):
    runs = ("bf16", "gptq-int4")
    known = ("fp8-per-channel",) if value == "fp8-per-channel" else ("fp8",)
    assert parse_precision(value, "llama-3-8b", runs, known) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "-int4",  # must start with a letter or digit
            "bad X-Fleet-Precision '-int4': name a format, e.g. 'int4' or 'bf16;strict'"
            " (llama-3-8b runs bf16, gptq-int4)",
        ),
        (
            "a" * 33,  # 32 characters at most
            f"bad X-Fleet-Precision {shown('a' * 33)}: name a format, e.g. 'int4' or"
            " 'bf16;strict' (llama-3-8b runs bf16, gptq-int4)",
        ),
        ("int4;loose", "bad X-Fleet-Precision mode 'loose': use 'strict' or 'prefer'"),
        ("awq", "unknown precision 'awq' in X-Fleet-Precision: llama-3-8b runs bf16, gptq-int4"),
        (
            "a" * 32,  # the longest well-formed hint, naming nothing
            f"unknown precision {shown('a' * 32)} in X-Fleet-Precision:"
            " llama-3-8b runs bf16, gptq-int4",
        ),
    ],
)
def test_a_bad_precision_hint_is_refused_with_the_formats_the_model_runs(value, message):
    e = refused({"model": "llama-3-8b", "prompt": "x"}, {"X-Fleet-Precision": value})
    assert (e.status, e.param, e.message) == (400, "precision", message)


@pytest.mark.parametrize("model", ["", 5, None, ["llama-3-8b"]])
def test_a_model_that_is_not_a_nonempty_string_is_missing(model):
    e = refused({"model": model, "prompt": "x"})
    assert (e.status, e.param, e.message) == (400, "model", "missing 'model'")


def test_an_unknown_model_is_a_404_in_openais_words():
    e = refused({"model": "gpt-9", "prompt": "x"})
    assert (e.status, e.kind, e.param) == (404, "NotFoundError", "model")
    assert e.message == "The model `gpt-9` does not exist."
    assert e.body() == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_chat_and_completions_each_need_their_own_input():
    assert parse({"model": "llama-3-8b", "messages": []}, chat=True).model == "llama-3-8b"
    # A completion needs no messages, a chat needs no prompt.
    assert parse({"model": "llama-3-8b", "prompt": ""}).model == "llama-3-8b"
    e = refused({"model": "llama-3-8b", "prompt": "x"}, chat=True)
    assert (e.status, e.param, e.message) == (400, "messages", "'messages' must be a list")
    e = refused({"model": "llama-3-8b", "messages": []})
    assert (e.status, e.param, e.message) == (400, "prompt", "missing 'prompt'")


def test_max_tokens_bounds_and_max_completion_tokens_first():
    body = {"model": "llama-3-8b", "prompt": "x"}
    assert parse({**body, "max_tokens": 1}).max_tokens == 1
    assert parse({**body, "max_tokens": 2**31 - 1}).max_tokens == 2**31 - 1
    # vLLM reads `max_completion_tokens or max_tokens` (serving_engine.py), so does the router.
    assert parse({**body, "max_completion_tokens": 5, "max_tokens": 9}).max_tokens == 5
    assert parse({**body, "max_completion_tokens": 5}).max_tokens == 5
    for bad in (2**31, 0, -1, True, 5.0, "5"):
        e = refused({**body, "max_tokens": bad})
        assert (e.status, e.param, e.message) == (
            400,
            "max_tokens",
            "'max_tokens' must be an integer from 1 to 2147483647",
        ), bad
    assert refused({**body, "max_completion_tokens": 2**31}).param == "max_tokens"


def test_session_from_header_else_body_user_and_empty_is_none():
    body = {"model": "llama-3-8b", "prompt": "x"}
    assert parse(body).session is None
    assert parse({**body, "user": "u"}).session == session_key("u")
    assert parse({**body, "user": "u"}, {"X-Session-ID": ""}).session == session_key("u")
    assert parse({**body, "user": ""}).session is None
    e = refused({**body, "user": ["u"]})
    assert (e.status, e.param, e.message) == (400, "user", "'user' must be a string")


def test_parsed_keeps_the_body_as_received_and_a_request_has_id_zero():
    body = {"model": "llama-3-8b", "prompt": "x", "extra": {"k": [1]}}
    p = parse(body, {"X-Fleet-Precision": "bf16"})
    assert p.body == body and (p.precision, p.strict) == ("bf16", False)
    assert p.request(3, 1, default_output=10, arrival=0.0).id == 0
