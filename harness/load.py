"""Load generators: one streamed exchange timed at the client, a closed loop, and an
open-loop replay at given arrival times; plus the request bodies they send.

The exchange records raw times and counts only; each benchmark judges it (what counts as
complete, which first byte is "first") in its own terms. It runs on the load generator's
core for every chunk, so it does as little as it can.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

from .ready import JSON_HEADERS

EVENT = b"data: {"
DONE = b"data: [DONE]\n\n"


@dataclass
class Gauge:
    """Streams open at once (first byte received, not yet ended)."""

    open_now: int = 0
    max_open: int = 0


@dataclass
class Exchange:
    """One POST as the client saw it (time.perf_counter() seconds; 0.0 for never)."""

    started: float
    first_byte: float  # the first chunk of the body
    first_event: float  # the first chunk holding an SSE token event
    ended: float
    status: int  # 0 when no response came
    events: int  # SSE token events ("data: {") received
    done: bool  # the body ended with "data: [DONE]"
    error: str = ""  # the exception's name when the exchange failed


def completion_body(model: str, prompt: str, max_tokens: int, stream: bool) -> bytes:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return json.dumps(body).encode()


def random_text(chars: int, seed: int, vocabulary: int) -> str:
    """At least `chars` characters of words drawn from `vocabulary` random words."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(vocabulary)
    ]
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


async def exchange(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    gauge: Gauge | None = None,
    stream: bool = True,
) -> Exchange:
    """POST `body`; with `stream`, count the SSE events of the answer (a short JSON answer
    has none, and not looking saves the load generator's core that work)."""
    started = time.perf_counter()
    first_byte = first_event = 0.0
    status = events = 0
    tail = b""
    error = ""
    opened = False
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
            status = resp.status
            async for chunk in resp.content.iter_any():
                if not first_byte:
                    first_byte = time.perf_counter()
                    if gauge is not None:
                        opened = True
                        gauge.open_now += 1
                        gauge.max_open = max(gauge.max_open, gauge.open_now)
                if stream:
                    # An event may straddle two chunks: count over the last one's tail too.
                    joined = tail + chunk
                    n = joined.count(EVENT) - tail.count(EVENT)
                    if n:
                        events += n
                        if not first_event:
                            first_event = time.perf_counter()
                    tail = joined[-32:]
            ended = time.perf_counter()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        ended = time.perf_counter()
        error = type(e).__name__
    finally:
        if opened and gauge is not None:
            gauge.open_now -= 1
    return Exchange(
        started, first_byte, first_event, ended, status, events, tail.endswith(DONE), error
    )


async def closed_loop(
    session: aiohttp.ClientSession,
    urls: list[str],
    body: bytes,
    conc: int,
    n_max: int,
    window_s: float,
    stream: bool = True,
) -> tuple[list[Exchange], float, float]:
    """`conc` workers, each sending its next request when the last ended, until `n_max` were
    sent or `window_s` passed. Returns the exchanges, the start and the end of the window."""
    # Warm-up: one wave at this concurrency (connections opened, caches warm); not counted.
    warm = await asyncio.gather(
        *(exchange(session, urls[i % len(urls)], body, stream=stream) for i in range(conc))
    )
    # Workers start spread over one request's duration, or they would stay in lockstep
    # (all streams ending, and the next all arriving, at once).
    stagger = min(1.0, statistics.median(x.ended - x.started for x in warm)) if conc > 1 else 0.0
    got: list[Exchange] = []
    sent = 0
    start = time.perf_counter()
    deadline = start + window_s

    async def worker(k: int) -> None:
        nonlocal sent
        await asyncio.sleep(stagger * k / conc)
        i = k
        while sent < n_max and time.perf_counter() < deadline:
            sent += 1
            got.append(await exchange(session, urls[i % len(urls)], body, stream=stream))
            i += conc

    await asyncio.gather(*(worker(k) for k in range(conc)))
    return got, start, min(deadline, time.perf_counter())


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    payloads: list[bytes],
    arrivals_s: list[float],
    drain_s: float,
) -> list[tuple[float, Exchange | None]]:
    """Send each payload at its arrival (wall seconds after a 0.2 s lead), whatever is still
    open; wait at most `drain_s` after the last send. Per payload, in order: the time it was
    due and its exchange (None when it had not ended by then)."""
    tasks: list[asyncio.Task[Exchange]] = []
    dues: list[float] = []
    start = time.perf_counter() + 0.2
    for at, body in zip(arrivals_s, payloads, strict=True):
        due = start + at
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(exchange(session, url, body)))
        dues.append(due)
    done, pending = await asyncio.wait(tasks, timeout=drain_s)
    for t in pending:
        t.cancel()
    return [(due, t.result() if t in done else None) for due, t in zip(dues, tasks, strict=True)]
