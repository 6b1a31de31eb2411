"""Build tiny random LoRA adapters for "tiny-llama", in PEFT's layout, without PEFT.

    python build_tiny_adapters.py MODEL_DIR OUT_DIR RANK NAME [NAME ...]

Writes OUT_DIR/NAME/adapter_config.json and adapter_model.safetensors for each NAME: rank
RANK on every linear layer vLLM wraps (q, k, v, o, gate, up, down), A random and B random
(not PEFT's zero B, so each adapter changes the output). Needs torch and safetensors (run it
with the vLLM environment's python); deterministic per name.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def build(model_dir: Path, out: Path, rank: int, name: str) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for mod, (n_in, n_out) in shapes(config).items():
            part = "self_attn" if mod in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            a = torch.randn(rank, n_in, generator=gen) * 0.05
            b = torch.randn(n_out, rank, generator=gen) * 0.05
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": rank * 2,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(TARGETS),
        "modules_to_save": None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


if __name__ == "__main__":
    model_dir, out, rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    for n in sys.argv[4:]:
        print(build(model_dir, out, rank, n))
