"""route-serve serves a disaggregated model as vLLM's protocol says, end to end: real
emulated servers (speaking vLLM 0.32's kv_transfer_params) behind a real route-serve.

The prompt goes to a prefill server (one token, not streamed, asking it to keep the KV
cache), the answer comes from a decode server that received the prefill server's
parameters and computed no prompt token but the last; the answer names both servers. A
prefill server that fails is replaced by another; a decode server that fails before its
first byte is replaced by another that prefills the prompt itself; the client sees one
answer."""

from __future__ import annotations

import json

import pytest

from tests.daemon.test_route_serve import Router, entry
from tests.procs import NAME, Emulator

PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
PROMPT = "hello " * 400  # 400 words: ~600 prompt tokens by the emulator's count


def counter(emu: Emulator, name: str, **labels: str) -> float:
    family = emu.metrics()[name]
    return sum(
        s.value
        for s in family.samples  # type: ignore[attr-defined]
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two 4090 prefill servers (one answering 500 to everything) and two A100 decode
    servers (one that dies at its first request), emulated."""
    tmp = tmp_path_factory.mktemp("pd")
    emus = {
        "p1": Emulator(tmp, "--kv-transfer-config", PRODUCER),
        "p2": Emulator(tmp, "--kv-transfer-config", PRODUCER, "--error-rate", "1"),
        "d1": Emulator(tmp, "--kv-transfer-config", CONSUMER, gpu="A100-SXM4-80GB"),
        "d2": Emulator(tmp, "--kv-transfer-config", CONSUMER, gpu="A100-SXM4-80GB"),
    }
    try:
        for e in emus.values():
            e.wait_healthy()
        yield tmp, emus
    finally:
        for e in emus.values():
            e.stop()


def backends(emus, *names: str) -> list[dict]:
    out = []
    for name in names:
        decode = name.startswith("d")
        gpu = "A100-SXM4-80GB" if decode else "RTX-4090"
        node = {"p1": "rtx-1", "p2": "rtx-2", "d1": "a100-1", "d2": "a100-2"}[name]
        out.append(entry(emus[name], node, gpu, role="decode" if decode else "prefill"))
    return out


def test_a_request_prefills_on_one_server_and_decodes_on_another(pair):
    tmp, emus = pair
    router = Router(tmp, backends(emus, "p1", "d1"), name="pd")
    try:
        before = {
            "p1_gen": counter(emus["p1"], "vllm:generation_tokens"),
            "d1_external": counter(
                emus["d1"], "vllm:prompt_tokens_by_source", source="external_kv_transfer"
            ),
            "d1_local": counter(emus["d1"], "vllm:prompt_tokens_by_source", source="local_compute"),
        }
        status, headers, body = router.complete(PROMPT, max_tokens=16)
        assert status == 200, body
        answer = json.loads(body)
        assert answer["usage"]["completion_tokens"] == 16
        assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
        # Both servers named: the decode server as usual, the prefill server beside it.
        assert headers["X-Fleet-Backend"] == "a100-1"
        assert headers["X-Fleet-Prefill-Backend"] == emus["p1"].base.removeprefix("http://")
        prompt = answer["usage"]["prompt_tokens"]
        # The prefill server made one token; the decode server counts every prompt token as
        # transferred and none as computed, as a real vLLM 0.32 pair does
        # (test_disaggregation_vllm_real.py).
        assert counter(emus["p1"], "vllm:generation_tokens") - before["p1_gen"] == 1
        external = counter(
            emus["d1"], "vllm:prompt_tokens_by_source", source="external_kv_transfer"
        )
        local = counter(emus["d1"], "vllm:prompt_tokens_by_source", source="local_compute")
        assert external - before["d1_external"] == prompt
        assert local - before["d1_local"] == 0
        # Streaming passes through from the decode server, chunk by chunk.
        status, headers, body = router.complete(PROMPT, max_tokens=8, stream=True)
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
        assert body.count(b"data: {") >= 8
        assert headers["X-Fleet-Prefill-Backend"] == emus["p1"].base.removeprefix("http://")
    finally:
        router.stop()


def test_a_failing_prefill_server_is_replaced_by_another(pair):
    tmp, emus = pair
    router = Router(tmp, backends(emus, "p2", "p1", "d1"), name="pd-p")
    try:
        for _ in range(4):  # whichever prefill server is tried first, every answer is whole
            status, headers, body = router.complete(PROMPT, max_tokens=4)
            assert status == 200, body
            assert headers["X-Fleet-Prefill-Backend"] == emus["p1"].base.removeprefix("http://")
    finally:
        router.stop()


def test_a_decode_server_that_fails_is_replaced_by_one_that_prefills_itself(pair, tmp_path):
    tmp, emus = pair
    # On an H100 its decode steps are the shortest: the router tries it first.
    dying = Emulator(
        tmp_path, "--kv-transfer-config", CONSUMER, "--error-rate", "1", gpu="H100-SXM-80GB"
    )
    try:
        dying.wait_healthy()
        entries = [*backends(emus, "p1", "d2")]
        entries.append(
            {"url": dying.base, "node": "h100-1", "gpu_type": "H100-SXM-80GB", "model": NAME}
            | {"role": "decode"}
        )
        router = Router(tmp, entries, name="pd-d")
        try:
            local = counter(emus["d2"], "vllm:prompt_tokens_by_source", source="local_compute")
            answered = 0
            for _ in range(4):
                status, headers, body = router.complete(PROMPT, max_tokens=4)
                assert status == 200, body
                assert headers["X-Fleet-Backend"] == "a100-2"
                answered += 1
            # The dying server was tried first: d2 then prefilled the prompt itself, all of it
            # (beyond the one last token it computes for each transferred prompt).
            after = counter(emus["d2"], "vllm:prompt_tokens_by_source", source="local_compute")
            assert after - local >= answered + 500
        finally:
            router.stop()
    finally:
        dying.stop()


def test_without_a_connector_the_parameters_are_ignored_as_vllm_does(tmp_path):
    plain = Emulator(tmp_path)
    try:
        plain.wait_healthy()
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "stream": False}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        status, answer = plain.request("POST", "/v1/completions", body)
        assert status == 200 and json.loads(answer).get("kv_transfer_params") is None
    finally:
        plain.stop()


def test_a_prefill_server_answers_where_its_kv_cache_waits(pair):
    _, emus = pair
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "stream": False}
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    status, answer = emus["p1"].request("POST", "/v1/completions", body)
    params = json.loads(answer)["kv_transfer_params"]
    assert status == 200 and params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False and params["remote_block_ids"]
    assert params["remote_host"] == "localhost" and params["remote_port"] == 5600
    # A decode request missing what it needs is refused as vLLM refuses it.
    status, answer = emus["d1"].request(
        "POST", "/v1/completions", {**body, "kv_transfer_params": {"do_remote_prefill": True}}
    )
    assert status == 400 and b"remote_block_ids" in answer
