"""The harness the benchmarks and tests share (harness/), against real processes:
the stand-in backend as router_overhead.py starts it, the load generators, readiness waits
that end when the process dies, and stop() reaching a whole process group."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from harness.load import Gauge, closed_loop, completion_body, exchange, open_loop
from harness.procs import REPO, Proc, free_port
from harness.ready import NotReady, first_answer, wait_ready
from harness.standin import gap_prefix

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Iterator[str]:
    """The stand-in vLLM backend, started as the benchmark starts it."""
    port = free_port()
    script = REPO / "benchmarks" / "router_overhead.py"
    cmd = [sys.executable, str(script), "backend", "--port", str(port)]
    proc = Proc("standin", cmd, tmp_path_factory.mktemp("standin"))
    try:
        assert first_answer(port, "/health", proc) == 200
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        proc.stop()


def run(coro_fn):
    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await coro_fn(session)

    return asyncio.run(main())


def test_the_standin_streams_every_event_asked_for(standin):
    body = completion_body(MODEL, gap_prefix(0) + " go", 4000, True)
    gauge = Gauge()
    x = run(lambda s: exchange(s, standin, body, gauge))
    assert (x.status, x.events, x.done, x.error) == (200, 4000, True, "")
    assert x.started < x.first_byte <= x.first_event <= x.ended
    assert (gauge.max_open, gauge.open_now) == (1, 0)


def test_an_event_split_between_two_reads_is_counted_once():
    """The body arrives in two reads, split inside an event's "data: {"; the server sends the
    second part only once the client has the first (the gauge says so)."""
    first = b'data: {"n":1}\n\ndata: '
    rest = b'{"n":2}\n\ndata: [DONE]\n\n'
    gauge = Gauge()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        w.write(first)
        await w.drain()
        end = time.monotonic() + 30  # only stops a hang
        while not gauge.open_now and time.monotonic() < end:  # the client has the first part
            await asyncio.sleep(0.001)
        w.write(rest)
        await w.drain()
        w.close()

    async def go(session):
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await exchange(session, f"http://127.0.0.1:{port}/", b"", gauge)

    x = run(go)
    assert (x.status, x.events, x.done, x.error) == (200, 2, True, "")


def test_a_short_answer_has_no_events(standin):
    x = run(lambda s: exchange(s, standin, completion_body(MODEL, "hi", 8, False)))
    assert (x.status, x.events, x.done, x.error) == (200, 0, False, "")
    assert x.first_event == 0.0 and x.started < x.first_byte <= x.ended


def test_a_refused_connection_is_a_failed_exchange_not_an_exception():
    url = f"http://127.0.0.1:{free_port()}/v1/completions"
    x = run(lambda s: exchange(s, url, b"{}"))
    assert x.status == 0 and x.error.startswith("Client") and x.ended >= x.started


def test_the_closed_loop_sends_no_more_than_asked(standin):
    body = completion_body(MODEL, gap_prefix(1) + " go", 4, True)
    got, start, end = run(lambda s: closed_loop(s, [standin], body, 4, 20, 60))
    assert len(got) == 20 and all(x.status == 200 and x.events == 4 for x in got)
    assert start <= min(x.started for x in got) and end >= max(x.ended for x in got)


def test_the_open_loop_sends_each_on_time_in_order_and_marks_what_did_not_end(standin):
    quick = completion_body(MODEL, gap_prefix(1) + " go", 2, True)
    endless = completion_body(MODEL, gap_prefix(600_000) + " hold", 2, True)
    arrivals = [0.0, 0.1, 0.2]
    sent = run(lambda s: open_loop(s, standin, [quick, endless, quick], arrivals, 3.0))
    dues = [due for due, _ in sent]
    assert [round(b - a, 3) for a, b in itertools.pairwise(dues)] == [0.1, 0.1]
    assert sent[1][1] is None  # still streaming when the drain ended
    for due, x in (sent[0], sent[2]):
        assert x is not None and x.events == 2 and x.done
        assert x.started >= due - 0.01  # never early; late only by the loop's own delay


def test_a_readiness_wait_ends_when_the_process_dies(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no such model: x'); sys.exit(3)"]
    proc = Proc("dies", cmd, tmp_path)
    url = f"http://127.0.0.1:{free_port()}/health"
    started = time.monotonic()
    with pytest.raises(NotReady, match="dies exited: no such model: x"):
        run(lambda s: wait_ready(s, url, proc, 120))
    assert time.monotonic() - started < 60  # at the death, not at the deadline


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_stop_ends_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; wait"
    proc = Proc("parent", ["sh", "-c", script], tmp_path)
    end = time.monotonic() + 60  # only stops a hang: the file appears as the shell starts
    while not pidfile.exists():
        assert proc.alive() and time.monotonic() < end, proc.tail()
        time.sleep(0.02)
    child = int(pidfile.read_text())
    assert not _gone(child)
    proc.stop()
    end = time.monotonic() + 30  # SIGTERM to the group: the child ends at once
    while not _gone(child):
        assert time.monotonic() < end, f"pid {child} outlived its group's stop()"
        time.sleep(0.02)
    assert not proc.alive()
