"""`fleetctl estimate`: its JSON contract, agreement with the planner, and its errors."""

from __future__ import annotations

import json

import pytest

from fleetctl.model.catalog import load_catalog
from fleetctl.model.estimate import Settings, Workload, estimate
from fleetctl.model.perf import kv_budget

CONTRACT = {
    "kv_cache_tokens",
    "kv_cache_gib_per_gpu",
    "weights_gib_per_gpu",
    "reserved_gib_per_gpu",
    "reserved_parts_gib_per_gpu",
    "max_concurrency_at_max_len",
    "decode_tok_s_per_seq",
    "decode_tok_s_total",
    "prefill_tok_s",
    "step_time_ms",
    "source",
}


def test_json_contract_and_vllm_defaults(cli):
    r = cli("estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "bf16", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert set(doc) >= CONTRACT
    assert set(doc["reserved_parts_gib_per_gpu"]) == {"activation_peak", "non_torch", "cuda_graphs"}
    parts = sum(doc["reserved_parts_gib_per_gpu"].values())
    assert abs(parts - doc["reserved_gib_per_gpu"]) < 0.01
    # Unspecified settings are the release's: 0.92 of memory (vLLM >= 0.21), 2048 batched
    # tokens and 256 sequences on a 24 GiB card, the model's whole context.
    s = doc["settings"]
    assert (s["gpu_memory_utilization"], s["max_num_batched_tokens"], s["max_num_seqs"]) == (
        0.92,
        2048,
        256,
    )
    old = cli(
        "estimate",
        "--gpu",
        "RTX-4090",
        "--model",
        "llama-3-8b",
        "--format",
        "bf16",
        "--vllm-version",
        "0.6.3",
        "--json",
    )
    assert json.loads(old.out)["settings"]["gpu_memory_utilization"] == 0.9
    assert s["max_model_len"] == 8192 and doc["vllm_version"] == "0.32.0"
    assert doc["source"]["kind"] == "model"
    assert doc["max_concurrency_at_max_len"] == round(doc["kv_cache_tokens"] / 8192, 2)


def test_the_same_figures_as_the_planner_uses():
    cat = load_catalog()
    gpu, model, fmt = cat.gpu("A100-SXM4-80GB"), cat.model("llama-3-70b"), cat.format("bf16")
    e = estimate(gpu, model, fmt, Settings(tensor_parallel_size=4, gpu_memory_utilization=0.92))
    assert e.budget == kv_budget(gpu, model, fmt, 4, 0.92)
    # Speeds: a bigger batch is faster in all and slower per sequence.
    one = estimate(gpu, model, fmt, Settings(4), Workload(batch=1))
    many = estimate(gpu, model, fmt, Settings(4), Workload(batch=64))
    assert many.decode_tok_s_total > 10 * one.decode_tok_s_total
    assert many.decode_tok_s_per_seq < one.decode_tok_s_per_seq


def test_int4_weights_leave_more_kv_and_eager_reserves_no_graphs(cli):
    def run(*extra: str) -> dict:
        r = cli("estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--json", *extra)
        assert r.code == 0, r.err
        return json.loads(r.out)

    bf16, awq = run("--format", "bf16"), run("--format", "awq-int4")
    assert awq["weights_gib_per_gpu"] < bf16["weights_gib_per_gpu"] / 2.5
    assert awq["kv_cache_tokens"] > 2 * bf16["kv_cache_tokens"]
    eager = run("--format", "bf16", "--enforce-eager")
    assert eager["reserved_parts_gib_per_gpu"]["cuda_graphs"] == 0
    assert eager["kv_cache_tokens"] > bf16["kv_cache_tokens"]
    fp8_kv = run("--format", "bf16", "--kv-cache-dtype", "fp8")
    assert abs(fp8_kv["kv_cache_tokens"] / bf16["kv_cache_tokens"] - 2) < 0.01


def test_a_model_that_does_not_fit_says_so(cli):
    r = cli("estimate", "--gpu", "RTX-4090", "--model", "llama-3-70b", "--format", "bf16")
    assert r.code == 3 and "does not fit" in r.out
    doc = json.loads(
        cli(
            "estimate", "--gpu", "RTX-4090", "--model", "llama-3-70b", "--format", "bf16", "--json"
        ).out
    )
    assert doc["fits"] is False and doc["kv_cache_tokens"] == 0


def test_a_model_that_does_not_fit_exits_3_without_speeds_and_names_what_fits(cli):
    """Llama-3 70B BF16 on one A100: no KV or speed figures a server that never starts could
    not have, exit 3 (as plan's cannot-be-placed, and said in --help), and the smallest TP
    and the least quantized format that fit, both as the performance model figures them."""
    args = ("estimate", "--gpu", "A100-SXM4-80GB", "--model", "llama-3-70b", "--format", "bf16")
    r = cli(*args)
    assert r.code == 3, r.out + r.err
    assert "tok/s" not in r.out and "0.00 GiB" not in r.out and "n/a" in r.out
    cat = load_catalog()
    gpu, model = cat.gpu("A100-SXM4-80GB"), cat.model("llama-3-70b")
    tp2 = estimate(gpu, model, cat.format("bf16"), Settings(2))
    fp8 = estimate(gpu, model, cat.format("fp8"), Settings(1))
    assert tp2.fits and fp8.fits and not estimate(gpu, model, cat.format("bf16")).fits
    assert f"fits with --tp 2 ({tp2.budget.kv_tokens:,} KV tokens)" in " ".join(r.out.split())
    assert f"or with --format fp8 ({fp8.budget.kv_tokens:,} KV tokens)" in " ".join(r.out.split())
    j = cli(*args, "--json")
    assert j.code == 3
    doc = json.loads(j.out)
    assert doc["decode_tok_s_total"] is None and doc["prefill_tok_s"] is None
    assert doc["fits_with"] == [
        {"tensor_parallel_size": 2, "format": "bf16", "kv_cache_tokens": tp2.budget.kv_tokens},
        {"tensor_parallel_size": 1, "format": "fp8", "kv_cache_tokens": fp8.budget.kv_tokens},
    ]
    assert "Exit code 3" in " ".join(cli("estimate", "--help").out.split())


def test_a_gpu_name_that_names_several_profiles_lists_them(cli):
    """`--gpu A100` suggests the A100 variants, not the closer spelling A10G."""
    r = cli("estimate", "--gpu", "A100", "--model", "llama-3-8b", "--format", "bf16")
    assert r.code == 2
    assert "did you mean one of 'A100-PCIE-80GB', 'A100-SXM4-40GB', 'A100-SXM4-80GB'?" in r.err
    assert "A10G" not in r.err


@pytest.mark.parametrize(
    ("option", "typed", "meant"),
    [
        ("--gpu", "H100", "one of 'H100-PCIE-80GB', 'H100-SXM-80GB'"),
        ("--gpu", "H100-80GB", "one of 'H100-PCIE-80GB', 'H100-SXM-80GB'"),
        ("--gpu", "4090", "'RTX-4090'"),
        ("--gpu", "A10", "'A10G'"),
        ("--gpu", "NVIDIA A100", "one of 'A100-PCIE-80GB', 'A100-SXM4-40GB', 'A100-SXM4-80GB'"),
        ("--format", "int4", "one of 'awq-int4', 'gptq-int4'"),
        ("--format", "gptq", "'gptq-int4'"),
    ],
)
def test_a_name_is_suggested_by_its_family_before_its_spelling(cli, option, typed, meant):
    """`H100` means an H100, not the closer spelling H200; `int4` an int4 format, not int8."""
    args = {"--gpu": "RTX-4090", "--model": "llama-3-8b", "--format": "bf16", option: typed}
    r = cli("estimate", *[w for pair in args.items() for w in pair])
    assert r.code == 2 and f"did you mean {meant}?" in r.err, r.err


def test_unknown_profiles_name_the_fix(cli):
    r = cli("estimate", "--gpu", "RTX-4009", "--model", "llama-3-8b", "--format", "bf16")
    assert r.code == 2 and "did you mean 'RTX-4090'" in r.err and "--profiles" in r.err
    r = cli("estimate", "--gpu", "RTX-4090", "--model", "llama-4-8b", "--format", "bf16")
    assert r.code == 2 and "profiles import-hf-config" in r.err
    r = cli("estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "int3")
    assert r.code == 2 and "quantization format" in r.err
    r = cli(
        "estimate",
        "--gpu",
        "RTX-4090",
        "--model",
        "llama-3-8b",
        "--format",
        "bf16",
        "--vllm-version",
        "0.6;reboot",
    )
    assert r.code == 2 and "not a release number" in r.err
