"""route-serve refuses bad requests at the door: hints, JSON depth, protocol limits."""

from __future__ import annotations

import json

import pytest

from tests.procs import NAME
from tests.test_route_serve import Router
from tests.test_router_hostile import Hostile

RANGE = "from 0 (most urgent) to 9"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("requests")
    servers = [Hostile(), Hostile()]  # each answers every POST well while its kind is None
    backends = [
        {
            "url": f"http://127.0.0.1:{s.port}",
            "node": f"n{i}",
            "gpu_type": "RTX-4090",
            "model": NAME,
        }
        for i, s in enumerate(servers)
    ]
    backends[1]["variant"] = "gptq-int4"
    r = Router(tmp, backends, name="requests")
    try:
        yield r
    finally:
        r.stop()
        for s in servers:
            s.loop.call_soon_threadsafe(s.loop.stop)


def error(router: Router, body: object, headers: dict | None = None) -> tuple[int, str]:
    status, _, answer = router.request("POST", "/v1/completions", body, headers)
    if status == 200:
        return status, ""
    err = json.loads(answer)["error"]
    assert err["code"] == status
    return status, err["message"]


def completion(**fields: object) -> dict:
    return {"model": NAME, "prompt": "hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    "value",
    ["-1", "1e20", "abc", "1.5", "true", "10", "99999999999", "٣".encode(), "+1", "1_0", ""],
)
def test_a_bad_x_priority_is_a_400_that_names_the_range(router, value):
    status, message = error(router, completion(), {"X-Priority": value})
    assert status == 400 and RANGE in message, message


@pytest.mark.parametrize("value", [-1, 1e20, "abc", 1.5, True, 10, "2", [1], {"a": 1}])
def test_a_bad_body_priority_is_a_400_that_names_the_range(router, value):
    status, message = error(router, completion(priority=value))
    assert status == 400 and RANGE in message, message


@pytest.mark.parametrize(
    ("header", "body"), [("0", None), ("9", None), (" 3 ", None), (None, 0), (None, 9)]
)
def test_priorities_within_the_classes_are_served(router, header, body):
    headers = {} if header is None else {"X-Priority": header}
    fields = {} if body is None else {"priority": body}
    assert error(router, completion(**fields), headers) == (200, "")


@pytest.mark.parametrize(
    "hint", ["banana", "banana;strict", "banana;prefer", "int3", "bf16x;strict"]
)
def test_an_unknown_precision_is_a_400_listing_the_models_formats(router, hint):
    status, message = error(router, completion(), {"X-Fleet-Precision": hint})
    assert status == 400, message
    assert "unknown precision" in message and "runs bf16, gptq-int4" in message, message


@pytest.mark.parametrize(
    "hint", ["int4;strict", "gptq-int4", "16bit", "fp8", "FP8;prefer", "bf16;strict"]
)
def test_known_precisions_are_served(router, hint):
    assert error(router, completion(), {"X-Fleet-Precision": hint}) == (200, "")


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_json_nested_too_deep_is_a_400(router, depth):
    raw = b'{"model": "%s", "prompt": "x", "extra": %s%s}' % (
        NAME.encode(),
        b"[" * (depth - 1),
        b"]" * (depth - 1),
    )
    status, message = error(router, raw)
    assert status == 400 and "deeper than 64" in message, message


def test_json_nested_to_the_limit_is_served(router):
    raw = b'{"model": "%s", "prompt": "x", "extra": %s%s}' % (NAME.encode(), b"[" * 63, b"]" * 63)
    assert error(router, raw) == (200, "")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"user": {"id": 1}}, "'user'"),
        ({"user": ["a"]}, "'user'"),
    ],
)
def test_bad_fields_are_400s(router, fields, words):
    status, message = error(router, completion(**fields))
    assert status == 400 and words in message, message
