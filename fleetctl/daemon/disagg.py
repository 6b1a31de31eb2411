"""vLLM's protocol for a request served in two phases (vLLM 0.32, as its toy proxy and
vllm-router speak it): what the prefill server and then the decode server are sent.

The prefill server gets the client's request with `kv_transfer_params` asking it to keep the
KV cache for a remote decode, one token (`max_tokens` and `max_completion_tokens` 1, no
`min_tokens`), not streamed (a stream's chunks carry no `kv_transfer_params`). It answers
with `kv_transfer_params` at the top level of its JSON: where the decode server pulls the KV
cache from (engine, blocks, side channel host and port). The decode server gets the client's
request as it was, with those parameters added, and the same X-Request-Id.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

# What asks a prefill server to keep a prompt's KV cache for a remote decode
# (vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py reads
# do_remote_decode; the rest are filled in by its answer).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Request fields a one-token prefill must not carry: vLLM refuses min_tokens > max_tokens,
# and stream_options without stream.
DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def request_id() -> str:
    """One id for both phases: vLLM names the prefill's blocks by it."""
    return uuid.uuid4().hex


def prefill_body(body: dict[str, Any], model: str) -> bytes:
    """The prefill server's request: one token, not streamed, the KV cache kept for us."""
    out = {k: v for k, v in body.items() if k not in DROPPED}
    out["model"] = model
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return json.dumps(out).encode()


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill server's answer; None where it gave none (the
    decode server then prefills the prompt itself)."""
    try:
        doc = json.loads(answer)
    except (ValueError, UnicodeDecodeError):
        return None
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    return params if isinstance(params, dict) else None


def decode_body(body: dict[str, Any], model: str, params: dict[str, Any] | None) -> bytes:
    """The decode server's request: the client's, with the prefill server's parameters."""
    out = dict(body)
    out["model"] = model
    if params is not None:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return json.dumps(out).encode()
