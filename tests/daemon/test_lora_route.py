"""LoRA adapters served and routed, end to end: emulated vLLM servers started with
--enable-lora and --lora-modules behind a real route-serve. An adapter's requests go only to
the servers that have it loaded, keeping its name as the request's model; an adapter no server
has is a 404 naming it; the base model routes as before; the Gateway API Inference
Extension's LoRA-affinity peer reads vllm:lora_requests_info."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from fleetctl.daemon.adapters import learn_from_metrics
from fleetctl.routing.policies.lora_affinity import LoraAffinity
from fleetctl.routing.registry import make_policy
from fleetctl.routing.types import Backend, Request
from tests.daemon.test_route_serve import INVENTORY, Router, entry
from tests.emulator.test_emulator_lora import lora_emulator
from tests.procs import NAME, Emulator

ADAPTERS = """\
    adapters:
      - {name: support-en, source: /srv/adapters/support-en, rank: 16}
      - {name: legal-de, source: /srv/adapters/legal-de, rank: 16}
      - {name: sql, source: /srv/adapters/sql, rank: 16}
"""
# The adapters go under the model, before the inventory's router section.
LORA_INVENTORY = INVENTORY.replace("router:", ADAPTERS + "router:", 1)


def completions(emu: Emulator) -> float:
    """The server's finished requests (vllm:request_success_total), whatever their reason."""
    return sum(
        s.value
        for s in emu.metrics()["vllm:request_success"].samples  # type: ignore[attr-defined]
        if s.name.endswith("_total")
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two servers of the base model: `first` has support-en and legal-de loaded, `second`
    legal-de only."""
    tmp = tmp_path_factory.mktemp("lora")
    emus = {
        "first": lora_emulator(tmp, "support-en", "legal-de"),
        "second": lora_emulator(tmp, "legal-de"),
    }
    try:
        for e in emus.values():
            e.wait_healthy()
        yield tmp, emus
    finally:
        for e in emus.values():
            e.stop()


def test_an_adapters_requests_go_only_where_it_is_loaded(pair):
    tmp, emus = pair
    # The server without support-en listed first: an idle fleet's first pick.
    entries = [
        entry(emus["second"], "rtx-2", "RTX-4090"),
        entry(emus["first"], "rtx-1", "RTX-4090"),
    ]
    router = Router(tmp, entries, name="lora", inventory=LORA_INVENTORY)
    try:
        before = {k: completions(e) for k, e in emus.items()}
        # At once, so that load alone would spread them over both servers.
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(lambda _: router.complete(model="support-en", max_tokens=200), range(6))
            )
        for status, headers, body in answers:
            assert status == 200, body
            # The adapter's name reached the server (it answers under it) and came back.
            assert json.loads(body)["model"] == "support-en"
            assert headers["X-Fleet-Backend"] == "rtx-1"
        after = {k: completions(e) for k, e in emus.items()}
        assert after["first"] - before["first"] == 6
        assert after["second"] == before["second"]
        # An adapter both have is spread over both when its requests overlap (load balance).
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda _: router.complete(model="legal-de", max_tokens=400), range(8))
            )
        assert all(status == 200 for status, _, _ in answers), answers
        assert {headers["X-Fleet-Backend"] for _, headers, _ in answers} == {"rtx-1", "rtx-2"}
        # The base model routes as before.
        status, _, body = router.complete()
        assert status == 200 and json.loads(body)["model"] == NAME
        # Hints hold for an adapter as for its base model: a session's turns and a strict
        # precision its base model runs; a format it does not run is the router's 400.
        hints = {"X-Session-ID": "s-1", "X-Fleet-Precision": "bf16;strict"}
        for _ in range(2):
            status, headers, body = router.complete(model="support-en", headers=hints)
            assert status == 200 and headers["X-Fleet-Backend"] == "rtx-1", body
        # A session whose earlier turn went to the base model's server without the adapter.
        status, headers, _ = router.complete(headers={"X-Session-ID": "s-2"})
        assert status == 200
        status, headers, body = router.complete(model="support-en", headers={"X-Session-ID": "s-2"})
        assert status == 200 and headers["X-Fleet-Backend"] == "rtx-1", body
        strict = {"X-Fleet-Precision": "int4;strict"}
        status, _, body = router.complete(model="support-en", headers=strict)
        assert status == 400 and "bf16" in json.loads(body)["error"]["message"], body
    finally:
        router.stop()


def test_an_adapter_no_server_has_is_a_404_naming_it(pair):
    tmp, emus = pair
    router = Router(
        tmp, [entry(emus["second"], "rtx-2", "RTX-4090")], name="lora404", inventory=LORA_INVENTORY
    )
    try:
        # In the inventory, loaded nowhere.
        status, _, body = router.complete(model="sql")
        assert status == 404, body
        error = json.loads(body)["error"]
        assert "sql" in error["message"] and "no server of llama-3-8b" in error["message"]
        assert error["param"] == "model"
        # Not in the inventory at all: the model does not exist.
        status, _, body = router.complete(model="nobody-knows")
        assert status == 404 and "nobody-knows" in json.loads(body)["error"]["message"]
        # An adapter the server has still routes.
        status, _, body = router.complete(model="legal-de")
        assert status == 200, body
    finally:
        router.stop()


def test_the_lora_affinity_peer_prefers_where_the_adapter_runs(pair):
    """The Gateway API Inference Extension's scorer, fed by the emulators' real
    vllm:lora_requests_info: legal-de runs on `second`, so its next request goes there."""
    _, emus = pair
    second = emus["second"]
    done = threading.Event()

    def long_request() -> None:
        body = {"model": "legal-de", "prompt": "hello", "max_tokens": 2000, "stream": True}
        second.request("POST", "/v1/completions", body, timeout=60)
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    try:
        backends = {}
        while not done.is_set():  # each scrape answers at once; ends when legal-de runs
            status, text = second.request("GET", "/metrics")
            assert status == 200
            b = Backend(second.base, "rtx-2", "RTX-4090", NAME, "bf16", 10_000)
            learn_from_metrics(b, text.decode())
            if "legal-de" in b.lora_running:
                backends["second"] = b
                break
        assert "second" in backends, "legal-de never ran on the second server"
        status, text = emus["first"].request("GET", "/metrics")
        first = Backend(emus["first"].base, "rtx-1", "RTX-4090", NAME, "bf16", 10_000)
        learn_from_metrics(first, text.decode())
        assert first.lora_max == 2 and backends["second"].lora_max == 2
        policy = make_policy("lora-affinity")
        assert isinstance(policy, LoraAffinity)
        req = Request(1, NAME, 100, 10, adapter="legal-de")
        pick = policy.choose(req, [first, backends["second"]])
        assert pick.backend is backends["second"]
        # Where it runs nowhere, a free slot scores as well as any: the queue decides.
        assert policy.lora_score(replace(req, adapter="support-en"), first) == 0.8
    finally:
        done.wait(60)


def test_every_policy_keeps_an_adapter_where_it_is_loaded(pair):
    tmp, emus = pair
    entries = [
        entry(emus["second"], "rtx-2", "RTX-4090"),
        entry(emus["first"], "rtx-1", "RTX-4090"),
    ]
    for policy in ("lora-affinity", "round-robin"):
        router = Router(
            tmp, entries, "--policy", policy, name=f"lora-{policy}", inventory=LORA_INVENTORY
        )
        try:
            for _ in range(4):
                status, headers, body = router.complete(model="support-en")
                assert status == 200, body
                assert headers["X-Fleet-Backend"] == "rtx-1"
        finally:
            router.stop()


RUNTIME_INVENTORY = INVENTORY.replace(
    "router:", ADAPTERS + "    adapters_runtime: true\nrouter:", 1
)


def test_an_adapter_no_server_has_is_loaded_once_where_fewest_are(tmp_path):
    """With the model's `adapters_runtime`, a request for an adapter no server has makes
    route-serve load it (POST /v1/load_lora_adapter) on the server of its base model with
    the fewest adapters loaded; requests for it meanwhile wait for that one load, then all
    go there."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    runtime = ["--enable-lora", "--max-loras", "2", "--lora-load-seconds", "4"]
    busy = Emulator(tmp_path, *runtime, "--lora-modules", "support-en=/srv/a/support-en", env=env)
    empty = Emulator(tmp_path, *runtime, env=env)
    try:
        busy.wait_healthy()
        empty.wait_healthy()
        entries = [entry(busy, "rtx-1", "RTX-4090"), entry(empty, "rtx-2", "RTX-4090")]
        router = Router(tmp_path, entries, name="lora-rt", inventory=RUNTIME_INVENTORY)
        try:
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: router.complete(model="sql"), range(4)))
            for status, headers, body in answers:
                assert status == 200, body
                assert json.loads(body)["model"] == "sql"
                assert headers["X-Fleet-Backend"] == "rtx-2"
            listed = json.loads(empty.request("GET", "/v1/models")[1])["data"]
            assert [c["id"] for c in listed] == [NAME, "sql"]
            assert listed[1]["root"] == "/srv/adapters/sql"  # the inventory's source
            assert "sql" not in busy.request("GET", "/v1/models")[1].decode()
            assert router.log.read_text().count("loaded adapter sql on rtx-2") == 1
            # A name the inventory does not list is never loaded.
            status, _, body = router.complete(model="nobody-knows")
            assert status == 404, body
        finally:
            router.stop()
    finally:
        busy.stop()
        empty.stop()
