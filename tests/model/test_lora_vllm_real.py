"""A real vLLM (the CPU build) serving tiny-llama with tiny random LoRA adapters: the KV cache
it reports with and without --enable-lora against the performance model's figure, and each
adapter answering by its name."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from fleetctl.fleet.inventory import LORA_RANKS
from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import cpu_kv_tokens, lora_slot_bytes
from harness.vllm_server import (
    MODEL_SUBDIR,
    ensure_env,
    log_tail,
    server_env,
    start_vllm,
    stop,
    tiny_profile,
    wait_healthy,
)
from tests.conftest import TESTS
from tests.vllm.test_vllm_real import STARTUP_TIMEOUT_S, _free_port

pytestmark = pytest.mark.vllm_real

BUILDER = TESTS / "vllm_real" / "build_tiny_adapters.py"
MEASURE = TESTS / "vllm_real" / "lora_slot_bytes.py"
KV_SPACE_GIB = 1  # harness.vllm_server's VLLM_CPU_KVCACHE_SPACE
ADAPTERS = ("tiny-support", "tiny-legal", "tiny-sql")
RANK = 8
# "CPU KV cache size: 2,097,152 tokens" (vllm/v1/core/kv_cache_utils.py).
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


def _kv_tokens(env: Path, *args: str) -> tuple[int, list[str]]:
    """Start a server with `args`, read its KV cache size from its log, and the models it
    lists; stopped before returning."""
    proc = start_vllm(env, _free_port(), *args)
    try:
        try:
            wait_healthy(proc.url, STARTUP_TIMEOUT_S, proc)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(str(e), pytrace=False)
        found = KV_LINE.search(proc.log_path.read_text(errors="replace"))
        assert found, log_tail(proc)
        with urllib.request.urlopen(proc.url + "/v1/models", timeout=30) as r:
            listed = [m["id"] for m in json.load(r)["data"]]
        for name in listed:
            body = {"model": name, "prompt": "The fleet", "max_tokens": 4}
            req = urllib.request.Request(
                proc.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                done = json.load(r)
            assert done["model"] == name and done["usage"]["completion_tokens"] == 4, done
        return int(found.group(1).replace(",", "")), listed
    finally:
        stop(proc)


def test_kv_cache_with_and_without_lora_slots_matches_the_model(tmp_path):
    """vLLM's CPU worker takes VLLM_CPU_KVCACHE_SPACE as the KV cache whatever else the
    process holds (vllm/v1/worker/cpu_worker.py), so LoRA's slots leave it as it is there,
    unlike on a GPU (perf.kv_budget); the model's CPU figure must match both servers."""
    env = ensure_env()
    model_dir = env / MODEL_SUBDIR
    out = subprocess.run(
        [str(env / "bin" / "python"), str(BUILDER), str(model_dir), str(tmp_path), str(RANK),
         *ADAPTERS],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert [Path(p).name for p in out] == list(ADAPTERS)
    catalog = load_catalog([tiny_profile(env, tmp_path / "profiles")])
    profile, fmt = catalog.model(MODEL_SUBDIR.name), catalog.format("bf16")
    modelled = cpu_kv_tokens(KV_SPACE_GIB << 30, profile, "auto", fmt)

    plain, listed = _kv_tokens(env)
    assert listed == ["tiny-llama"]
    assert RANK in LORA_RANKS
    lora_args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK)]
    lora_args += ["--max-cpu-loras", "3", "--lora-modules"]
    lora_args += [f"{n}={tmp_path / n}" for n in ADAPTERS]
    with_lora, listed = _kv_tokens(env, *lora_args)
    assert sorted(listed) == sorted(["tiny-llama", *ADAPTERS])
    print(
        f"KV tokens: modelled {modelled}, vLLM {plain} without LoRA, {with_lora} with 2 slots "
        f"of rank {RANK} ({lora_slot_bytes(profile, 2, RANK)} bytes)",
        file=sys.stderr,
    )
    for measured in (plain, with_lora):
        assert abs(modelled - measured) <= 0.05 * measured, (modelled, measured)


def test_lora_slot_bytes_are_what_vllm_allocates():
    """vLLM's own LoRA tensors on tiny-llama (2 slots of rank 8), summed in its process,
    against perf.lora_slot_bytes: the structure the GPU KV budget subtracts."""
    env = ensure_env()
    r = subprocess.run(
        [str(env / "bin" / "python"), str(MEASURE), str(env / MODEL_SUBDIR), "2", str(RANK)],
        env=server_env(env), cwd=env, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    measured = int(r.stdout.split()[-1])
    with_profiles = load_catalog([tiny_profile(env, Path(env / "tmp" / "lora-profiles"))])
    profile = with_profiles.model(MODEL_SUBDIR.name)
    assert lora_slot_bytes(profile, 2, RANK) == measured
