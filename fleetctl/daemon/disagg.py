"""vLLM's protocol for a request served in two phases (vLLM 0.32, as its toy proxy and
vllm-router speak it): what the prefill server and then the decode server are sent.

The client's own `kv_transfer_params` never reach a server: the door drops them
(routing/request.py), and the relay drops a server's from what the client gets (relay.py).
The prefill server gets the client's request with `kv_transfer_params` asking it to keep the
KV cache for a remote decode, one token (`max_tokens` and `max_completion_tokens` 1, no
`min_tokens`), not streamed (a stream's chunks carry no `kv_transfer_params`). It answers
with `kv_transfer_params` at the top level of its JSON: where the decode server pulls the KV
cache from (engine, blocks, side channel host and port). The decode server gets the client's
request as it was, with those parameters added, and the same X-Request-Id.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
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


# How long a prefill server keeps a prompt's blocks for a decode server that never comes: vLLM
# 0.32's NIXL lease (kv_transfer_config's kv_connector_extra_config.kv_lease_duration, 30 s by
# default; a decode server waiting for the blocks extends it by heartbeats).
KV_LEASE_S = 30.0


def splittable(body: dict[str, Any]) -> bool:
    """Whether vLLM's two phases can serve this body. They carry one prompt's KV cache for
    one sequence: a prefill server answers with the blocks of its first prompt only (vLLM
    0.32's completion serving returns `final_res_batch[0].kv_transfer_params`), so the other
    prompts of a batch, or the other choices of n > 1, would leave blocks held there and
    nothing to decode from. Such a body is served whole by a decode server instead (the answer
    the client expects, a little slower), rather than refused after the prefill ran."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and not _token_ids(prompt)
    return not several and _one(body.get("n")) and _one(body.get("best_of"))


def _token_ids(prompt: list[Any]) -> bool:
    """A prompt given as token ids (one prompt), not a list of prompts."""
    return all(type(t) is int for t in prompt)


def _one(value: object) -> bool:
    return value is None or (type(value) is int and value <= 1)


@dataclass
class Held:
    """Prompts whose KV cache the router left on a prefill server with no decode server known
    to have taken it (each decode attempt failed): the server frees them when its lease ends.
    Counted on /metrics per prefill server, as vLLM's protocol has no way to free them sooner
    once a decode server that received the parameters fails without a word."""

    lease_s: float = KV_LEASE_S
    until: dict[str, list[float]] = field(default_factory=dict)  # backend -> lease ends

    def hold(self, backend: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.until.setdefault(backend, []).append(now + self.lease_s)

    def counts(self, now: float | None = None) -> dict[str, int]:
        """Per prefill server, the prompts it may still hold; expired leases forgotten."""
        now = time.monotonic() if now is None else now
        for name in list(self.until):
            left = [t for t in self.until[name] if t > now]
            if left:
                self.until[name] = left
            else:
                del self.until[name]
        return {name: len(ends) for name, ends in self.until.items()}


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
