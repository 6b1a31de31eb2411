"""A request's prompts as the engine's prefix cache names them (vLLM's automatic prefix caching).

The emulator has no tokenizer, so it names what it is given:

- Token ids (a completions prompt given as ids, or a batch of such): the ids' full
  `block_size`-token blocks hashed as vLLM 0.32 hashes them (fleetctl/vllm/hashing.py, with
  `--prefix-caching-hash-algo` and the server's PYTHONHASHSEED, as vLLM takes them), so the
  blocks it caches, and publishes as KV events, carry the ints a real vLLM would publish for
  the same ids. Where those cannot be computed (xxhash without PYTHONHASHSEED or the xxhash
  package), fleetctl/routing/blocks.py `token_blocks(ids, block_size)`.
- Text (a completions prompt string; a chat's messages, their text contents joined by
  newlines as fleetctl/daemon/tokens.py `prompt_text` joins them): fleetctl/routing/blocks.py
  `text_blocks(text, tokens)`, fixed 64-character chunks chained, each standing for
  64 / CHARS_PER_TOKEN = 16 tokens (the emulator counts 4 characters per token), so two
  prompts share cached blocks exactly as far as their texts share whole chunks.

The engine keys each prompt's full engine blocks from these (fleetctl/sim/kvpool.py
`engine_keys`) and, as vLLM, always computes a prompt's last token. Pure.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleetctl.daemon.tokens import prompt_text
from fleetctl.routing.blocks import text_blocks, token_blocks
from fleetctl.routing.prefix import PromptBlocks
from fleetctl.vllm.hashing import block_hashes

# Above this many token ids in one request, hashing (~0.2 us per token) leaves the loop.
THREAD_OVER_IDS = 20_000


@dataclass(frozen=True, slots=True)
class Named:
    """One prompt's blocks, and its token ids when it came as ids (for BlockStored)."""

    blocks: PromptBlocks | None
    ids: tuple[int, ...] | None = None


def sources(body: dict[str, Any], chat: bool) -> list[str | list[int]]:
    """The request's prompts, one per choice group: a text or a list of token ids.

    Call after the prompt was checked (fleetctl/emulator/protocol.py)."""
    if chat:
        return [prompt_text(body, True)[0]]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    assert isinstance(prompt, list)
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def name(
    source: str | Sequence[int],
    tokens: int,
    block_size: int,
    algo: str = "sha256",
    seed: str | None = None,
) -> Named:
    """The blocks of one prompt of `tokens` tokens (see the module docstring)."""
    if isinstance(source, str):
        return Named(text_blocks(source, tokens) if source else None)
    ids = tuple(source)
    hashes = block_hashes(ids, block_size, algo, seed)
    if hashes is None:
        return Named(token_blocks(ids, block_size), ids)
    return Named(PromptBlocks(tuple(hashes), block_size, len(ids)), ids)


def name_all(
    items: Sequence[tuple[str | Sequence[int], int]], block_size: int, algo: str
) -> list[Named]:
    """`name` for each (source, tokens), with vLLM's none-hash seed ($PYTHONHASHSEED)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return [name(src, tokens, block_size, algo, seed) for src, tokens in items]


def id_count(items: Sequence[tuple[str | Sequence[int], int]]) -> int:
    return sum(len(src) for src, _ in items if not isinstance(src, str))
