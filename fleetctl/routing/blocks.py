"""A prompt as chained block hashes: from token ids when a tokenizer gives them, else from text.

Both give hashes that are the same in every process and on every router replica (replicas
share what they routed through Redis, fleetctl/daemon/prefix_share.py), so neither may use
Python's `hash` of a str or bytes, which is salted per process. The hash of an int is not
salted (it is the int modulo 2**61 - 1), nor is the hash of a tuple of ints: chains of those
are stable on every 64-bit CPython.

Token ids (`token_blocks`): the hash chains the full `block_size`-token blocks, as vLLM's
prefix cache names its KV blocks (16 tokens by default). Only full blocks are hashed: the
engine caches nothing of a partial one.

Text (`text_blocks`), the documented chunking used when the model's tokenizer is not on the
router's disk: the prompt's text is cut into fixed chunks of `chars` characters (64 by
default, about 16 tokens of English at ~4 characters per token), and each full chunk is
read as the integer of its UTF-8 bytes and chained. A chunk's hash is then that integer
modulo 2**61 - 1, mixed with the hash before it by the tuple hash: not cryptographic (a
client could craft two chunks that collide), which costs at most a misrouted request of its
own; it runs at ~0.4 us per chunk, against ~1.2 us with hashlib.blake2b
(benchmarks/prefix_index.py). Each chunk stands for `tokens * chars / len(text)` tokens.

For a chat request the text is the messages' contents joined by newlines, in order
(fleetctl/daemon/tokens.py `prompt_text`), so requests that share a system prompt or earlier
turns share their leading chunks. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetctl.routing.prefix import PromptBlocks

BLOCK_TOKENS = 16  # vLLM's default --block-size
TEXT_CHUNK_CHARS = 64  # ~16 tokens of English text


def token_blocks(ids: Sequence[int], block_size: int = BLOCK_TOKENS) -> PromptBlocks:
    """Chained hashes of the full `block_size`-token blocks of a prompt's token ids."""
    n = len(ids) - len(ids) % block_size
    out = []
    h = 0
    it = iter(ids[:n])
    for block in zip(*[it] * block_size, strict=True):  # consecutive `block_size`-tuples
        h = hash((h, block))
        out.append(h)
    return PromptBlocks(tuple(out), block_size, len(ids))


def text_blocks(text: str, tokens: int, chars: int = TEXT_CHUNK_CHARS) -> PromptBlocks:
    """Chained hashes of the full `chars`-character chunks of a prompt's text, which is
    `tokens` tokens long (the router's count or estimate)."""
    n = len(text) - len(text) % chars
    out = []
    h = 0
    read = int.from_bytes
    for i in range(0, n, chars):
        h = hash((h, read(text[i : i + chars].encode("utf-8", "surrogatepass"))))
        out.append(h)
    per_chunk = max(1, round(chars * tokens / len(text))) if text else 1
    return PromptBlocks(tuple(out), per_chunk, tokens)
