"""The router's cost of prefix-cache-aware routing: memory of the prefix index and CPU per
request for hashing a prompt into blocks and matching it against every backend.

Run (from the repository root, in the dev venv):

    python benchmarks/prefix_index.py [--blocks 1048576] [--backends 8] [--quick]

(a) Memory: a PrefixIndex (fleetctl/routing/prefix.py: an OrderedDict of hash -> None per
    backend) filled with `--blocks` block hashes over `--backends` backends, as the chained
    16-token hashes of random prompts, measured as the tracemalloc delta and the RSS delta of
    this process; beside it the same blocks in a plain dict per backend (insertion order as
    recency, the candidate compact structure below), the bound set for it being 200 MB
    for a million blocks.
(b) CPU per request, for a Mooncake-sized prompt (~12K tokens: 48K characters, 750 16-token
    blocks) and a 1K-token one: hashing its text (fleetctl/routing/blocks.py text_blocks; the
    blake2b alternative beside it) or its token ids (token_blocks, or as vLLM names its
    blocks for the KV-event-fed index, fleetctl/vllm/hashing.py), matching it against each
    backend (PrefixIndex.match), learning its placement (PrefixIndex.routed), and sharing it
    (an update's encode and a peer's decode and insert, fleetctl/daemon/prefix_share.py).
    Each is set beside the same run's json.loads of the request body (which intake already
    pays per request) and beside route-serve's measured CPU per proxied non-streamed request
    (0.43 ms, benchmarks/results/router_overhead.md), as a ratio.

Results go to benchmarks/out/prefix_index.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleetctl.daemon.prefix_share import STORED, PrefixShare, SharedIndex, decode, encode  # noqa: E402
from fleetctl.daemon.tokens import prompt_text  # noqa: E402
from fleetctl.routing.blocks import text_blocks, token_blocks  # noqa: E402
from fleetctl.routing.prefix import PrefixIndex, PromptBlocks, chain  # noqa: E402

OUT = REPO / "benchmarks" / "out"
PROXY_MS = 0.43  # route-serve CPU per non-streamed request (benchmarks/results/router_overhead.md)
_WORDS = "the of and to in is that for on with as was by at from this be are it an or have not"
WORDS = [*_WORDS.split(" "), "router", "fleet", "token", "prompt", "cache", "block", "server"]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def text_of(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


# --- (a) memory ------------------------------------------------------------------------------


class DictIndex:
    """The compact candidate: a plain dict per backend (insertion order is recency: a hit
    pops and reinserts), trimmed in one pass when it is 1/8 over capacity, since deleting at
    the front of a dict one by one makes finding the oldest key O(n)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: dict[str, dict[int, None]] = {}

    def insert(self, backend: str, hashes: Any) -> None:
        held = self.blocks.setdefault(backend, {})
        for h in hashes:
            held.pop(h, None)
            held[h] = None
        if len(held) > self.capacity + (self.capacity >> 3):
            keep = list(held)[-self.capacity :]
            self.blocks[backend] = dict.fromkeys(keep)


def fill(index: Any, blocks: int, backends: int, seed: int) -> None:
    """`blocks` chained hashes over `backends`, as 750-block prompts (distinct prompts)."""
    rng = random.Random(seed)
    per_prompt = 750
    done = 0
    i = 0
    while done < blocks:
        n = min(per_prompt, blocks - done)
        ids = [rng.randrange(1 << 40) for _ in range(n)]
        index.insert(f"http://10.0.0.{i % backends}:8000", chain(ids, seed=i))
        done += n
        i += 1


STRUCTURES: dict[str, Callable[[int], Any]] = {
    "PrefixIndex (OrderedDict)": lambda per: PrefixIndex(capacity=per),
    "dict per backend (candidate)": lambda per: DictIndex(capacity=per),
}


def measure_memory(name: str, blocks: int, backends: int) -> dict[str, float]:
    """In a fresh process each (so that nothing else allocated muddles RSS): the RSS delta
    of filling the index, then, in a second fill under tracemalloc, what it holds."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks');"
        "from prefix_index import memory_in_process as m;"
        f"print(json.dumps(m({name!r}, {blocks}, {backends})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def memory_in_process(name: str, blocks: int, backends: int) -> dict[str, float]:
    make = STRUCTURES[name]
    per = max(1, blocks // backends)
    gc.collect()
    rss0 = rss_bytes()
    index = make(per)
    fill(index, blocks, backends, seed=1)
    gc.collect()
    rss1 = rss_bytes()
    held = sum(len(b) for b in index.blocks.values())
    del index
    gc.collect()
    tracemalloc.start()
    index = make(per)
    fill(index, blocks, backends, seed=1)
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "blocks_held": held,
        "tracemalloc_mb": current / 2**20,
        "rss_delta_mb": (rss1 - rss0) / 2**20,
        "bytes_per_block": current / max(1, held),
    }


# --- (b) CPU per request ---------------------------------------------------------------------


def per_call_us(fn: Callable[[], Any], min_s: float) -> float:
    """Median of 5 rounds of this process's CPU microseconds per call (CPU time, not wall:
    the machine is shared), each round at least min_s / 5."""
    fn()
    rounds = []
    for _ in range(5):
        n = 0
        start = time.process_time()
        while True:
            fn()
            n += 1
            took = time.process_time() - start
            if took >= min_s / 5:
                break
        rounds.append(took / n * 1e6)
    return statistics.median(rounds)


def blake_blocks(text: str, tokens: int, chars: int = 64) -> PromptBlocks:
    """text_blocks with each chunk hashed by blake2b (the alternative the docstring names)."""
    n = len(text) - len(text) % chars
    out = []
    h = 0
    for i in range(0, n, chars):
        d = hashlib.blake2b(text[i : i + chars].encode("utf-8", "surrogatepass"), digest_size=8)
        h = hash((h, int.from_bytes(d.digest())))
        out.append(h)
    return PromptBlocks(tuple(out), max(1, round(chars * tokens / len(text))), tokens)


def walk_match(held: Any, hashes: Any) -> int:
    """The walk vLLM's own lookup does, block by block to the first miss (PrefixIndex.match
    bisects instead), beside it for comparison."""
    n = 0
    if held:
        for h in hashes:
            if h not in held:
                break
            n += 1
    return n


def vllm_rows(ids: list[int], n: int) -> list[tuple[str, Callable[[], Any], int]]:
    """Naming the blocks as vLLM does (sha256 of the pickled chain, fleetctl/vllm/hashing.py),
    for the index KV events feed; none where that module is not here."""
    try:
        from fleetctl.vllm.hashing import block_hashes
    except ImportError:
        return []
    return [("vLLM's block hashes of the ids (sha256)", lambda: block_hashes(ids, 16), n)]


def measure_request(tokens: int, backends: int, min_s: float) -> list[dict[str, Any]]:
    rng = random.Random(tokens)
    system = text_of(rng, tokens * 4 // 2)  # half the prompt is a shared system prompt
    user = text_of(rng, tokens * 4 - len(system))
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 64,
    }
    raw = json.dumps(body).encode()
    text, _ = prompt_text(body, chat=True)
    ids = [rng.randrange(128_000) for _ in range(tokens)]
    blocks = text_blocks(text, tokens)
    tblocks = token_blocks(ids)
    # Every backend holds a prompt sharing the system prompt; one holds this very prompt.
    index = PrefixIndex(capacity=1 << 17)
    names = [f"http://10.0.0.{i}:8000" for i in range(backends)]
    other = text_blocks(system + "\n" + text_of(rng, len(user)), tokens)
    for name in names:
        index.insert(name, other.hashes)
    index.insert(names[0], blocks.hashes)
    fill(index, 100_000, backends, seed=2)  # and unrelated blocks, as a busy index would
    share_index = SharedIndex(capacity=1 << 17)

    class Quiet:
        me = "bench001"

    share = PrefixShare(Quiet(), share_index, outbox_bytes=1 << 30)  # type: ignore[arg-type]
    msg = encode(STORED, "peer0001", names[1], blocks.hashes)
    assert msg is not None
    peer = PrefixIndex(capacity=1 << 17)

    def match_all() -> int:
        return max(index.cached(n, blocks) for n in names)

    def match_walk() -> int:
        return max(walk_match(index.blocks.get(n), blocks.hashes) for n in names)

    assert match_all() == blocks.prefix_tokens(match_walk())

    def share_out() -> None:
        share.outbox.clear()
        share_index.routed(names[1], blocks)

    def share_in() -> None:
        _, _, backend, hashes = decode(msg)
        peer.insert(backend, hashes)

    coarse = len(text_blocks(text, tokens, 256).hashes)
    n, t = len(blocks.hashes), len(tblocks.hashes)
    rows = [
        ("json.loads of the body (reference)", lambda: json.loads(raw), n),
        ("prompt_text (chat messages joined)", lambda: prompt_text(body, True), n),
        ("text_blocks (64-char chunks, int hash)", lambda: text_blocks(text, tokens), n),
        ("text_blocks with blake2b per chunk", lambda: blake_blocks(text, tokens), n),
        ("text_blocks, 256-char chunks", lambda: text_blocks(text, tokens, 256), coarse),
        ("token_blocks (16-token blocks of ids)", lambda: token_blocks(ids), t),
        *vllm_rows(ids, t),
        (f"match over {backends} backends", match_all, n),
        (f"match over {backends} backends walking block by block", match_walk, n),
        ("routed (learn the placement)", lambda: index.routed(names[1], blocks), n),
        ("share out (routed + encode + queue)", share_out, n),
        ("share in (decode + insert at a peer)", share_in, n),
    ]
    out = []
    for what, fn, count in rows:
        us = per_call_us(fn, min_s)
        out.append(
            {
                "prompt_tokens": tokens,
                "what": what,
                "us": us,
                "of_proxy": us / (PROXY_MS * 1000),
                "blocks": count,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--backends", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="100K blocks, shorter timings")
    args = ap.parse_args()
    blocks = 100_000 if args.quick else args.blocks
    min_s = 0.5 if args.quick else 2.0
    memory = {name: measure_memory(name, blocks, args.backends) for name in STRUCTURES}
    cpu = []
    for tokens in (12_000, 1_000):
        cpu += measure_request(tokens, args.backends, min_s)
    result = {
        "python": sys.version.split()[0],
        "blocks": blocks,
        "backends": args.backends,
        "memory": memory,
        "cpu": cpu,
        "proxy_ms_reference": PROXY_MS,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "prefix_index.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Prefix index cost ({blocks:,} blocks over {args.backends} backends, "
        f"Python {result['python']})",
        "",
        "| structure | blocks held | tracemalloc MB | RSS delta MB | bytes/block |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, m in memory.items():
        lines.append(
            f"| {name} | {m['blocks_held']:,} | {m['tracemalloc_mb']:.1f} | "
            f"{m['rss_delta_mb']:.1f} | {m['bytes_per_block']:.0f} |"
        )
    lines += [
        "",
        f"CPU per request (µs; ratio to route-serve's {PROXY_MS} ms per proxied request):",
        "",
        "| prompt tokens | step | blocks | µs | of proxy cost |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in cpu:
        lines.append(
            f"| {r['prompt_tokens']:,} | {r['what']} | {r['blocks']} | {r['us']:.1f} | "
            f"{r['of_proxy']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    (OUT / "prefix_index.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
