"""The emulator's side of disaggregated serving, byte-compatible with vLLM 0.32 and its
NixlConnector: `--kv-transfer-config`, the `kv_transfer_params` a prefill server answers
with, and the decode server's wait for the KV cache to cross the network it is told about.

No KV moves (the emulator holds none): a decode server that receives a prefill server's
parameters waits the modelled transfer time (the prompt's KV bytes at the link's speed,
planner/disaggregate.Link), then starts with every prompt token but the last computed, as
vLLM's does after pulling the blocks; like vLLM 0.32 it counts the whole prompt as
`external_kv_transfer` and no prompt token as computed.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from fleetctl.base.errors import UserError
from fleetctl.planner.disaggregate import Link

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# What a decode server needs of the prefill server's answer
# (vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py).
REMOTE_KEYS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


@dataclass(frozen=True)
class KvTransferConfig:
    """One server's --kv-transfer-config, its NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_*,
    what it tells decode servers) and the network its KV caches cross."""

    connector: str
    role: str
    link: Link
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    side_host: str = "localhost"
    side_port: int = 5600


def parse_kv_transfer_config(text: str, link: Link) -> KvTransferConfig:
    """`--kv-transfer-config` as vLLM checks it at start-up: a JSON object naming a connector
    and a kv_role."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise UserError(f"--kv-transfer-config is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("kv_connector"), str):
        raise UserError("--kv-transfer-config needs a kv_connector")
    role = doc.get("kv_role")
    if role not in ROLES:
        raise UserError(f"--kv-transfer-config kv_role must be one of {', '.join(ROLES)}")
    port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    return KvTransferConfig(
        doc["kv_connector"],
        role,
        link,
        side_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        side_port=int(port) if port.isdigit() else 5600,
    )


def wants_remote_decode(params: object) -> bool:
    """A prefill request: keep the prompt's KV cache for a decode server to pull."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def remote_prefill(params: object) -> dict[str, Any] | None:
    """A decode request's prefill server parameters; None for a request without them.
    A ValueError names what is missing."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    missing = [k for k in REMOTE_KEYS if params.get(k) is None]
    if missing:
        raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}")
    return params


def answer_params(
    kv: KvTransferConfig, request_id: str, blocks: int, prompt: int, cached: int
) -> dict[str, Any]:
    """What a prefill server answers with: where its KV cache waits
    (NixlPullConnectorScheduler.request_finished, and the scheduler's cached tokens)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(range(blocks)),
        "remote_engine_id": kv.engine_id,
        "remote_request_id": request_id,
        "remote_host": kv.side_host,
        "remote_port": kv.side_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached,
    }
