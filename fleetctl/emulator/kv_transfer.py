"""The emulator's side of disaggregated serving, byte-compatible with vLLM 0.32 and its
NixlConnector: `--kv-transfer-config`, the `kv_transfer_params` a prefill server answers
with, and the decode server's wait for the KV cache to cross the network it is told about.

No KV moves (the emulator holds none): a decode server that receives a prefill server's
parameters waits the modelled transfer time (the prompt's KV bytes at the link's speed,
planner/disaggregate.Link), then starts with every prompt token but the last computed, as
vLLM's does after pulling the blocks; like vLLM 0.32 it counts the whole prompt as
`external_kv_transfer` and no prompt token as computed.

A prefill server holds the blocks it answered with until a decode server tells it, over its
side channel, that they were pulled, or that the request was refused or aborted (vLLM 0.32's
`_with_kv_transfer_rejection_cleanup` and its scheduler's `request_finished`), or until its
lease ends (`kv_lease_duration`). Here the side channel is the emulator's own HTTP port when
VLLM_NIXL_SIDE_CHANNEL_PORT names it, and the held blocks are counted on /metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fleetctl.base.errors import UserError
from fleetctl.planner.disaggregate import Link

log = logging.getLogger("fleetctl.emulator")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM 0.32's default kv_lease_duration (kv_connector_extra_config), in seconds.
LEASE_S = 30.0
NOTIFY_PATH = "/_nixl/notify"  # the emulated side channel's one message
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
    lease_s: float = LEASE_S


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
    extra = doc.get("kv_connector_extra_config")
    lease = extra.get("kv_lease_duration", LEASE_S) if isinstance(extra, dict) else LEASE_S
    if type(lease) not in (int, float) or not lease > 0:
        raise UserError("--kv-transfer-config kv_lease_duration must be a positive number")
    return KvTransferConfig(
        doc["kv_connector"],
        role,
        link,
        side_host=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        side_port=int(port) if port.isdigit() else 5600,
        lease_s=float(lease),
    )


@dataclass
class HeldBlocks:
    """A prefill server's blocks kept for decode servers: request id -> (blocks, lease end)."""

    held: dict[str, tuple[int, float]] = field(default_factory=dict)

    def hold(self, request_id: str, blocks: int, lease_s: float) -> None:
        self.held[request_id] = (blocks, time.monotonic() + lease_s)

    def free(self, request_id: str) -> bool:
        return self.held.pop(request_id, None) is not None

    def count(self) -> tuple[int, int]:
        """(requests, blocks) still held; those past their lease freed first."""
        now = time.monotonic()
        for rid in [r for r, (_, end) in self.held.items() if end <= now]:
            log.info("KV blocks of %s freed: lease expired", rid)
            del self.held[rid]
        return len(self.held), sum(n for n, _ in self.held.values())


_notes: set[asyncio.Task[None]] = set()  # notifications in flight (a task needs a reference)


def notify_prefill_server(params: dict[str, Any]) -> None:
    """Tell the prefill server the parameters name that its blocks are done with (pulled,
    refused or aborted), in the background, as vLLM's NIXL worker does after a read."""

    async def send() -> None:
        url = f"http://{params['remote_host']}:{params['remote_port']}{NOTIFY_PATH}"
        body = {"remote_request_id": params["remote_request_id"]}
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=body) as resp,
            ):
                await resp.read()
        except (OSError, TimeoutError, aiohttp.ClientError) as e:
            # vLLM logs it too: the blocks are then freed when the lease ends.
            log.warning("could not notify the prefill server at %s: %s", url, e)

    task = asyncio.get_running_loop().create_task(send())
    _notes.add(task)
    task.add_done_callback(_notes.discard)


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
