"""The CPU route-serve spends logging one finished request (fleetctl/daemon/request_log.py).

Run (from the repository root, in the dev venv):

    python benchmarks/request_log.py [--requests 20000] [--rounds 5]

For a 1K-token prompt (64 16-token blocks) and a Mooncake-sized 12K-token one (750 blocks),
the CPU time (process_time) per request of RequestLog.record as route-serve calls it: the
row's fields, the keyed hashes of the session and of the logged block hashes (every 4th
16-token one: 64-token blocks; AES-128 in one call per request), the JSON line, and its share of the buffered append to a real file (a write per
256 lines, rotation checks included), in a temporary folder. Beside it its parts alone (keyed
block hashes, the JSON line) and the prompt's hashing into blocks (routing/blocks.py
text_blocks), which the log turns on only for a policy that does not hash prompts already
(hardware-aware, the default, does). Each is set beside route-serve's measured CPU per
proxied non-streamed request (0.43 ms, benchmarks/results/router_overhead.md); the
target is under 5%. A figure is the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetctl.daemon.request_log import ENCODE, RequestLog
from fleetctl.routing.blocks import text_blocks
from fleetctl.routing.types import Backend, Request

ROUTER_MS = 0.43  # route-serve's CPU per proxied non-streamed request (results/router_overhead.md)
CHARS_PER_TOKEN = 4


def cpu_us(fn: Callable[[int], object], n: int, rounds: int) -> float:
    """Median over `rounds` of the CPU microseconds per call of fn(i), i in range(n)."""
    per = []
    for _ in range(rounds):
        start = time.process_time()
        for i in range(n):
            fn(i)
        per.append((time.process_time() - start) / n * 1e6)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(13)
    backend = Backend("http://10.0.0.7:8000", "rtx-7", "RTX-4090", "m", "bf16", 100_000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        log = RequestLog(Path(tmp) / "requests")
        for tokens in (1024, 12_288):
            text = "".join(rng.choice("abcdefghij klmnop") for _ in range(tokens * CHARS_PER_TOKEN))
            blocks = text_blocks(text, tokens)
            req = Request(1, "m", tokens, 256, priority=2, session="user-42", max_tokens=256)
            req.blocks = blocks
            n = max(200, args.requests * 1024 // tokens)
            k = log.stride
            logged = blocks.hashes[k - 1 :: k]  # the chained hashes the log keeps

            def record(i: int, req: Request = req) -> None:
                log.record(req, 1.78e9 + i, backend, 0.123456, 2.5, 200, 250)

            whole = cpu_us(record, n, args.rounds)
            log.flush()
            keyed = cpu_us(lambda i, h=logged: log.keys.blocks(h), n, args.rounds)
            line = {
                "timestamp": 1_780_000_000_000,
                "input_length": tokens,
                "output_length": 250,
                "hash_ids": log.keys.blocks(logged),
                "block_tokens": blocks.block_tokens * k,
                "model": "m",
                "max_tokens": 256,
                "session": "0123456789abcdef",
                "priority": 2,
                "precision": None,
                "backend": "10.0.0.7:8000",
                "class": "RTX-4090/bf16",
                "ttft_s": 0.123456,
                "e2e_s": 2.5,
                "status": 200,
                "format": 1,
            }
            dumps = cpu_us(lambda i, r=line: ENCODE(r), n, args.rounds)
            hashing = cpu_us(lambda i, t=text, k=tokens: text_blocks(t, k), n, args.rounds)
            rows.append(
                {
                    "prompt_tokens": tokens,
                    "blocks": len(blocks.hashes),
                    "logged_hashes": len(logged),
                    "line_bytes": len(json.dumps(line, separators=(",", ":"))) + 1,
                    "record_us": whole,
                    "keyed_hashes_us": keyed,
                    "json_line_us": dumps,
                    "prompt_hashing_us": hashing,
                }
            )
        written = log.written
        log.close()
    print(f"request log CPU per request ({written} lines written; router {ROUTER_MS} ms/request)")
    print(
        f"{'prompt':>8} {'blocks':>6} {'logged':>6} {'line B':>7} {'record us':>10} {'% router':>9} "
        f"{'keyed us':>9} {'json us':>8} {'hash-prompt us':>15} {'% router':>9}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>8} {r['blocks']:>6} {r['logged_hashes']:>6} {r['line_bytes']:>7} "
            f"{r['record_us']:>10.1f} {r['record_us'] / (ROUTER_MS * 10):>8.1f}% "
            f"{r['keyed_hashes_us']:>9.1f} {r['json_line_us']:>8.1f} "
            f"{r['prompt_hashing_us']:>15.1f} {r['prompt_hashing_us'] / (ROUTER_MS * 10):>8.1f}%"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
