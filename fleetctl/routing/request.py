"""A client's request as routing reads it: body bytes and headers to fields and hints, or a
ClientError. Pure: no I/O, so it is tested without a server
(tests/routing/test_routing_parse.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from fleetctl.routing.sessions import session_key
from fleetctl.routing.types import PRECISION_FAMILIES, Request, precision_matches

MAX_JSON_DEPTH = 64  # nested arrays and objects in a request body
PRIORITY_CLASSES = 10  # X-Priority 0 (most urgent) to 9
MAX_TOKENS = 2**31 - 1  # a larger max_tokens only inflates the router's reservations
_PRIORITY = re.compile(r"[0-9]{1,9}")  # ASCII digits: int() also takes "٣", "+3" and "1_0"
_HINT = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
# Body fields that steer a vLLM server's KV (or encoder cache) connector: where it pulls a
# cache from (a host and port of the cluster network) or whether it keeps one for another
# server. Only the router sets them (daemon/disagg.py), so a client's are dropped at the
# door, whatever path the request takes. vLLM 0.32 also reads them from `vllm_xargs`, which
# it passes on as the request's extra_args (entrypoints/openai/*/protocol.py).
ROUTER_OWNED = ("kv_transfer_params", "ec_transfer_params")


class ClientError(Exception):
    """An OpenAI-style error answer (4xx/5xx) for the client."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        """The error object the client gets, as OpenAI's API writes it."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True)
class Parsed:
    """What routing needs from a request; `body` is the parsed JSON, forwarded as received."""

    body: dict[str, Any]
    model: str
    max_tokens: int | None
    priority: int
    precision: str | None
    strict: bool
    session: str | None
    # Whether fields only the router may set (ROUTER_OWNED) were dropped from `body`: its
    # bytes are then written again rather than forwarded as received.
    stripped: bool = False

    def request(
        self, prompt_tokens: int, prompt_chars: int, default_output: int, arrival: float
    ) -> Request:
        """The Request routing queues, once the prompt's tokens are counted (the caller's
        job: a tokenizer may run off the event loop); `default_output` stands in for an
        absent max_tokens."""
        return Request(
            0,
            self.model,
            prompt_tokens,
            self.max_tokens or default_output,
            self.priority,
            self.session,
            self.precision,
            self.strict,
            arrival,
            prompt_chars=prompt_chars,
        )


def shown(value: object) -> str:
    """A client's value in an error message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    try:
        # Inline: a 100K-token body (~400 KB) parses in ~0.8 ms here, and json.loads holds
        # the GIL, so a thread would not free the loop anyway.
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError:  # UnicodeDecodeError included
        raise ClientError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ClientError(400, "request body must be a JSON object")
    if _depth_over(body, max_depth):
        raise _too_deep(max_depth)
    return body


def _too_deep(max_depth: int) -> ClientError:
    return ClientError(400, f"request body nests arrays and objects deeper than {max_depth}")


def _depth_over(body: dict[str, Any], limit: int) -> bool:
    """Whether containers nest more than `limit` deep; iterative, so no recursion limit."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_priority(header: str | None, field: object, classes: int = PRIORITY_CLASSES) -> int:
    """X-Priority, else the body's `priority`, else 0: an integer in 0..classes-1."""
    if header is not None:
        ok = _PRIORITY.fullmatch(header.strip()) is not None and int(header) < classes
        value: object = header
    else:
        value = 0 if field is None else field
        # bool is an int to Python, and 1.0 or "1" are not integers to the API.
        ok = type(value) is int and 0 <= value < classes
    if not ok:
        raise ClientError(
            400,
            f"bad priority {shown(value)}: use an integer from 0 (most urgent) to {classes - 1}",
            param="priority",
        )
    return int(value)  # type: ignore[call-overload]


def parse_precision(
    value: str | None, model: str, runs: Collection[str], known: Collection[str] = ()
) -> tuple[str | None, bool]:
    """`X-Fleet-Precision: int4;strict` -> ("int4", True). The hint must name a format, a
    family or a format's stem that the model runs or that the catalog knows (`known`)."""
    if not value:
        return None, False
    hint, _, mode = value.partition(";")
    hint = hint.strip().lower()
    mode = mode.strip().lower()
    formats = ", ".join(sorted(runs))
    if not _HINT.fullmatch(hint):
        raise ClientError(
            400,
            f"bad X-Fleet-Precision {shown(value)}: name a format, e.g. 'int4' or 'bf16;strict'"
            f" ({model} runs {formats})",
            param="precision",
        )
    if mode not in ("", "strict", "prefer"):
        raise ClientError(
            400,
            f"bad X-Fleet-Precision mode {shown(mode)}: use 'strict' or 'prefer'",
            param="precision",
        )
    if hint not in PRECISION_FAMILIES and not any(
        precision_matches(hint, f) for f in (*runs, *known)
    ):
        raise ClientError(
            400,
            f"unknown precision {shown(hint)} in X-Fleet-Precision: {model} runs {formats}",
            param="precision",
        )
    return hint, mode == "strict"


def drop_router_owned(body: dict[str, Any]) -> bool:
    """Drop the fields only the router sets (ROUTER_OWNED), at the top and in `vllm_xargs`;
    whether there were any."""
    found = False
    xargs = body.get("vllm_xargs")
    for doc in (body, xargs) if isinstance(xargs, dict) else (body,):
        for key in ROUTER_OWNED:
            if key in doc:
                del doc[key]
                found = True
    return found


def parse_request(
    raw: bytes,
    headers: Mapping[str, str],
    chat: bool,
    models: Mapping[str, Collection[str]],
    known_formats: Collection[str] = (),
    priority_classes: int = PRIORITY_CLASSES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Parsed:
    """The one place a request's body and hints are checked. `models` maps each served model
    to the formats it runs. Raises ClientError, and nothing else, for any input. Fields only
    the router may set (ROUTER_OWNED) are dropped from the body."""
    body = parse_body(raw, max_depth)
    stripped = drop_router_owned(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ClientError(400, "missing 'model'", param="model")
    runs = models.get(model)
    if runs is None:
        raise ClientError(
            404, f"The model `{shown(model)[1:-1]}` does not exist.", "NotFoundError", "model"
        )
    if chat and not isinstance(body.get("messages"), list):
        raise ClientError(400, "'messages' must be a list", param="messages")
    if not chat and "prompt" not in body:
        raise ClientError(400, "missing 'prompt'", param="prompt")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and not (type(max_tokens) is int and 1 <= max_tokens <= MAX_TOKENS):
        raise ClientError(
            400, f"'max_tokens' must be an integer from 1 to {MAX_TOKENS}", param="max_tokens"
        )
    # The router relays by it (a stream or a whole answer), so it must read it as vLLM does:
    # vLLM takes "false" for false, where bool() takes any non-empty string for true.
    if body.get("stream") is not None and type(body["stream"]) is not bool:
        raise ClientError(400, "'stream' must be true or false", param="stream")
    session = headers.get("X-Session-ID") or body.get("user")
    if session is not None and not isinstance(session, str):
        raise ClientError(400, "'user' must be a string", param="user")
    precision, strict = parse_precision(
        headers.get("X-Fleet-Precision"), model, runs, known_formats
    )
    return Parsed(
        body,
        model,
        max_tokens,
        parse_priority(headers.get("X-Priority"), body.get("priority"), priority_classes),
        precision,
        strict,
        session_key(session) if session else None,  # a digest: bounded whatever its length
        stripped,
    )
