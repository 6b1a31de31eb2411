"""LoRA adapters: the inventory's checks, the slots' memory in the one performance model, the
plan's flags and figures, and route-serve refusing vLLM's adapter-loading endpoints."""

from __future__ import annotations

import json
import shlex

import pytest

from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from fleetctl.model.perf import kv_budget, lora_slot_bytes
from fleetctl.planner.place import plan_fleet
from tests.conftest import write
from tests.fleet.test_inventory_errors import assert_one_clear_line

BASE = """\
nodes:
  - name: a100-1
    host: 10.0.1.11
    gpus: {type: A100-SXM4-80GB, count: 1}
  - name: rtx-[1:2]
    host: 10.0.2.[21:22]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 1000, mean_output_tokens: 200}
"""
ADAPTERS = """\
    adapters:
      - name: support-en
        source: /srv/adapters/support-en
        rank: 16
        workload: {requests_per_s: 2, mean_prompt_tokens: 500, mean_output_tokens: 100}
        slo: {ttft_p99_s: 1.0, tpot_p99_ms: 60}
      - name: legal-de
        source: org/legal-de-lora
        rank: 64
        gpu_types: [A100-SXM4-80GB]
      - name: sql
        source: ./adapters/sql
        rank: 12
"""
GOOD = BASE + ADAPTERS


def bad(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


# (id, inventory text, line the error must name, words the message must contain)
CASES = [
    (
        "shell-metacharacters",
        bad("/srv/adapters/support-en", "'/srv/adapters/x;rm -rf ~'"),
        17,
        ["adapter source", "not a plain path", "no '..'"],
    ),
    (
        "command-substitution",
        bad("/srv/adapters/support-en", "'/srv/$(id)/a'"),
        17,
        ["not a plain path"],
    ),
    ("dot-dot", bad("./adapters/sql", "/srv/adapters/../../etc"), 26, ["not a plain path"]),
    ("dot-dot-first", bad("./adapters/sql", "../sql"), 26, ["not a plain path"]),
    ("option", bad("./adapters/sql", "--sql"), 26, ["starts with '-'"]),
    (
        "duplicate-adapter",
        bad("name: sql", "name: support-en"),
        25,
        ["duplicate adapter name 'support-en'", "models[0].adapters[0]"],
    ),
    (
        "clashes-with-model",
        bad("name: sql", "name: llama-3-8b"),
        25,
        ["adapter name 'llama-3-8b' is also a model's name", "ambiguous"],
    ),
    ("bad-name", bad("name: sql", "name: 'sql adapter'"), 25, ["not a valid served model name"]),
    ("rank-too-high", bad("rank: 12", "rank: 1024"), 27, ["less than or equal to 512"]),
    ("rank-zero", bad("rank: 12", "rank: 0"), 27, ["greater than or equal to 1"]),
    ("unknown-gpu", bad("[A100-SXM4-80GB]", "[A100-SXM9]"), 24, ["unknown GPU type"]),
    (
        "pinned-outside-model",
        bad(
            "    max_context: 8192\n",
            "    max_context: 8192\n    placement: {gpu_types: [RTX-4090]}\n",
        ),
        25,
        ["pinned to A100-SXM4-80GB", "never runs"],
    ),
    ("max-loras-zero", GOOD + "    max_loras: 0\n", 28, ["greater than or equal to 1"]),
    (
        "copy-to-a-relative-source",
        bad("source: ./adapters/sql", "source: ./adapters/sql\n        copy_from: ./built/sql"),
        26,
        ["has copy_from", "must be an absolute path"],
    ),
    (
        "copy-from-dot-dot",
        bad("source: ./adapters/sql", "source: /srv/sql\n        copy_from: ../built/sql"),
        27,
        ["copy_from '../built/sql' is not a plain path"],
    ),
    (
        "lora-flag-in-vllm-args",
        GOOD + "    vllm_args: [--max-lora-rank, '8']\n",
        28,
        ["'--max-lora-rank' is set by the plan", "each adapter's 'rank'"],
    ),
]


@pytest.mark.parametrize("text,line,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_adapters_are_one_clear_line(cli, tmp_path, text, line, words):
    path = write(tmp_path, text)
    assert_one_clear_line(cli("validate", path), path, line, words)


def test_good_adapters_validate(cli, tmp_path):
    r = cli("validate", write(tmp_path, GOOD))
    assert r.code == 0, r.err
    # Without adapters, LoRA flags stay the operator's to set.
    r = cli("validate", write(tmp_path, BASE + "    vllm_args: [--enable-lora]\n"))
    assert r.code == 0, r.err


def test_lora_slots_follow_vllms_tensors():
    """Llama-3 8B, 2 slots of rank 16 in BF16: vLLM's stacks, layer by layer (vllm/lora/
    layers: qkv, o, gate_up and down wrappers; embed_tokens and lm_head outside)."""
    p = load_catalog().model("llama-3-8b")
    r, h, inter, vocab = 16, 4096, 14336, 128256
    attn = 3 * r * h + (4096 + 2 * 1024) * r + r * 4096 + h * r
    mlp = 2 * r * h + 2 * inter * r + r * inter + h * r
    outside = vocab * r + h * r + r * h + vocab * r
    assert lora_slot_bytes(p, 2, r) == 2 * (32 * (attn + mlp) + outside) * 2
    assert lora_slot_bytes(p, 0, r) == 0
    # Under TP=2 each GPU holds the sharded halves of the column and row widths.
    assert lora_slot_bytes(p, 2, r, tp=2) < lora_slot_bytes(p, 2, r)


def test_slots_come_off_the_kv_budget_and_weigh_more_on_a_small_card():
    c = load_catalog()
    p, fmt = c.model("llama-3-8b"), c.format("bf16")
    slots = lora_slot_bytes(p, 4, 64)
    shares = {}
    for gpu in ("RTX-4090", "A100-SXM4-80GB"):
        g = c.gpu(gpu)
        without = kv_budget(g, p, fmt, max_model_len=8192)
        with_ = kv_budget(g, p, fmt, max_model_len=8192, lora_bytes=slots)
        assert without.kv_per_gpu - with_.kv_per_gpu == slots
        assert with_.lora == slots and with_.kv_tokens < without.kv_tokens
        shares[gpu] = 1 - with_.kv_tokens / without.kv_tokens
    # The same slots take about a quarter of a 4090's KV cache, a few percent of an A100's.
    assert shares["RTX-4090"] > 5 * shares["A100-SXM4-80GB"], shares


def _plan(tmp_path, text: str):
    return plan_fleet(load_inventory(write(tmp_path, text), load_catalog()))


def _args(plan, node: str) -> list[str]:
    return list(next(d for d in plan.deployments if d.node == node).vllm_args)


def test_plan_enables_lora_with_the_adapters_each_class_may_load(tmp_path):
    plan = _plan(tmp_path, GOOD)
    a100, rtx = _args(plan, "a100-1"), _args(plan, "rtx-1")
    for args in (a100, rtx):
        assert "--enable-lora" in args
        assert args[args.index("--max-loras") + 1] == args[args.index("--max-cpu-loras") + 1]
    # The pinned rank-64 adapter loads on the A100 only; rank 12 runs in vLLM's 16 slots.
    assert a100[a100.index("--max-lora-rank") + 1] == "64"
    assert rtx[rtx.index("--max-lora-rank") + 1] == "16"
    mods = a100[a100.index("--lora-modules") + 1 :]
    # Most requested first, then by name.
    assert mods[:3] == ["support-en=/srv/adapters/support-en", "legal-de=org/legal-de-lora",
                        "sql=./adapters/sql"]  # fmt: skip
    assert "legal-de=org/legal-de-lora" not in rtx
    env = dict(next(d for d in plan.deployments if d.node == "rtx-1").env)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    # The KV budget is the model's less the slots, per GPU type (at one step budget: the
    # planner may choose another with the adapters' kernels, and it sizes the activations).
    pin = "planner: {max_num_batched_tokens: 2048}\n"
    plain, pinned = _plan(tmp_path, BASE + pin), _plan(tmp_path, GOOD + pin)
    kv = {d.node: d.server.kv_budget_tokens for d in pinned.deployments}
    kv0 = {d.node: d.server.kv_budget_tokens for d in plain.deployments}
    m = pinned.models[0]
    for u in m.lora:
        node = "a100-1" if u.gpu_type.startswith("A100") else "rtx-1"
        assert kv0[node] - kv[node] == pytest.approx(u.kv_tokens_given_up, abs=16)
    data = m.to_json()
    assert [a["name"] for a in data["adapters"]] == ["support-en", "legal-de", "sql"]
    support = data["adapters"][0]
    assert support["servers"] == 3 and support["capacity_rps"] > support["demand_rps"]
    assert data["adapters"][1]["servers"] == 1 and data["adapters"][1]["capacity_rps"] is None
    # A model without adapters says nothing of LoRA.
    assert "lora" not in plain.models[0].to_json() and "--enable-lora" not in _args(plain, "rtx-1")


def test_runtime_loading_preloads_the_most_requested_and_sets_the_variable(tmp_path):
    text = GOOD + "    max_loras: 1\n    adapters_runtime: true\n"
    plan = _plan(tmp_path, text)
    d = next(d for d in plan.deployments if d.node == "a100-1")
    args = list(d.vllm_args)
    assert args[args.index("--lora-modules") + 1 :][:1] == ["support-en=/srv/adapters/support-en"]
    assert "legal-de=org/legal-de-lora" not in args
    assert dict(d.env)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_plan_json_and_explain_show_adapters(cli, tmp_path):
    path = write(tmp_path, GOOD)
    r = cli("plan", path, "--json")
    assert r.code == 0, r.err
    model = json.loads(r.out)["models"][0]
    assert {u["gpu_type"] for u in model["lora"]} == {"A100-SXM4-80GB", "RTX-4090"}
    r = cli("plan", path, "--explain")
    assert r.code == 0, r.err
    assert "adapter legal-de of llama-3-8b (rank 64, pinned to A100-SXM4-80GB)" in r.out
    assert "LoRA: 2 slots of rank 16" in r.out


def test_apply_quotes_the_adapter_arguments(tmp_path):
    """The start script carries each `name=path` as one shell word."""
    from fleetctl.apply.node import _START, _script

    plan = _plan(tmp_path, GOOD)
    d = next(d for d in plan.deployments if d.node == "rtx-1")
    words = shlex.split(_script(_START, "sid", str(d.port), "{}", "nohup", *d.vllm_args))
    assert words[-len(d.vllm_args) :] == list(d.vllm_args)


def test_route_serve_refuses_the_adapter_loading_endpoints(tmp_path):
    """vLLM's runtime loading endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING) load files named
    by the request onto a server: a client must never reach them through the router."""
    from tests.daemon.test_router_rough_edges import RouteServe, StandIn

    standin = StandIn()
    r = RouteServe(tmp_path, standin.port)
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            body = {"lora_name": "x", "lora_path": "/etc"}
            status, _, answer = r.request("POST", path, body)
            assert status == 404, (path, answer)
            err = json.loads(answer)["error"]
            assert err["type"] == "not_found_error" and path in err["message"]
        assert standin.received == []
    finally:
        r.stop()
        standin.stop()


def test_a_saved_plan_with_runtime_loading_matches_its_inventory(tmp_path):
    """apply takes back a saved plan whose servers carry the runtime-loading variable the
    planner set, and still refuses one whose environment was edited to open it."""
    from fleetctl.apply.flow import check_saved_plan
    from fleetctl.base.errors import UserError
    from fleetctl.fleet.plan import Deployment

    path = write(tmp_path, GOOD + "    adapters_runtime: true\n")
    inv = load_inventory(path, load_catalog())
    saved = [Deployment.from_json(d.to_json()) for d in plan_fleet(inv).deployments]
    assert all(dict(d.server.env) for d in saved)
    check_saved_plan(path, saved, inv)
    inv = load_inventory(write(tmp_path, GOOD, "static.yaml"), load_catalog())
    with pytest.raises(UserError, match="environment differs"):
        check_saved_plan(path, saved, inv)


def test_apply_reads_each_adapter_to_copy_once_and_refuses_a_folder_without_one(tmp_path):
    """apply reads copy_from folders before any node is touched: their plain files only,
    for every server that may load the adapter; a folder without adapter_config.json is a
    located error."""
    from fleetctl.apply.adapters import read_uploads, uploads_for
    from fleetctl.base.errors import UserError

    built = tmp_path / "built"
    built.mkdir()
    (built / "adapter_config.json").write_text("{}")
    (built / "adapter_model.safetensors").write_bytes(b"\0weights")
    (built / "sub").mkdir()  # not copied: the top level only
    text = bad(
        "source: /srv/adapters/support-en", f"source: /srv/support-en\n        copy_from: {built}"
    )
    inv = load_inventory(write(tmp_path, text), load_catalog())
    read = read_uploads(inv)
    assert [f for f, _ in read["support-en"].files] == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert read["support-en"].dest == "/srv/support-en"
    for d in plan_fleet(inv).deployments:
        assert [u.name for u in uploads_for(inv, d, read)] == ["support-en"]
    (built / "adapter_config.json").unlink()
    with pytest.raises(UserError, match=r"holds no adapter_config\.json") as e:
        read_uploads(inv)
    assert e.value.where is not None and e.value.where.line == 18
