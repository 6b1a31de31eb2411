"""`fleetctl emulate --enable-lora`: adapters loaded with --lora-modules, listed in
/v1/models, answered by name, and named in vllm:lora_requests_info, in vLLM 0.32's shapes."""

from __future__ import annotations

import json
import threading

import pytest

from tests.procs import NAME, SOURCE, Emulator


def lora_emulator(tmp, *modules: str) -> Emulator:
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    if modules:
        args += ["--lora-modules", *(f"{m}=/srv/adapters/{m}" for m in modules)]
    return Emulator(tmp, *args)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One server with support-en and legal-de loaded, one with legal-de only."""
    tmp = tmp_path_factory.mktemp("lora-emu")
    emus = [lora_emulator(tmp, "support-en", "legal-de"), lora_emulator(tmp, "legal-de")]
    try:
        for e in emus:
            e.wait_healthy()
        yield emus
    finally:
        for e in emus:
            e.stop()


def test_the_emulators_models_and_lora_metric_have_vllms_shapes(pair):
    first, second = pair
    status, body = first.request("GET", "/v1/models")
    assert status == 200
    cards = json.loads(body)["data"]
    # vllm/entrypoints/openai/models/serving.py, OpenAIServingModels.show_available_models:
    # the base model's card, then one per loaded adapter with root its path and parent the
    # base model's served name.
    assert [c["id"] for c in cards] == [NAME, "support-en", "legal-de"]
    assert cards[0]["root"] == SOURCE and cards[0]["parent"] is None
    assert cards[1]["root"] == "/srv/adapters/support-en" and cards[1]["parent"] == NAME
    assert cards[1]["object"] == "model" and cards[1]["max_model_len"] is None
    # A request naming a loaded adapter is answered under the adapter's name; one naming an
    # adapter the server has not loaded is vLLM's 404.
    ask = {"prompt": "hello", "max_tokens": 2}
    status, body = first.request("POST", "/v1/completions", {"model": "support-en", **ask})
    assert status == 200 and json.loads(body)["model"] == "support-en"
    status, body = second.request("POST", "/v1/completions", {"model": "support-en", **ask})
    assert status == 404
    assert json.loads(body)["error"] == {
        "message": "The model `support-en` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    # vllm/v1/metrics/loggers.py, PrometheusStatLogger: vllm:lora_requests_info is a gauge
    # set to the current time, labelled max_lora and the comma-joined adapters with requests
    # waiting and running; each label set seen keeps its series.
    family = first.metrics()["vllm:lora_requests_info"]
    assert family.type == "gauge"  # type: ignore[attr-defined]
    samples = family.samples  # type: ignore[attr-defined]
    assert samples and all(s.value > 1.7e9 for s in samples)
    assert set(samples[0].labels) == {
        "max_lora",
        "waiting_lora_adapters",
        "running_lora_adapters",
    }
    assert {s.labels["max_lora"] for s in samples} == {"2"}


def test_an_adapter_running_is_named_in_the_lora_metric(pair):
    first, _ = pair
    done = threading.Event()

    def long_request() -> None:
        body = {"model": "legal-de", "prompt": "hello", "max_tokens": 2000, "stream": True}
        first.request("POST", "/v1/completions", body, timeout=60)
        done.set()

    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    try:
        # Each scrape answers at once; the loop ends at the first that names it (the request
        # runs ~1.5 s at this time scale), or fails after the request has ended.
        seen: set[str] = set()
        while "legal-de" not in seen and not done.is_set():
            family = first.metrics()["vllm:lora_requests_info"]
            seen |= {s.labels["running_lora_adapters"] for s in family.samples}  # type: ignore[attr-defined]
        assert "legal-de" in seen, seen
    finally:
        done.wait(60)
