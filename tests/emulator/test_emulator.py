"""`fleetctl emulate` over real HTTP: the OpenAI client, /metrics against a real vLLM capture, faults.

Each emulator is a real subprocess on a free port at --time-scale 20 (one at 4); latencies are compared in
emulated seconds (from /metrics), which do not depend on how fast this machine is.
"""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetctl.model.catalog import Catalog
from fleetctl.model.perf import EnginePerf, kv_budget
from tests.conftest import DATA, REPO
from tests.procs import NAME, SOURCE, Emulator

CAPTURE = "vllm-0.32.0-cpu-metrics.txt"


def _capture_path() -> Path:
    return DATA / CAPTURE  # a real vLLM 0.32 capture; see tests/data/README.md


@pytest.fixture(scope="module")
def emus(tmp_path_factory):
    """Every long-lived emulator the tests use, started in parallel, always stopped."""
    logs = tmp_path_factory.mktemp("emulators")
    specs = {
        "main": ((), "RTX-4090"),
        "a100": ((), "A100-SXM4-80GB"),
        "keyed": (("--api-key", "sekrit", "--die-mid-stream", "2"), "RTX-4090"),
        "errors": (("--error-rate", "1.0", "--hang-after", "1"), "RTX-4090"),
        "crash": (("--crash-after", "2"), "RTX-4090"),
        # 4x instead of 20x: a 3000-token prefill lasts ~140 ms of wall time, so a dozen
        # requests sent at once surely arrive while the others still wait, however loaded the
        # machine (the latencies compared are emulated seconds either way).
        "slow": (("--time-scale", "4"), "RTX-4090"),
    }
    started: dict[str, Emulator] = {}
    try:
        for key, (args, gpu) in specs.items():
            started[key] = Emulator(logs, *args, gpu=gpu)
        for emu in started.values():
            emu.wait_healthy()
        yield started
    finally:
        for emu in started.values():
            emu.stop()


def _sample(families, name: str, **labels: str) -> float:
    family = families[name]
    for s in family.samples:
        if s.name.endswith(("_created",)):
            continue
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name} {labels}")


def _hist(families, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram family."""
    fam = families[name]
    total = next(s.value for s in fam.samples if s.name == f"{name}_sum")
    count = next(s.value for s in fam.samples if s.name == f"{name}_count")
    return total, count


def _mean_delta(before, after, name: str) -> float:
    (s0, c0), (s1, c1) = _hist(before, name), _hist(after, name)
    assert c1 > c0, name
    return (s1 - s0) / (c1 - c0)


# --- the OpenAI client ------------------------------------------------------------------------


def test_completions_through_openai_client(emus):
    client = emus["main"].client()
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=7, temperature=0.3)
    assert r.object == "text_completion" and r.model == NAME
    assert r.choices[0].text == "".join(f"tok{i} " for i in range(7))
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == math.ceil(len(prompt) / 4)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7

    stream = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=9, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 9 and "".join(texts) == "".join(f"tok{i} " for i in range(9))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices


def test_chat_through_openai_client(emus):
    client = emus["main"].client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, user="u1")
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.split() == [f"tok{i}" for i in range(5)]
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == math.ceil(len("Be brief.Hi!") / 4)

    stream = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk"
    assert (
        chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    )
    contents = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert len(contents) == 6 == chunks[-1].usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_default_output_and_models_and_version(emus):
    emu = emus["main"]
    status, body = emu.request(
        "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}]}
    )
    assert status == 200
    assert json.loads(body)["usage"]["completion_tokens"] == 256  # min(256, room)
    status, body = emu.request("GET", "/v1/models")
    card = json.loads(body)["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["root"]) == (
        NAME,
        "model",
        "vllm",
        SOURCE,
    )
    assert card["max_model_len"] == 8192 and card["parent"] is None
    assert json.loads(emu.request("GET", "/version")[1]) == {"version": "0.32.0"}


# --- /metrics -------------------------------------------------------------------------------------


def _families_of(text: str) -> dict[str, tuple[str, set[tuple[str, ...]], set[str]]]:
    """name -> (type, label-name sets without `le`, bucket bounds) of every vllm: family."""
    out = {}
    for f in text_string_to_metric_families(text):
        if f.name.startswith("vllm:"):
            labels = {tuple(sorted(k for k in s.labels if k != "le")) for s in f.samples}
            buckets = {s.labels["le"] for s in f.samples if "le" in s.labels}
            out[f.name] = (f.type, labels, buckets)
    return out


def test_metrics_match_real_vllm_and_advance(emus, catalog: Catalog):
    emu = emus["main"]
    capture = _families_of(_capture_path().read_text())
    ours = _families_of(emu.request("GET", "/metrics")[1].decode())
    required = {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
        "vllm:estimated_read_bytes_per_gpu", "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds", "vllm:cache_config_info",
    }  # fmt: skip
    assert required <= set(ours)
    assert set(ours) <= set(capture), set(ours) - set(capture)  # no invented names
    for name, (kind, labels, buckets) in ours.items():
        assert kind == capture[name][0], name
        assert labels == capture[name][1], name
        if name.endswith("_seconds"):  # token-count buckets follow max_model_len, time ones do not
            assert buckets == capture[name][2], name

    before = emu.metrics()
    emu.client().completions.create(model=NAME, prompt="count me " * 20, max_tokens=12)
    after = emu.metrics()
    for counter in (
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:estimated_read_bytes_per_gpu",
    ):
        assert _sample(after, counter) > _sample(before, counter), counter
    assert (
        _sample(after, "vllm:generation_tokens") - _sample(before, "vllm:generation_tokens") == 12
    )
    ok = {"finished_reason": "length"}
    assert (
        _sample(after, "vllm:request_success", **ok)
        == _sample(before, "vllm:request_success", **ok) + 1
    )
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert _hist(after, hist)[1] == _hist(before, hist)[1] + 1
    assert (
        _hist(after, "vllm:inter_token_latency_seconds")[1]
        == _hist(before, "vllm:inter_token_latency_seconds")[1] + 11
    )
    assert 0 <= _sample(after, "vllm:kv_cache_usage_perc") <= 1

    info = after["vllm:cache_config_info"].samples[0].labels
    gpu, model, fmt = catalog.gpu("RTX-4090"), catalog.model(NAME), catalog.format("bf16")
    budget = kv_budget(gpu, model, fmt)
    assert int(info["kv_cache_size_tokens"]) == budget.kv_tokens
    assert int(info["num_gpu_blocks"]) * 16 == budget.kv_tokens and info["block_size"] == "16"
    assert info["gpu_memory_utilization"] == "0.92" and info["cache_dtype"] == "auto"


# --- the performance model in real time ------------------------------------------------------


def _post_many(emu: Emulator, bodies: list[dict]) -> list[int]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return [
            s
            for s, _ in pool.map(
                lambda b: emu.request("POST", "/v1/completions", b, timeout=30), bodies
            )
        ]


def test_ttft_grows_under_concurrent_long_prompts(emus):
    emu = emus["slow"]

    def long_prompt(i: int) -> dict:
        # ~3000 tokens, each with its own head: identical prompts would hit the prefix cache
        return {"model": NAME, "prompt": f"request {i}: " + "word " * 2397, "max_tokens": 2}

    before = emu.metrics()
    assert _post_many(emu, [long_prompt(99)]) == [200]
    mid = emu.metrics()
    alone = _mean_delta(before, mid, "vllm:time_to_first_token_seconds")
    assert _post_many(emu, [long_prompt(i) for i in range(12)]) == [200] * 12
    loaded = _mean_delta(mid, emu.metrics(), "vllm:time_to_first_token_seconds")
    assert loaded > 3 * alone, (alone, loaded)


def test_rtx_4090_decodes_slower_than_a100(emus, catalog: Catalog):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 40}
    itl = {}
    for key in ("main", "a100"):
        before = emus[key].metrics()
        assert _post_many(emus[key], [body]) == [200]
        itl[key] = _mean_delta(before, emus[key].metrics(), "vllm:inter_token_latency_seconds")
    assert itl["main"] > 1.8 * itl["a100"], itl
    # The emulated step is the shared performance model's, not something of the emulator's own.
    perf = EnginePerf(catalog.gpu("RTX-4090"), catalog.model(NAME), catalog.format("bf16"))
    assert itl["main"] == pytest.approx(perf.step_time(1, 20), rel=0.15)


# --- errors and faults -----------------------------------------------------------------------------


def _error(status_body: tuple[int, bytes]) -> tuple[int, dict]:
    status, body = status_body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return status, err


def test_bad_requests_answer_like_vllm(emus):
    emu = emus["main"]
    status, err = _error(emu.request("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}))
    assert status == 404 and err["type"] == "NotFoundError" and "gpt-4" in err["message"]
    status, err = _error(emu.request("POST", "/v1/completions", b'{"prompt": "x",'))
    assert status == 400 and err["type"] == "BadRequestError"
    too_long = {"model": NAME, "prompt": "x" * 4 * 9000}
    status, err = _error(
        emu.request(
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": too_long["prompt"]}]},
        )
    )
    assert status == 400 and "maximum context length is 8192" in err["message"]
    status, err = _error(emu.request("POST", "/v1/completions", too_long))
    assert status == 400 and "9000 input tokens" in err["message"]
    status, err = _error(
        emu.request("POST", "/v1/completions", {"prompt": "x" * 4 * 8000, "max_tokens": 500})
    )
    assert status == 400 and "too large" in err["message"]
    with pytest.raises(openai.NotFoundError):
        emu.client().completions.create(model="nope", prompt="x", max_tokens=1)
    assert emu.request("GET", "/health")[0] == 200  # still serving


def test_api_key_and_stream_dying_mid_way(emus):
    emu = emus["keyed"]
    assert emu.request("GET", "/v1/models")[0] == 401
    assert emu.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert emu.request("GET", "/v1/models", headers={"Authorization": "Bearer sekrit"})[0] == 200
    assert emu.request("GET", "/health")[0] == 200 and emu.request("GET", "/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        emu.client("wrong").completions.create(model=NAME, prompt="x", max_tokens=1)
    # The first stream is whole; the second (--die-mid-stream 2) loses its connection.
    first = list(
        emu.client("sekrit").completions.create(model=NAME, prompt="x", max_tokens=8, stream=True)
    )
    assert len(first) == 8
    conn = http.client.HTTPConnection("127.0.0.1", emu.port, timeout=10)
    body = json.dumps({"model": NAME, "prompt": "x", "max_tokens": 50, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Authorization": "Bearer sekrit"})
    resp = conn.getresponse()
    assert resp.status == 200
    try:
        data = resp.read()
    except http.client.IncompleteRead as e:
        data = e.partial
    conn.close()
    assert data.count(b"data: {") >= 1 and b"[DONE]" not in data
    assert emu.request("GET", "/health")[0] == 200  # the server survives its dropped stream


def test_error_rate_then_hang(emus):
    emu = emus["errors"]
    status, err = _error(emu.request("POST", "/v1/completions", {"model": NAME, "prompt": "x"}))
    assert status == 500 and err["type"] == "InternalServerError"
    assert emu.request("GET", "/health")[0] == 200
    # --hang-after 1: the second completion request, and everything after it, never answers.
    with pytest.raises(TimeoutError):
        emu.request("POST", "/v1/completions", {"model": NAME, "prompt": "x"}, timeout=1)
    with pytest.raises(TimeoutError):
        emu.request("GET", "/health", timeout=0.5)
    assert emu.proc.poll() is None


def test_crash_after_completed_requests(emus):
    emu = emus["crash"]
    client = emu.client()
    client.completions.create(model=NAME, prompt="x", max_tokens=2)
    list(
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True
        )
    )
    assert emu.proc.wait(60) == 1  # the bound only stops a hang: it exits as it answers


def test_startup_delay_answers_503_first(tmp_path):
    # 503s for 5 s after it starts: the two requests below, sent as soon as it listens, have
    # a margin of seconds on a loaded machine; then /health is polled until it says 200.
    emu = Emulator(tmp_path, "--startup-delay", "5")
    try:
        assert emu.first_answer() == 503
        assert (
            _error(emu.request("POST", "/v1/completions", {"model": NAME, "prompt": "x"}))[0] == 503
        )
        emu.wait_healthy()
        assert emu.request("POST", "/v1/completions", {"model": NAME, "prompt": "x"})[0] == 200
    finally:
        emu.stop()


def test_bad_command_line_is_one_line_exit_2():
    exe = [sys.executable, "-m", "fleetctl", "emulate"]
    for args in (
        ["--gpu", "RTX-9090", "--model", NAME],
        ["--gpu", "RTX-4090", "--model", "llama-9"],
    ):
        r = subprocess.run([*exe, *args], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and r.stderr.startswith("error: unknown"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    # --help of the whole CLI stays free of the server's imports.
    probe = (
        "import sys; sys.argv=['fleetctl','--help']\n"
        "from fleetctl.cli import main\n"
        "try:\n main()\nexcept SystemExit: pass\n"
        "print('HEAVY', [m for m in ('aiohttp', 'fleetctl.emulator') if m in sys.modules])"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert "HEAVY []" in r.stdout, r.stdout


def test_the_read_byte_counter_is_per_emulated_second_at_any_time_scale(catalog: Catalog):
    """A scraper turns vllm:estimated_read_bytes_per_gpu into bandwidth on its own clock. An
    emulator running 4x fast must not read as 4x the GPU's bandwidth (route-serve's
    saturation term fired on every server of a time-scaled replay): the counter is the
    engine's bytes over the time scale, so its rate on the wall clock is the modelled GPU's."""
    from fleetctl.emulator.metrics import CacheInfo, Recorder, render
    from fleetctl.sim.engine import Engine, Seq

    gpu, model, fmt = catalog.gpu("RTX-4090"), catalog.model(NAME), catalog.format("bf16")
    engine = Engine(EnginePerf(gpu, model, fmt), 16_000)
    engine.add(Seq(0, 500, 20), 0.0)
    while engine.next_event() is not None:
        engine.advance(engine.next_event())
    read = engine.stats.read_bytes
    assert read > 0
    cache = CacheInfo("auto", 0.9, 16_000 * 131_072, 16_000, 8192)

    def counter(scale: float) -> float:
        text = render(NAME, engine, Recorder(8192), cache, scale)
        families = {f.name: f for f in text_string_to_metric_families(text)}
        return families["vllm:estimated_read_bytes_per_gpu"].samples[0].value

    assert counter(1.0) == pytest.approx(read)
    assert counter(4.0) == pytest.approx(read / 4)
