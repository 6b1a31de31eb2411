"""Build "tiny-llama": a random, deterministic Llama small enough for vLLM's CPU build.

    python build_tiny_model.py OUT_DIR

Writes config.json, model.safetensors (bfloat16: vLLM's CPU build serves bf16, and downcasts
float32 checkpoints to it), a byte-level BPE tokenizer trained on the corpus below
(tokenizer.json, tokenizer_config.json with a chat template, special_tokens_map.json) and
generation_config.json. Hidden size 128, 2 layers, 4 attention heads and 2 KV heads: head dim
32 (below 32 crashes vLLM's CPU attention on the first request). Needs numpy, torch,
safetensors and tokenizers (all vLLM dependencies: run it with the vLLM environment's python);
runs in a few seconds. The same script always writes the same bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

NAME = "tiny-llama"
SEED = 20260
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32
INTERMEDIATE = 256
MAX_POSITIONS = 2048
TARGET_VOCAB = 2048
INIT_STD = 0.02

BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, *ROLE_TOKENS]

# Each message is "<|role|>\n" + content + "</s>\n"; the prompt ends with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = """\
fleetctl runs a GPU fleet that mixes hardware classes, A100s beside RTX 4090s and H100s
beside L40S, serving open-weight language models with vLLM. It reads one inventory of nodes
and models and plans which model, quantization format and tensor-parallel size runs on which
GPUs, so that the KV cache the workload's context lengths need actually fits.

The planner explains every choice with numbers from one shared performance model: weights,
KV cache, roofline decode and prefill speed. It prints a diff against what runs, like a
plan of infrastructure changes: three to create, one to change, two to destroy.

A server keeps its key and value tensors in blocks of sixteen tokens. When the cache is
full, the scheduler preempts the youngest request and recomputes it later from its prompt;
the prefix cache often still holds the blocks it needs, so the second prefill is cheap.

Routing decides where each request goes. Round robin sends requests in turn. Least
outstanding picks the server with the fewest requests in flight. Power of two samples two
servers and keeps the better one. The hardware-aware policy estimates the time to first
token on each server: the prompt tokens queued ahead at that GPU's prefill speed, the batch
the request joins, and a penalty when memory bandwidth is nearly saturated.

Long prompts prefer the servers with a large KV cache. Sessions stay on the node class of
their first turn, waiting for room there rather than switching, because a warm prefix cache
saves a long prefill. Strict precision hints go only to servers of that format; others are
rejected with a reason the client can read.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. The five boxing
wizards jump quickly. Jackdaws love my big sphinx of quartz.

Once upon a time, in a data center far away, a small model answered questions all night.
It did not know much, and its words were random, but it answered every request quickly and
always reported how many tokens it had read and how many it had written. The operators
liked it because it started in under a minute and never ran out of memory.

Question: How much memory do the weights of an eight billion parameter model take in
sixteen bits? Answer: about sixteen gigabytes, two bytes per parameter.
Question: What limits decode speed at batch size one? Answer: memory bandwidth, because each
step reads every weight once. Question: What limits prefill? Answer: compute, because
thousands of tokens share each weight read.

def plan(inventory, profiles):
    candidates = [c for c in enumerate_candidates(inventory, profiles) if c.fits()]
    solution = solve(candidates, objective="coverage", time_limit=10.0)
    return Plan(deployments=solution.deployments, warnings=solution.warnings)

{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16, "temperature": 0.0}
GET /health 200 OK; GET /v1/models 200 OK; POST /v1/completions 200 OK; GET /metrics 200 OK
vllm:kv_cache_usage_perc 0.0 vllm:num_requests_running 1 vllm:generation_tokens_total 59

Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. January, February, March,
April, May, June, July, August, September, October, November and December. Spring, summer,
autumn and winter. North, south, east and west. Red, orange, yellow, green, blue, indigo
and violet. Zero, one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,
twenty, thirty, forty, fifty, hundred, thousand, million, billion.

Les serveurs répondent vite. Die Warteschlange ist leer. La memoria está llena. 你好世界。
"""


def corpus_lines() -> list[str]:
    """The corpus plus numbers and short arithmetic lines, so BPE finds enough merges."""
    lines = CORPUS.splitlines()
    lines += [f"{i} + {i * 7 % 101} = {i + i * 7 % 101}; port {8000 + i}" for i in range(600)]
    return lines


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def build_weights(vocab: int) -> dict[str, torch.Tensor]:
    """Normal(0, 0.02) matrices and unit norms, drawn with numpy's PCG64 (stable across
    versions), rounded to bfloat16."""
    rng = np.random.default_rng(SEED)

    def normal(*shape: int) -> torch.Tensor:
        x = (rng.standard_normal(shape) * INIT_STD).astype(np.float32)
        return torch.from_numpy(x).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    w["model.norm.weight"] = ones(HIDDEN)
    w["lm_head.weight"] = normal(vocab, HIDDEN)
    return w


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.save(str(out / "tokenizer.json"))

    write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab,
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "hidden_act": "silu",
            "max_position_embeddings": MAX_POSITIONS,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": INIT_STD,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "dtype": "bfloat16",
            "torch_dtype": "bfloat16",
            "use_cache": True,
        },
    )
    write_json(
        out / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "_from_model_config": True},
    )
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "additional_special_tokens": ROLE_TOKENS,
            "model_max_length": MAX_POSITIONS,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "additional_special_tokens": ROLE_TOKENS},
    )
    save_file(build_weights(vocab), str(out / "model.safetensors"), metadata={"format": "pt"})
    print(
        f"built {NAME} in {out}: vocab {vocab}, hidden {HIDDEN}, {LAYERS} layers", file=sys.stderr
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    build(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
