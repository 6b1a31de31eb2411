"""Bundled profiles load, agree with their architectures, and users can add or override them."""

from __future__ import annotations

import json

import pytest

from fleetctl.base.errors import UserError
from fleetctl.model.catalog import load_catalog
from fleetctl.model.hfconfig import count_params

REQUIRED_GPUS = [
    "A100-SXM4-80GB",
    "A100-SXM4-40GB",
    "A100-PCIE-80GB",
    "H100-SXM-80GB",
    "H200",
    "L40S",
    "L4",
    "A10G",
    "RTX-4090",
    "RTX-3090",
]
REQUIRED_MODELS = [
    "llama-3-8b",
    "llama-3-70b",
    "llama-2-13b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-7b",
    "qwen2.5-72b",
]
REQUIRED_FORMATS = ["bf16", "fp16", "fp8", "gptq-int4", "awq-int4", "int8"]


def test_required_profiles_exist_with_sources(catalog):
    assert set(REQUIRED_GPUS) <= set(catalog.gpus)
    assert set(REQUIRED_MODELS) <= set(catalog.models)
    assert set(REQUIRED_FORMATS) <= set(catalog.formats)
    for table in (catalog.gpus, catalog.models, catalog.formats):
        for p in table.values():
            assert p.sources, p.name


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM-80GB"),
        ("NVIDIA L40S", "L40S"),
        ("nvidia a10g", "A10G"),
    ],
)
def test_nvidia_smi_names_resolve(catalog, alias, name):
    assert catalog.gpu(alias).name == name


def _config(m):
    """The config.json fields a bundled profile was built from."""
    cfg = {
        "architectures": [m.architecture],
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_kv_heads,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": m.tie_word_embeddings,
        "max_position_embeddings": m.max_context,
    }
    if m.num_experts:
        cfg["num_local_experts"] = m.num_experts
        cfg["num_experts_per_tok"] = m.experts_per_token
    return cfg


def test_published_parameter_counts_match_the_architecture(catalog):
    for m in catalog.models.values():
        total, active = count_params(_config(m))
        assert total == pytest.approx(m.params_total, rel=0.005), m.name
        assert active == pytest.approx(m.params_active, rel=0.01), m.name


def test_mixtral_is_a_mixture_of_experts(catalog):
    mx = catalog.model("mixtral-8x7b")
    assert mx.is_moe and mx.num_experts == 8 and mx.experts_per_token == 2
    assert 12e9 < mx.params_active < 13.5e9 < 46e9 < mx.params_total


def test_format_table_covers_the_seed_kernel_observation(catalog):
    gptq = catalog.format("gptq-int4")
    assert gptq.kernel_efficiency["ampere"] > gptq.kernel_efficiency["ada"]
    assert catalog.format("bf16").runs_on(catalog.gpu("A10G"))  # A10G is Ampere
    assert "turing" not in catalog.format("bf16").architectures


def test_user_profiles_override_and_extend(tmp_path, monkeypatch):
    d = tmp_path / "mine" / "gpus"
    d.mkdir(parents=True)
    base = load_catalog().gpu("RTX-4090").model_dump()
    base["decode_efficiency"] = 0.5
    (d / "rtx.yaml").write_text(json.dumps(base))  # JSON is YAML
    # Extends: a profile of a new name joins the bundled ones, every one of which stays.
    oc = {**base, "name": "RTX-4090-OC", "aliases": ["RTX 4090 OC"]}
    (d / "oc.yaml").write_text(json.dumps(oc))
    bundled = load_catalog()
    cat = load_catalog([tmp_path / "mine"])
    assert cat.gpu("RTX-4090").decode_efficiency == 0.5
    assert cat.gpu("RTX 4090 OC").name == "RTX-4090-OC"
    assert set(cat.gpus) == set(bundled.gpus) | {"RTX-4090-OC"}
    assert set(cat.models) == set(bundled.models) and set(cat.formats) == set(bundled.formats)
    monkeypatch.setenv("FLEETCTL_PROFILES", str(tmp_path / "mine"))
    assert load_catalog().gpu("rtx-4090").decode_efficiency == 0.5


def test_bad_profile_is_located(tmp_path):
    d = tmp_path / "p" / "models"
    d.mkdir(parents=True)
    (d / "x.yaml").write_text("name: x\narchitecture: X\nnum_layers: two\n")
    with pytest.raises(UserError) as e:
        load_catalog([tmp_path / "p"])
    assert "x.yaml:3" in str(e.value) and "num_layers" in str(e.value)
    with pytest.raises(UserError, match="profiles folder not found"):
        load_catalog([tmp_path / "missing"])


def test_alias_clash_is_refused(tmp_path):
    d = tmp_path / "p" / "gpus"
    d.mkdir(parents=True)
    clash = load_catalog().gpu("L4").model_dump()
    clash["name"] = "L4-custom"
    (d / "l4c.yaml").write_text(json.dumps(clash))  # same alias "NVIDIA L4"
    with pytest.raises(UserError, match="names both"):
        load_catalog([tmp_path / "p"])


def test_an_nvlink_gpu_without_its_bandwidth_is_refused(tmp_path):
    """The TP all-reduce cost divides by nvlink_gb_s: a profile saying NVLink must give it.
    Before, such a profile loaded and a TP>1 plan on it died with ZeroDivisionError (found by
    a surviving mutant of perf._allreduce_per_token)."""
    d = tmp_path / "p" / "gpus"
    d.mkdir(parents=True)
    gpu = load_catalog().gpu("H100-SXM-80GB").model_dump()
    assert gpu["interconnect"] == "nvlink"
    gpu.update(name="H100-no-link", aliases=[], nvlink_gb_s=None)
    (d / "h.yaml").write_text(json.dumps(gpu))
    with pytest.raises(UserError) as e:
        load_catalog([tmp_path / "p"])
    assert "h.yaml" in str(e.value) and "nvlink_gb_s" in str(e.value)
    gpu.update(nvlink_gb_s=0)
    (d / "h.yaml").write_text(json.dumps(gpu))
    with pytest.raises(UserError, match="nvlink_gb_s"):
        load_catalog([tmp_path / "p"])
