"""A model profile from a Hugging Face config.json: shapes read, parameter counts derived."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetctl.base.errors import Location, UserError

# Architectures whose attention projections carry biases (q, k and v).
QKV_BIAS = {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM"}


def read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError("no such file", Location(str(path)), "pass a config.json") from None
    except (OSError, ValueError) as e:
        raise UserError(
            f"not a JSON config: {e}", Location(str(path)), "pass a config.json"
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            "config.json is not a JSON object", Location(str(path)), "pass a config.json"
        )
    return data


def _need(cfg: dict[str, Any], key: str, path: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or value <= 0:
        raise UserError(
            f"config has no positive integer '{key}'",
            Location(str(path), path=key),
            "only decoder-only transformer configs (Llama, Mistral, Mixtral, Qwen2) are supported",
        )
    return value


def count_params(cfg: dict[str, Any], path: Path = Path("config.json")) -> tuple[int, int]:
    """(total, active) parameters of a Llama-family decoder from its config."""
    hidden = _need(cfg, "hidden_size", path)
    layers = _need(cfg, "num_hidden_layers", path)
    heads = _need(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = _need(cfg, "intermediate_size", path)
    vocab = _need(cfg, "vocab_size", path)
    arch = (cfg.get("architectures") or [""])[0]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    moe_inter = cfg.get("moe_intermediate_size") or inter

    q = hidden * heads * head_dim
    kv = 2 * hidden * kv_heads * head_dim
    o = heads * head_dim * hidden
    bias = (heads + 2 * kv_heads) * head_dim if arch in QKV_BIAS else 0
    attn = q + kv + o + bias
    norms = 2 * hidden
    mlp_one = 3 * hidden * (moe_inter if experts else inter)
    if experts:
        router = hidden * experts
        per_layer_total = attn + norms + router + experts * mlp_one
        per_layer_active = attn + norms + router + top_k * mlp_one
    else:
        per_layer_total = per_layer_active = attn + norms + mlp_one
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    total = layers * per_layer_total + hidden + embed
    active = layers * per_layer_active + hidden + embed
    return total, active


def profile_from_config(
    cfg: dict[str, Any], name: str, path: Path, hf_id: str | None
) -> dict[str, Any]:
    total, active = count_params(cfg, path)
    heads = cfg["num_attention_heads"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    return {
        "name": name,
        "hf_id": hf_id,
        "architecture": (cfg.get("architectures") or ["unknown"])[0],
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        "num_attention_heads": heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "vocab_size": cfg["vocab_size"],
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_context": cfg.get("max_position_embeddings") or 4096,
        "params_total": total,
        "params_active": active,
        "num_experts": experts or None,
        "experts_per_token": cfg.get("num_experts_per_tok") if experts else None,
        "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16",
        "sources": [f"config.json: {hf_id or path.name} (imported by fleetctl; params computed)"],
    }
