"""`fleetctl emulate`'s sleep mode over real HTTP: vLLM 0.32's dev endpoints, requests parked
while asleep, wakes that cost the class's modelled seconds, and a GPU's memory shared through
a ledger (fleetctl/emulator/sleep.py)."""

from __future__ import annotations

import json
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import weights_bytes
from fleetctl.model.startup import wake_seconds
from tests.procs import NAME, Emulator

DEV = {"VLLM_SERVER_DEV_MODE": "1"}


def _families(emu: Emulator) -> dict:
    status, body = emu.request("GET", "/metrics")
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def _value(families: dict, name: str, **labels: str) -> float:
    for s in families[name].samples:
        if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith("_created"):
            return s.value
    raise AssertionError(f"no sample {name} {labels}")


def _hist(families: dict, name: str, **labels: str) -> tuple[float, float]:
    fam = families[name]
    pick = [s for s in fam.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    total = next(s.value for s in pick if s.name == f"{name}_sum")
    count = next(s.value for s in pick if s.name == f"{name}_count")
    return total, count


def _post(emu: Emulator, path: str) -> tuple[int, dict]:
    status, body = emu.request("POST", path)
    return status, json.loads(body)


def _sleeping(emu: Emulator) -> bool:
    status, body = emu.request("GET", "/is_sleeping")
    assert status == 200, body
    return bool(json.loads(body)["is_sleeping"])


def _complete(emu: Emulator, max_tokens: int = 4, stream: bool = False) -> tuple[int, bytes]:
    body = {"model": NAME, "prompt": "hello " * 200, "max_tokens": max_tokens, "stream": stream}
    return emu.request("POST", "/v1/completions", body, timeout=60)


@pytest.fixture
def sleepy(tmp_path):
    started: list[Emulator] = []

    def make(*args: str, env: dict[str, str] | None = DEV, gpu: str = "RTX-4090") -> Emulator:
        emu = Emulator(tmp_path, "--enable-sleep-mode", *args, gpu=gpu, env=env)
        started.append(emu)
        emu.wait_healthy()
        return emu

    yield make
    for emu in started:
        emu.stop()


def test_the_endpoints_exist_only_in_dev_mode(sleepy):
    """vLLM registers /sleep, /wake_up and /is_sleeping with VLLM_SERVER_DEV_MODE=1 only."""
    emu = sleepy(env=None)
    for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        status, _ = emu.request(method, path)
        assert status == 404, path
    assert _complete(emu)[0] == 200


def test_a_request_sent_asleep_waits_for_the_wake_and_pays_for_it(sleepy):
    """Asleep, a request is parked, not refused; the wake lasts the class's modelled seconds
    (level 1: the weights back over PCIe), and the request's first token counts them."""
    emu = sleepy()
    assert not _sleeping(emu)
    assert _post(emu, "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
    assert _sleeping(emu)
    fam = _families(emu)
    assert _value(fam, "vllm:engine_sleep_state", sleep_state="awake") == 0
    assert _value(fam, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1

    answers: list[tuple[int, bytes]] = []
    parked = threading.Thread(target=lambda: answers.append(_complete(emu)))
    parked.start()
    parked.join(timeout=1.0)
    assert parked.is_alive() and not answers, "a request was served while asleep"

    assert _post(emu, "/wake_up") == (200, {"status": "awake", "tags": None})
    parked.join(timeout=30)
    assert answers and answers[0][0] == 200, answers
    assert not _sleeping(emu)

    catalog = load_catalog()
    fmt = catalog.format("bf16")
    model = catalog.model("llama-3-8b")
    expected = wake_seconds(catalog.gpu("RTX-4090"), weights_bytes(model, fmt), 1, 1)
    fam = _families(emu)
    wake_sum, wakes = _hist(fam, "vllm:sleep_mode_operation_duration_seconds", operation="wake")
    assert wakes == 1 and wake_sum >= expected
    ttft_sum, ttfts = _hist(fam, "vllm:time_to_first_token_seconds")
    assert ttfts == 1 and ttft_sum >= expected
    assert _value(fam, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_a_level_two_wake_costs_more_than_a_level_one(sleepy):
    emu = sleepy()
    seconds = []
    for level in (1, 2):
        assert _post(emu, f"/sleep?level={level}")[0] == 200
        before = (
            _hist(_families(emu), "vllm:sleep_mode_operation_duration_seconds", operation="wake")
            if level == 2
            else (0.0, 0.0)
        )
        assert _post(emu, "/wake_up")[0] == 200
        after = _hist(
            _families(emu), "vllm:sleep_mode_operation_duration_seconds", operation="wake"
        )
        seconds.append(after[0] - before[0])
    assert seconds[1] > 2 * seconds[0]


def test_a_request_in_flight_ends_with_abort(sleepy):
    """vLLM's default pause mode aborts what runs: the stream ends with finish_reason abort."""
    emu = sleepy("--time-scale", "1")
    answers: list[tuple[int, bytes]] = []
    t = threading.Thread(target=lambda: answers.append(_complete(emu, 2000, stream=True)))
    t.start()
    # Sleep once the request runs (it is on the engine's running gauge).
    for _ in range(600):
        if _value(_families(emu), "vllm:num_requests_running") >= 1:
            break
        t.join(timeout=0.05)
    assert _post(emu, "/sleep?level=1")[0] == 200
    t.join(timeout=30)
    assert answers, "the stream did not end"
    status, body = answers[0]
    assert status == 200
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert _value(_families(emu), "vllm:request_success", finished_reason="abort") == 1


def test_sleeping_needs_sleep_mode_enabled(tmp_path):
    """Without --enable-sleep-mode a level 1 or 2 sleep fails; level 0 (a pause) works."""
    emu = Emulator(tmp_path, env=DEV)
    try:
        emu.wait_healthy()
        status, body = _post(emu, "/sleep?level=1")
        assert status == 500 and "--enable-sleep-mode" in body["error"]["message"]
        assert _post(emu, "/sleep?level=0")[0] == 200
        assert _post(emu, "/wake_up")[0] == 200
        assert _complete(emu)[0] == 200
    finally:
        emu.stop()


def test_a_wake_that_does_not_fit_beside_another_server_fails_out_of_memory(sleepy, tmp_path):
    """Two servers on one GPU (one ledger folder), each wanting 55% of it: the second cannot
    wake while the first is awake, and stays asleep; once the first sleeps, it can."""
    ledger = str(tmp_path / "gpu0")
    one = sleepy("--gpu-ledger", ledger, "--gpu-memory-utilization", "0.55", gpu="A100-SXM4-80GB")
    assert _post(one, "/sleep?level=1")[0] == 200
    two = sleepy("--gpu-ledger", ledger, "--gpu-memory-utilization", "0.55", gpu="A100-SXM4-80GB")
    status, body = _post(one, "/wake_up")
    assert status == 500 and "out of memory" in body["error"]["message"]
    assert _sleeping(one)
    assert _post(two, "/sleep?level=1")[0] == 200
    assert _post(one, "/wake_up") == (200, {"status": "awake", "tags": None})
    assert _complete(one)[0] == 200


def test_a_sleep_drops_the_prefix_cache(sleepy):
    """Level 1 and 2 discard the KV cache, prefix cache included: a prompt served before the
    sleep is computed again after the wake."""
    emu = sleepy()
    assert _complete(emu)[0] == 200 and _complete(emu)[0] == 200
    hits = _value(_families(emu), "vllm:prefix_cache_hits")
    assert hits > 0
    assert _post(emu, "/sleep?level=1")[0] == 200
    assert _post(emu, "/wake_up")[0] == 200
    assert _complete(emu)[0] == 200
    assert _value(_families(emu), "vllm:prefix_cache_hits") == hits


def test_a_server_does_not_start_where_another_holds_the_memory(sleepy, tmp_path):
    """vLLM's start-up check: a server whose share does not fit beside the others on its GPU
    fails to start (exit status, vLLM's message), and one that fits starts."""
    ledger = str(tmp_path / "gpu0")
    sleepy("--gpu-ledger", ledger, "--gpu-memory-utilization", "0.55", gpu="A100-SXM4-80GB")
    late = Emulator(
        tmp_path, "--gpu-ledger", ledger, "--gpu-memory-utilization", "0.55",
        gpu="A100-SXM4-80GB", env=DEV,
    )  # fmt: skip
    try:
        code = late.proc.wait(timeout=120)
        assert code != 0
        assert "less than desired GPU memory utilization" in late.log.read_text()
    finally:
        late.stop()
    small = sleepy("--gpu-ledger", ledger, "--gpu-memory-utilization", "0.3", gpu="A100-SXM4-80GB")
    assert _complete(small)[0] == 200
