"""Counting prompt tokens for the length class: a local tokenizer, or a learned ratio; and
the prompt's chained block hashes for prefix-cache-aware routing (fleetctl/routing/blocks.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.routing.blocks import text_blocks, token_blocks
from fleetctl.routing.prefix import PromptBlocks
from fleetctl.vllm.hashing import block_hashes

# Characters per token before any answer has been seen: English text with Llama-3-family
# BPE tokenizers runs at ~4. It is then calibrated per model from vLLM's own usage counts.
DEFAULT_CHARS_PER_TOKEN = 4.0
# Tokenizing this many characters or more happens off the event loop.
THREAD_OVER_CHARS = 32_000
# Hashing text or token ids into blocks is ~0.4 us per 64 characters (~16 tokens): 200K
# characters (~1 ms) and more hash off the event loop, with the GIL released every 5 ms.
BLOCKS_THREAD_OVER = 200_000


def prompt_text(body: dict[str, Any], chat: bool) -> tuple[str, int]:
    """(the prompt's text, token ids it already carries) for a completions or chat body."""
    if chat:
        parts = []
        for msg in body.get("messages") or []:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                found = (p.get("text") for p in content if isinstance(p, dict))
                parts.extend(t for t in found if isinstance(t, str))
        return "\n".join(parts), 0
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt, 0
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return "", len(prompt)  # token ids
    if isinstance(prompt, list):
        texts = [p for p in prompt if isinstance(p, str)]
        ids = sum(len(p) for p in prompt if isinstance(p, list))
        return "\n".join(texts), ids
    return "", 0


@dataclass(frozen=True, slots=True)
class Measured:
    """A prompt as routing sees it: tokens (counted or estimated), characters of text, and
    its block hashes when asked for (None for a batch of several prompts)."""

    tokens: int
    chars: int
    blocks: PromptBlocks | None = None


class TokenCounter:
    """Per model: a Hugging Face tokenizer when one is on local disk, else characters divided
    by a ratio learned from the prompt_tokens vLLM reports (moving average)."""

    def __init__(
        self,
        tokenizers: dict[str, Path] | None = None,
        alpha: float = 0.05,
        engine_block_size: int = 0,
    ):
        self.ratio: dict[str, float] = {}
        self.alpha = alpha
        # Nonzero: name blocks as vLLM does, with this --block-size (fleetctl/vllm/hashing.py),
        # for an index fed by the servers' KV events. Only token ids can be named so: a
        # completions prompt given as ids, or its text through the model's tokenizer (not a
        # chat: the server's chat template is not applied here); others get no blocks.
        self.engine_block_size = engine_block_size
        self.tokenizers: dict[str, Any] = {}
        for model, path in (tokenizers or {}).items():
            tok = _load_tokenizer(path)
            if tok is not None:
                self.tokenizers[model] = tok

    def name_blocks_as_engine(self, block_size: int) -> None:
        """Name prompts' blocks as vLLM does, `block_size` tokens each (for KV events)."""
        self.engine_block_size = block_size

    def chars_per_token(self, model: str) -> float:
        return self.ratio.get(model, DEFAULT_CHARS_PER_TOKEN)

    async def count(self, model: str, body: dict[str, Any], chat: bool) -> tuple[int, int]:
        """(estimated prompt tokens, characters of text) without blocking the loop for long."""
        m = await self.measure(model, body, chat)
        return m.tokens, m.chars

    async def measure(
        self, model: str, body: dict[str, Any], chat: bool, blocks: bool = False
    ) -> Measured:
        """The prompt's tokens and characters, and with `blocks` its block hashes: from the
        tokenizer's ids when the model has one here (or the ids the prompt is), else from
        the text's fixed chunks. Long prompts are tokenized and hashed off the event loop."""
        text, ids = prompt_text(body, chat)
        blocks = blocks and _one_prompt(body, chat)
        exact = self.engine_block_size
        tok = self.tokenizers.get(model)
        if tok is not None and text:
            hasher = self.id_blocks if blocks and not (exact and chat) else None
            if len(text) >= THREAD_OVER_CHARS:
                return await asyncio.to_thread(_tokenize, tok, text, ids, hasher)
            return _tokenize(tok, text, ids, hasher)
        tokens = max(1, ids + math.ceil(len(text) / self.chars_per_token(model)))
        hashed = None
        if blocks and text and not exact:
            hashed = await _off_loop(len(text), text_blocks, text, tokens)
        elif blocks and ids:
            given = body["prompt"]
            hashed = await _off_loop(len(given) * (50 if exact else 4), self.id_blocks, given)
        return Measured(tokens, len(text), hashed)

    def id_blocks(self, ids: list[int]) -> PromptBlocks | None:
        """A prompt's token ids as blocks: vLLM's own names with engine_block_size, else
        routing/blocks.py's 16-token chain."""
        size = self.engine_block_size
        if not size:
            return token_blocks(ids)
        hashes = block_hashes(ids, size)
        return None if hashes is None else PromptBlocks(tuple(hashes), size, len(ids))

    def observe(self, model: str, chars: int, prompt_tokens: int) -> None:
        """Calibrate from what the server counted (usage.prompt_tokens)."""
        if chars < 200 or prompt_tokens < 20 or model in self.tokenizers:
            return  # short prompts are mostly template tokens
        seen = chars / prompt_tokens
        old = self.ratio.get(model)
        self.ratio[model] = seen if old is None else old + self.alpha * (seen - old)


def _one_prompt(body: dict[str, Any], chat: bool) -> bool:
    """Whether the body holds one prompt, of text or of token ids (not a batch, for which
    there is no one prefix to match)."""
    if chat:
        return True
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return True  # a batch of one text prompt
    return isinstance(prompt, list) and all(type(t) is int for t in prompt)


def _tokenize(
    tok: Any, text: str, ids: int, hasher: Callable[[list[int]], PromptBlocks | None] | None
) -> Measured:
    encoded = tok.encode(text).ids
    hashed = hasher(encoded) if hasher is not None else None
    return Measured(max(1, len(encoded) + ids), len(text), hashed)


async def _off_loop(size: int, fn: Any, *args: Any) -> Any:
    """`fn(*args)` inline when `size` (characters) is small, else in a thread."""
    if size >= BLOCKS_THREAD_OVER:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _load_tokenizer(path: Path) -> Any:
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(file))
