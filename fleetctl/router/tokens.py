"""Counting prompt tokens for the length class: a local tokenizer, or a learned ratio."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

# Characters per token before any answer has been seen: English text with Llama-3-family
# BPE tokenizers runs at ~4. It is then calibrated per model from vLLM's own usage counts.
DEFAULT_CHARS_PER_TOKEN = 4.0
# Tokenizing this many characters or more happens off the event loop.
THREAD_OVER_CHARS = 32_000


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


class TokenCounter:
    """Per model: a Hugging Face tokenizer when one is on local disk, else characters divided
    by a ratio learned from the prompt_tokens vLLM reports (moving average)."""

    def __init__(self, tokenizers: dict[str, Path] | None = None, alpha: float = 0.05):
        self.ratio: dict[str, float] = {}
        self.alpha = alpha
        self.tokenizers: dict[str, Any] = {}
        for model, path in (tokenizers or {}).items():
            tok = _load_tokenizer(path)
            if tok is not None:
                self.tokenizers[model] = tok

    def chars_per_token(self, model: str) -> float:
        return self.ratio.get(model, DEFAULT_CHARS_PER_TOKEN)

    async def count(self, model: str, body: dict[str, Any], chat: bool) -> tuple[int, int]:
        """(estimated prompt tokens, characters of text) without blocking the loop for long."""
        text, ids = prompt_text(body, chat)
        tok = self.tokenizers.get(model)
        if tok is not None and text:
            if len(text) >= THREAD_OVER_CHARS:
                n = await asyncio.to_thread(lambda: len(tok.encode(text).ids))
            else:
                n = len(tok.encode(text).ids)
            return max(1, n + ids), len(text)
        return max(1, ids + math.ceil(len(text) / self.chars_per_token(model))), len(text)

    def observe(self, model: str, chars: int, prompt_tokens: int) -> None:
        """Calibrate from what the server counted (usage.prompt_tokens)."""
        if chars < 200 or prompt_tokens < 20 or model in self.tokenizers:
            return  # short prompts are mostly template tokens
        seen = chars / prompt_tokens
        old = self.ratio.get(model)
        self.ratio[model] = seen if old is None else old + self.alpha * (seen - old)


def _load_tokenizer(path: Path) -> Any:
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(file))
