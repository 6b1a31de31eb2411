"""`fleetctl emulate --enable-lora`: adapters loaded with --lora-modules, listed in
/v1/models, answered by name, and named in vllm:lora_requests_info, in vLLM 0.32's shapes."""

from __future__ import annotations

import json
import threading
import time

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
        "message": f"The model `support-en` does not exist. Valid aliases: {NAME}.",
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


def test_an_adapter_loads_and_unloads_at_runtime_as_vllm_answers(tmp_path):
    """With VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, /v1/load_lora_adapter loads an adapter
    after --lora-load-seconds (emulated: 2 s at the time scale of 20 is 0.1 s), and
    /v1/unload_lora_adapter drops it, each answered as vLLM 0.32 answers
    (vllm/entrypoints/openai/models/serving.py); without the variable neither is served."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    emu = Emulator(tmp_path, "--enable-lora", "--lora-load-seconds", "2", env=env)
    plain = lora_emulator(tmp_path)
    try:
        emu.wait_healthy()
        plain.wait_healthy()
        ask = {"model": "sql", "prompt": "hello", "max_tokens": 2}
        assert emu.request("POST", "/v1/completions", ask)[0] == 404
        load = {"lora_name": "sql", "lora_path": "/srv/adapters/sql"}
        started = time.monotonic()
        status, body = emu.request("POST", "/v1/load_lora_adapter", load)
        took = time.monotonic() - started
        assert (status, body) == (200, b"Success: LoRA adapter 'sql' added successfully.")
        assert took >= 0.1  # 2 emulated seconds at 20x
        status, body = emu.request("POST", "/v1/completions", ask)
        assert status == 200 and json.loads(body)["model"] == "sql"
        listed = json.loads(emu.request("GET", "/v1/models")[1])["data"]
        assert {"id": "sql", "root": "/srv/adapters/sql", "parent": NAME}.items() <= listed[
            1
        ].items()
        # Loading it again, or under the base model's name, is vLLM's 400.
        status, body = emu.request("POST", "/v1/load_lora_adapter", load)
        assert status == 400 and "has already been loaded" in json.loads(body)["error"]["message"]
        status, body = emu.request("POST", "/v1/load_lora_adapter", load | {"lora_name": NAME})
        assert status == 400 and "conflicts with a served base model" in body.decode()
        unload = {"lora_name": "sql"}
        status, body = emu.request("POST", "/v1/unload_lora_adapter", unload)
        assert (status, body) == (200, b"Success: LoRA adapter 'sql' removed successfully.")
        status, body = emu.request("POST", "/v1/unload_lora_adapter", unload)
        assert status == 404 and "cannot be found" in json.loads(body)["error"]["message"]
        assert emu.request("POST", "/v1/completions", ask)[0] == 404
        # Without the variable vLLM does not serve the endpoints.
        assert plain.request("POST", "/v1/load_lora_adapter", load)[0] == 404
    finally:
        emu.stop()
        plain.stop()


def test_a_second_adapter_waits_for_the_only_slot_in_the_lora_metric(tmp_path):
    """--max-loras 1: while a request for legal-de runs, one for support-en waits (vLLM's
    scheduler skips it), and vllm:lora_requests_info says so: legal-de running, support-en
    waiting, max_lora 1; once legal-de's request ends, support-en runs."""
    emu = Emulator(
        tmp_path,
        "--enable-lora",
        "--max-loras",
        "1",
        "--lora-modules",
        "legal-de=/srv/adapters/legal-de",
        "support-en=/srv/adapters/support-en",
    )
    try:
        emu.wait_healthy()
        ended = {"legal-de": threading.Event(), "support-en": threading.Event()}

        def long_request(adapter: str, tokens: int) -> None:
            body = {"model": adapter, "prompt": "hello", "max_tokens": tokens, "stream": True}
            emu.request("POST", "/v1/completions", body, timeout=60)
            ended[adapter].set()

        def newest() -> tuple[str, str, str]:
            family = emu.metrics()["vllm:lora_requests_info"]
            s = max(family.samples, key=lambda s: s.value)  # type: ignore[attr-defined]
            return (
                s.labels["running_lora_adapters"],
                s.labels["waiting_lora_adapters"],
                s.labels["max_lora"],
            )

        first = threading.Thread(target=long_request, args=("legal-de", 2000), daemon=True)
        first.start()
        while newest()[0] != "legal-de" and not ended["legal-de"].is_set():
            pass
        second = threading.Thread(target=long_request, args=("support-en", 50), daemon=True)
        second.start()
        seen = set()
        while not ended["support-en"].is_set():
            seen.add(newest())
        assert ("legal-de", "support-en", "1") in seen, seen
        assert not any("," in running for running, _, _ in seen), seen  # never two at once
        assert ended["legal-de"].is_set()  # support-en ran only after it
    finally:
        emu.stop()


def test_a_runtime_load_takes_the_modelled_read_from_disk(tmp_path):
    """Without --lora-load-seconds a runtime load takes the performance model's read of an
    adapter of --max-lora-rank from disk (model/lora.py), on the emulator's clock."""
    from fleetctl.model.catalog import load_catalog
    from fleetctl.model.lora import LoraPerf
    from fleetctl.model.perf import EnginePerf

    c = load_catalog()
    perf = EnginePerf(c.gpu("RTX-4090"), c.model(NAME), c.format("bf16"))
    modelled = LoraPerf(perf, 64).disk_s(64)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    # At the time scale of 1, so the load's wall time is its emulated time.
    emu = Emulator(tmp_path, "--enable-lora", "--max-lora-rank", "64", "--time-scale", "1", env=env)
    try:
        emu.wait_healthy()
        started = time.monotonic()
        load = {"lora_name": "sql", "lora_path": "/srv/adapters/sql"}
        assert emu.request("POST", "/v1/load_lora_adapter", load)[0] == 200
        assert time.monotonic() - started >= modelled > 0.3
    finally:
        emu.stop()
