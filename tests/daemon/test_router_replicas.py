"""Several `fleetctl route-serve` replicas acting as one router: real replicas, a real
redis-server and two stand-in backends (an A100 serving bf16, an RTX 4090 serving int4),
driven by the session load generator of benchmarks/router_replicas.py. Each turn of a session
goes to the next replica, so a replica that did not learn a pin sends the turn to the wrong
class half the time. Waits are on events (a count of answered turns, /health, /metrics); the
time limits only stop a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleetctl.routing.sessions import session_key
from harness.replicas import (
    Drive,
    Redis,
    RouteServe,
    Turn,
    backend_entries,
    changed,
    client_session,
    start_backends,
    store_status,
)
from tests.daemon.test_route_serve import redis_server_binary

LIMIT_S = 120  # only stops a hang


@pytest.fixture(scope="module")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, str]]]:
    redis_server_binary()  # installed here when missing
    procs, urls = start_backends(tmp_path_factory.mktemp("backends"), None)
    try:
        yield backend_entries(urls)
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    r = Redis(tmp_path)
    try:
        yield r
    finally:
        r.stop()


def replicas(
    tmp_path: Path, backends: list[dict[str, str]], url: str, n: int = 3
) -> list[RouteServe]:
    return [
        RouteServe(tmp_path, f"replica-{i}", backends, "--session-store", url) for i in range(n)
    ]


async def until(what: str, check: Callable[[], bool]) -> None:
    """Poll `check` off the event loop until it holds."""
    end = time.monotonic() + LIMIT_S
    while not await asyncio.to_thread(check):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def answered(drive: Drive, task: asyncio.Task[list[Turn]], n: int) -> None:
    """Until `n` more turns were answered."""
    goal = len(drive.turns_done) + n
    end = time.monotonic() + LIMIT_S
    while len(drive.turns_done) < goal:
        assert not task.done(), task.result() if not task.exception() else task.exception()
        assert time.monotonic() < end, "the load generator stalled"
        await asyncio.sleep(0.02)


def cut(r: RouteServe) -> float:
    """Waits on the store this replica cut at their bound (50 ms): a read given up, or an
    answer that left before its new pin reached Redis. Only these may move a session's turn
    to another class while Redis is up (a busy machine can delay Redis that long)."""
    return sum(
        r.metric(f'fleetctl_session_store_pins_total{{event="{e}"}}') or 0
        for e in ("read_timeout", "write_timeout")
    )


def stop_all(reps: list[RouteServe]) -> None:
    for r in reps:
        r.stop()


def test_turns_keep_their_class_whichever_replica_while_one_dies_and_one_restarts(
    tmp_path: Path, backends: list[dict[str, str]], redis: Redis
) -> None:
    reps = replicas(tmp_path, backends, redis.url)
    marks: dict[str, float] = {}
    gave_up = [0.0]

    async def go() -> list[Turn]:
        async with client_session(16) as client:
            drive = Drive([r.url for r in reps], conc=16, total=10**9, turns=4, tag="rr")
            task = asyncio.create_task(drive.run(client))
            await answered(drive, task, 800)
            # Replica 2 restarts (SIGTERM, then a fresh process on the same port).
            gave_up[0] += await asyncio.to_thread(cut, reps[2])
            await asyncio.to_thread(reps[2].stop)
            await answered(drive, task, 400)
            await asyncio.to_thread(reps[2].start)
            marks["restarted"] = time.monotonic()
            await answered(drive, task, 800)
            # Replica 1 dies (SIGKILL): its sessions go on at replicas 0 and 2.
            gave_up[0] += await asyncio.to_thread(cut, reps[1])
            await asyncio.to_thread(reps[1].kill)
            marks["killed"] = time.monotonic()
            await answered(drive, task, 800)
            drive.stop = True
            turns = await task
            for r in (reps[0], reps[2]):
                gave_up[0] += await asyncio.to_thread(cut, r)
            return turns

    try:
        turns = asyncio.run(go())
    finally:
        stop_all(reps)
    assert all(t.status == 200 for t in turns), [t for t in turns if t.status != 200][:3]
    moved, compared = changed(turns)
    # Zero on an idle machine; never more than the waits the bound cut, each counted.
    assert compared > 2000 and moved <= gave_up[0], (moved, gave_up)
    # The restarted replica answered turns of sessions pinned before it started, the killed
    # replica's sessions went on elsewhere (their turns failed over), all on their class.
    fresh = [t for t in turns if t.replica == 2 and t.sent > marks["restarted"] and t.turn > 0]
    assert fresh
    assert any(t.failovers for t in turns if t.sent > marks["killed"])
    for r in reps:
        assert "session store" not in r.log_text(), r.log_text()[-2000:]


def test_redis_killed_mid_traffic_then_restarted(
    tmp_path: Path, backends: list[dict[str, str]], redis: Redis
) -> None:
    reps = replicas(tmp_path, backends, redis.url)
    marks: dict[str, float] = {}

    def all_say(status: str) -> bool:
        return all(store_status(r) == status for r in reps)

    def converged() -> bool:
        return all_say("ok") and all(
            r.metric("fleetctl_session_store_pending_pins") == 0 for r in reps
        )

    async def go() -> list[Turn]:
        async with client_session(16) as client:
            drive = Drive([r.url for r in reps], conc=16, total=10**9, turns=4, tag="kill")
            task = asyncio.create_task(drive.run(client))
            await answered(drive, task, 800)
            marks["cut before"] = sum([await asyncio.to_thread(cut, r) for r in reps])
            marks["killed"] = time.monotonic()
            await asyncio.to_thread(redis.kill)
            await until("every replica to report the store degraded", lambda: all_say("degraded"))
            for r in reps:
                status, body = r.health()
                store = body["session_store"]
                assert status == 200 and body["status"] == "degraded"
                assert store["reason"] and store["down_s"] >= 0
                assert r.metric("fleetctl_session_store_up") == 0
                assert r.metric("fleetctl_session_store_outages_total") == 1
            await answered(drive, task, 800)
            await asyncio.to_thread(redis.start)  # empty: it kept nothing
            marks["restarted"] = time.monotonic()
            await until("the replicas to agree again", converged)
            marks["converged"] = time.monotonic()
            await answered(drive, task, 1200)
            drive.stop = True
            return await task

    try:
        turns = asyncio.run(go())
        logs = [r.log_text() for r in reps]
        pins = [r.metric('fleetctl_session_store_pins_total{event="written"}') for r in reps]
        cut_all = sum(cut(r) for r in reps)
    finally:
        stop_all(reps)
    assert all(t.status == 200 for t in turns), [t for t in turns if t.status != 200][:3]
    # Agreement: before the kill, and from the moment every replica sent what it decided
    # meanwhile (within 10 s of the restart here, usually well under one).
    # (never more than the waits the bound cut, each counted: zero on an idle machine)
    assert changed(turns, lambda t: t.ended < marks["killed"])[0] <= marks["cut before"]
    after = changed(turns, lambda t: t.sent >= marks["converged"])
    assert after[1] > 500 and after[0] <= cut_all
    assert marks["converged"] - marks["restarted"] < 10
    for log in logs:  # said once each way, never per request
        assert log.count("session store down") == 1 and log.count("session store back") == 1
        assert "session store:" not in log
    assert all(p and p > 0 for p in pins)


def test_a_request_never_waits_long_on_a_stuck_redis(
    tmp_path: Path, backends: list[dict[str, str]], redis: Redis
) -> None:
    (r,) = replicas(tmp_path, backends, redis.url, 1)
    assert redis.proc is not None
    try:

        async def go() -> list[Turn]:
            async with client_session(8) as client:
                await until("the store", lambda: store_status(r) == "ok")
                os.kill(redis.proc.pid, signal.SIGSTOP)  # Redis hangs: no answer, no error
                try:
                    drive = Drive([r.url], conc=8, total=400, turns=2, tag="stuck")
                    turns = await drive.run(client)
                    await until(
                        "the replica to report the store", lambda: store_status(r) == "degraded"
                    )
                finally:
                    os.kill(redis.proc.pid, signal.SIGCONT)
                await until("the store back", lambda: store_status(r) == "ok")
                return turns

        turns = asyncio.run(go())
    finally:
        r.stop()
    assert all(t.status == 200 for t in turns)
    # Reads wait 50 ms at most; until the store is called down (1 s socket timeout) a new
    # session's first turn may wait that long, never the socket's timeout.
    slowest = max(t.ended - t.sent for t in turns)
    assert slowest < 0.9, slowest


def test_workers_share_one_port_and_their_sessions(
    tmp_path: Path, backends: list[dict[str, str]], redis: Redis
) -> None:
    rs = RouteServe(tmp_path, "workers", backends, "--session-store", redis.url, "--workers", "2")
    try:
        seen = set()
        end = time.monotonic() + LIMIT_S
        while seen != {0, 1}:  # each /health a new connection: the kernel spreads them
            assert time.monotonic() < end, seen
            seen.add(rs.health()[1]["worker"])

        async def go() -> list[Turn]:
            async with client_session(16) as client:
                return await Drive([rs.url], conc=16, total=2000, turns=4, tag="w").run(client)

        turns = asyncio.run(go())
        assert all(t.status == 200 for t in turns)
        moved, compared = changed(turns)
        assert compared > 1000 and moved == 0
        assert rs.proc is not None
        pid = rs.proc.pid
        children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert len(children) == 2
        os.kill(pid, signal.SIGTERM)  # to route-serve alone: it stops its workers
        assert rs.proc.proc.wait(LIMIT_S) == 0
        for child in children:
            assert not Path(f"/proc/{child}").exists()
    finally:
        rs.stop()


def test_workers_without_a_store_warn_that_pins_are_per_worker(
    tmp_path: Path, backends: list[dict[str, str]]
) -> None:
    rs = RouteServe(tmp_path, "alone", backends, "--workers", "2")
    try:
        assert "pins" in rs.log_text() and "--session-store" in rs.log_text()
    finally:
        rs.stop()


def test_the_issue_load_loses_no_pin(
    tmp_path: Path, backends: list[dict[str, str]], redis: Redis
) -> None:
    """48,000 requests at 32 concurrent through two replicas sharing one store (the load that
    ran the old client's pool dry): no `session store` line in either log, and every session's
    pin is in Redis, the one its turns followed."""
    import redis as redis_client

    reps = replicas(tmp_path, backends, redis.url, 2)

    async def go() -> list[Turn]:
        async with client_session(32) as client:
            urls = [r.url for r in reps]
            return await Drive(urls, conc=32, total=48_000, turns=4, tag="load").run(client)

    try:
        turns = asyncio.run(go())
        counts = {
            e: sum(r.metric(f'fleetctl_session_store_pins_total{{event="{e}"}}') or 0 for r in reps)
            for e in ("dropped", "read_timeout")
        }
        logs = [r.log_text() for r in reps]
        gave_up = sum(cut(r) for r in reps)
    finally:
        stop_all(reps)
    assert all(t.status == 200 for t in turns)
    assert changed(turns)[0] <= gave_up  # zero on an idle machine
    assert counts["dropped"] == 0
    for log in logs:
        assert "session store" not in log
    db = redis_client.Redis.from_url(redis.url)
    first = {t.session: t.node_class for t in turns if t.turn == 0}
    last = {t.session: t.node_class for t in sorted(turns, key=lambda t: t.turn)}
    stored = {}
    named = {session_key(f"load-{s}"): s for s in first}  # Redis holds digests of the ids
    for key in db.scan_iter(match="fleetctl:default:session:*", count=1000):
        s = named[key.decode().rsplit(":", 1)[1]]
        stored[s] = db.get(key).decode().split("\n")[1]
    db.close()
    assert len(first) >= 12_000  # 48,000 turns, 4 a session (the last ones cut short)
    assert (
        stored == last
    )  # the pin the session's last turn followed (its first's, but for a cut wait)


def test_last_writer_wins_per_session_by_version(redis: Redis) -> None:
    """Two replicas write one session's pin: Redis keeps the later version, whichever
    arrives last, and the replica whose pin lost adopts the winner (a counted conflict)."""
    from fleetctl.daemon.shared import RedisShared, decode_pin
    from fleetctl.routing.sessions import Pin

    async def go() -> tuple[RedisShared, RedisShared, str, bytes]:
        a, b = RedisShared(redis.url, "lww"), RedisShared(redis.url, "lww")
        tasks = [asyncio.create_task(x.run()) for x in (a, b)]
        try:
            for x in (a, b):
                await asyncio.wait_for(x.subscribed.wait(), LIMIT_S)
            older = a.stamp()
            b.saw(older)
            newer = b.stamp()
            assert newer > older
            rtx, a100 = Pin("RTX-4090/gptq-int4", "rtx-1"), Pin("A100-SXM4-80GB/bf16", "a100-1")
            b.sessions.adopt("s1", rtx, newer)  # b decided later; its write lands first
            b.queue_pin("s1", rtx, newer)
            end = time.monotonic() + LIMIT_S
            while a.sessions.get("s1") != rtx:  # a hears it through the pins channel
                assert time.monotonic() < end
                await asyncio.sleep(0.01)
            a.sessions.pins["s1"] = a100  # as if a had decided earlier, and sends it late
            a.sessions.known["s1"].stamp = older
            a.queue_pin("s1", a100, older)
            while a.counts["conflicts"] < 1:
                assert time.monotonic() < end
                await asyncio.sleep(0.01)
            raw = await a.client.get(a.key("s1"))
            return a, b, newer, raw
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for x in (a, b):
                await x.close()

    a, b, newer, raw = asyncio.run(go())
    assert decode_pin(raw) == (newer, Pin("RTX-4090/gptq-int4", "rtx-1"))
    assert a.sessions.get("s1") == Pin("RTX-4090/gptq-int4", "rtx-1")
    assert b.counts["conflicts"] == 0 and a.counts["applied"] == 1
