"""Print the bytes vLLM allocates for LoRA slots on tiny-llama, read from its own tensors.

    python lora_slot_bytes.py MODEL_DIR MAX_LORAS MAX_LORA_RANK

Loads the model in this process with vLLM's CPU build and LoRA on, then sums the A and B
stacks of every module vLLM wrapped for LoRA (each tensor once). Run it with the vLLM
environment's python and harness.vllm_server.server_env's variables; prints one integer.
"""

from __future__ import annotations

import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process


def _slot_bytes(worker: object) -> int:
    import torch

    seen: set[int] = set()
    total = 0
    for module in worker.model_runner.model.modules():  # type: ignore[attr-defined]
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            value = getattr(module, attr, None)
            tensors = value if isinstance(value, (tuple, list)) else (value,)
            for t in tensors:
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


if __name__ == "__main__":
    from vllm import LLM

    model, loras, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(
        model=model,
        enable_lora=True,
        max_loras=loras,
        max_lora_rank=rank,
        enforce_eager=True,
        max_model_len=512,
    )
    print(llm.collective_rpc(_slot_bytes)[0])
