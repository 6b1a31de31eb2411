"""vLLM's OpenAI wire format: request fields to token counts, and response and error bodies."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

# Characters per token of English text for Llama-family BPE tokenizers (about 4 on typical
# prose); the one place prompt lengths are estimated without a tokenizer.
CHARS_PER_TOKEN = 4.0
DEFAULT_MAX_TOKENS_COMPLETION = 16  # vLLM's CompletionRequest default
DEFAULT_MAX_TOKENS_CHAT = 256  # capped so an emulated chat does not run to max_model_len


class ApiError(Exception):
    """An error vLLM answers with its ErrorResponse body."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.err_type, self.param)


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code": <HTTP status>}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "BadRequestError", param)


def text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def completion_prompts(body: dict[str, Any]) -> list[int]:
    """Token counts of a completion request's prompts: a string, strings, or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [max(1, text_tokens(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return [len(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [max(1, text_tokens(p)) for p in prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [len(p) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings or a list of token ids", "prompt")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only the text ones count
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def chat_prompt(body: dict[str, Any]) -> int:
    """Token count of a chat request's messages (their text, at CHARS_PER_TOKEN)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise bad_request("messages must be a list of message objects", "messages")
    text = "".join(_content_text(m.get("content")) for m in messages)
    return max(1, text_tokens(text))


def output_tokens(body: dict[str, Any], prompt: int, max_model_len: int, chat: bool) -> int:
    """Tokens to generate; vLLM's checks of the prompt and of max_tokens against the context."""
    if prompt >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt} input tokens. Please reduce the length of the input messages."
        )
    room = max_model_len - prompt
    asked = body.get("max_completion_tokens") if chat else None
    if asked is None:
        asked = body.get("max_tokens")
    if asked is None:
        default = DEFAULT_MAX_TOKENS_CHAT if chat else DEFAULT_MAX_TOKENS_COMPLETION
        return min(default, room)
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise bad_request(f"max_tokens must be at least 1, got {asked}.", "max_tokens")
    if asked > room:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt} input "
            f"tokens ({asked} > {max_model_len} - {prompt})."
        )
    return asked


def token_text(i: int) -> str:
    """The i-th generated token (0-based) as deterministic text."""
    return f"tok{i} "


def tokens_text(start: int, stop: int) -> str:
    return "".join(token_text(i) for i in range(start, stop))


def dumps(obj: Any) -> str:
    # Compact, as vLLM's pydantic model_dump_json writes it.
    return json.dumps(obj, separators=(",", ":"))


@dataclass
class Reply:
    """Identity and shape of one response: completion or chat."""

    chat: bool
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(
        self, texts: list[str], usage: dict[str, Any], reasons: list[str] | None = None
    ) -> dict[str, Any]:
        """The non-streamed body: every choice finished by length, or by `reasons`."""
        why = reasons or ["length"] * len(texts)
        if self.chat:
            choices = [_chat_choice(i, t, why[i]) for i, t in enumerate(texts)]
            body = self._head("chat.completion") | {"choices": choices}
            return body | {
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        choices = [_completion_choice(i, t, why[i]) for i, t in enumerate(texts)]
        body = self._head("text_completion") | {"choices": choices}
        return body | {"usage": usage, "system_fingerprint": None, "kv_transfer_params": None}

    def chunk(
        self, index: int, text: str, finished: bool, role: bool = False, reason: str = "length"
    ) -> dict[str, Any]:
        """One streamed chunk; the chat stream's first chunk per choice carries the role."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = reason if finished else None
        if finished or not self.chat:
            choice["stop_reason"] = None
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [choice]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage}


def usage(prompt: int, completion: int, details: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        out["prompt_tokens_details"] = None
    return out


def _completion_choice(index: int, text: str, reason: str) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
        "prompt_logprobs": None,
    }


def _chat_choice(index: int, text: str, reason: str) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning_content": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": reason,
        "stop_reason": None,
    }
