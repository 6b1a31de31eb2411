"""route-serve's request log: one line per finished request, no text ever, bounded on disk."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import pytest

from fleetctl.base.errors import UserError
from fleetctl.daemon.request_log import KEY_FILE, RequestLog, file_name
from fleetctl.fleet.inventory import RequestLogSpec
from fleetctl.routing.blocks import text_blocks, token_blocks
from fleetctl.routing.types import Backend, Request
from fleetctl.sim.workload import load_trace
from tests.daemon.test_route_serve import CAPTURE, Router
from tests.daemon.test_router_hostile import Hostile
from tests.procs import NAME

MARKER = "qzxv-secret-marker-7731"
# Words of the prompt and of the answer: none may reach any file under the state folder.
PROMPT_WORDS = ["pelican", "tangerine", "obsidian", "marmalade", "quixotic", "zeppelin"]
MOONCAKE = {"timestamp", "input_length", "output_length", "hash_ids"}
MORE = {
    "block_tokens",
    "model",
    "adapter",
    "max_tokens",
    "session",
    "priority",
    "precision",
    "backend",
    "class",
    "ttft_s",
    "e2e_s",
    "status",
    "outcome",
    "format",
}


def prompt_text(body: dict) -> str:
    if "messages" in body:
        return "\n".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


class Echo(Hostile):
    """A real HTTP backend that answers each completion with its prompt, whole or streamed,
    and says how many tokens it made: the answer carries the client's text back."""

    async def _one(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        head = await r.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        raw = await r.readexactly(length)
        if head.startswith(b"GET /metrics"):
            page = CAPTURE.encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page))
            return True
        if head.startswith(b"GET"):
            body = json.dumps({"object": "list", "data": [{"id": NAME}]}).encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            return True
        req = json.loads(raw)
        text = f"echo {MARKER} {prompt_text(req)}"
        tokens = max(1, len(prompt_text(req)) // 4)
        usage = {"prompt_tokens": tokens, "completion_tokens": 7, "total_tokens": tokens + 7}
        if not req.get("stream"):
            body = json.dumps(
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text}],
                    "usage": usage,
                }
            ).encode()
            w.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            return True
        w.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        events = [
            b"data: " + json.dumps({"choices": [{"index": 0, "text": word}]}).encode() + b"\n\n"
            for word in text.split()[:5]
        ] + [b"data: [DONE]\n\n"]
        for e in events:
            w.write(b"%x\r\n%s\r\n" % (len(e), e))
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True


@pytest.fixture(scope="module")
def echo():
    s = Echo()
    try:
        yield s
    finally:
        s.loop.call_soon_threadsafe(s.loop.stop)


def backends(echo: Echo) -> list[dict]:
    return [
        {
            "url": f"http://127.0.0.1:{echo.port}",
            "node": "n0",
            "gpu_type": "RTX-4090",
            "model": NAME,
            "max_model_len": 4096,
        }
    ]


def lines(folder: Path) -> list[dict]:
    out = []
    for p in sorted(folder.glob("*.jsonl")):
        out += [json.loads(x) for x in p.read_text().splitlines() if x]
    return out


def wait_lines(folder: Path, n: int, deadline_s: float = 10) -> list[dict]:
    """The log's lines once there are `n` (route-serve flushes each second)."""
    end = time.monotonic() + deadline_s
    while True:
        got = lines(folder) if folder.is_dir() else []
        if len(got) >= n or time.monotonic() > end:
            return got
        time.sleep(0.1)


def words(n: int) -> str:
    return " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(n))


def test_route_serve_logs_one_line_per_finished_request_and_never_text(tmp_path, echo):
    router = Router(tmp_path, backends(echo), name="logged")
    state = tmp_path / ".fleetctl"
    folder = state / "requests"
    prompt = f"{MARKER} {words(120)}"
    try:
        s1, _, a1 = router.complete(prompt=prompt, max_tokens=9, headers={"X-Session-ID": MARKER})
        s2, _, a2 = router.complete(prompt=prompt, max_tokens=9, stream=True)
        s3, _, a3 = router.request(
            "POST",
            "/v1/chat/completions",
            {
                "model": NAME,
                "messages": [{"role": "user", "content": prompt + " more words"}],
                "max_tokens": 5,
                "priority": 3,
                "user": f"user-{MARKER}",
            },
            {"X-Fleet-Precision": "bf16"},
        )
        s4, _, _ = router.complete(prompt=prompt, max_tokens=8000)  # refused: too long
        assert (s1, s2, s3, s4) == (200, 200, 200, 400), (a1, a2, a3)
        assert MARKER.encode() in a1 and MARKER.encode() in a2 and MARKER.encode() in a3
        got = wait_lines(folder, 4)
    finally:
        router.stop()
    assert len(got) == 4, got
    for row in got:
        assert set(row) >= MOONCAKE | MORE, row
        assert row["format"] == 1 and row["model"] == NAME
        assert abs(row["timestamp"] / 1000 - time.time()) < 600
        assert all(type(h) is int and 0 <= h < 2**53 for h in row["hash_ids"])
    by_status: dict[int, list[dict]] = {}
    for row in got:
        by_status.setdefault(row["status"], []).append(row)
    assert sorted(by_status) == [200, 400]
    whole, stream, chat = sorted(
        by_status[200], key=lambda r: (r["max_tokens"] != 9, r["output_length"] != 7)
    )
    assert whole["output_length"] == 7 and whole["max_tokens"] == 9
    assert whole["backend"] == f"127.0.0.1:{echo.port}" and whole["class"]
    assert 0 < whole["ttft_s"] <= whole["e2e_s"] < 30
    assert whole["session"] and len(whole["session"]) == 16  # keyed, never the id itself
    assert whole["input_length"] > 100 and whole["hash_ids"]
    assert stream["output_length"] == 5 and stream["session"] is None  # one event a token
    assert chat["priority"] == 3 and chat["precision"] == "bf16" and chat["session"]
    # The same prompt gives the same keyed hashes; a longer one shares their leading run.
    assert whole["hash_ids"] == stream["hash_ids"]
    common = 0
    for a, b in zip(whole["hash_ids"], chat["hash_ids"], strict=False):
        if a != b:
            break
        common += 1
    assert common >= len(whole["hash_ids"]) - 1, (whole["hash_ids"], chat["hash_ids"])
    (refused,) = by_status[400]
    assert refused["backend"] is None and refused["ttft_s"] is None
    # No text: no file under the state folder holds the marker or any prompt word.
    for p in state.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            for w in [MARKER, "user-", "echo", *PROMPT_WORDS]:
                assert w.encode() not in data, (p, w)
    # Owner only: the folder 0700, the log and its key 0600.
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for p in folder.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert (folder / KEY_FILE).is_file()
    # The simulator reads the log as a trace.
    items = load_trace(folder, NAME)
    assert len(items) == 4 and whole["input_length"] in {i.prompt for i in items}
    assert any(i.blocks is not None and i.session for i in items)


def test_no_request_log_keeps_no_files(tmp_path, echo):
    router = Router(tmp_path, backends(echo), "--no-request-log", name="quiet")
    try:
        assert router.complete(prompt=words(30))[0] == 200
        time.sleep(1.5)  # past a flush
    finally:
        router.stop()
    assert not (tmp_path / ".fleetctl" / "requests").exists()


def test_the_inventory_turns_the_log_off_and_bounds_it(tmp_path, echo):
    from tests.daemon.test_route_serve import INVENTORY

    text = INVENTORY.replace(
        "router: {aging: {factor: 1.0, window_s: 30}}",
        "router: {aging: {factor: 1.0, window_s: 30}, request_log: {enabled: false}}",
    )
    assert text != INVENTORY
    router = Router(tmp_path, backends(echo), name="off", inventory=text)
    try:
        assert router.complete(prompt=words(30))[0] == 200
        time.sleep(1.5)
    finally:
        router.stop()
    assert not (tmp_path / ".fleetctl" / "requests").exists()
    with pytest.raises(ValueError, match="max_total_mb"):
        RequestLogSpec(max_file_mb=64, max_total_mb=10)


# --- the writer on its own: rotation, the total bound, restarts --------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1_780_000_000.0  # a fixed UTC day

    def __call__(self) -> float:
        return self.t


def request(i: int, tokens: int = 64) -> Request:
    req = Request(i, NAME, tokens, 16, session=f"s{i % 3}", max_tokens=16)
    req.blocks = token_blocks(list(range(i, i + tokens)))
    return req


BACKEND = Backend("http://user:pw@10.0.0.1:8000", "n1", "RTX-4090", NAME, "bf16", 10_000)


def fill(log: RequestLog, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        log.record(request(i), log.clock(), BACKEND, 0.1, 0.5, 200, 16)


def test_files_rotate_by_size_and_day_and_the_oldest_go_past_the_bound(tmp_path):
    clock = Clock()
    folder = tmp_path / "requests"
    log = RequestLog(folder, 2_000, 6_000, flush_lines=1, clock=clock)
    fill(log, 40)
    day = time.strftime("%Y-%m-%d", time.gmtime(clock.t))
    names = sorted(p.name for p in folder.glob("*.jsonl"))
    assert file_name(day, 0) not in names  # the oldest went
    assert names == sorted(names, key=lambda n: int(n.rpartition("_")[2][:4]))  # write order
    sizes = {p.name: p.stat().st_size for p in folder.glob("*.jsonl")}
    assert all(s <= 2_000 for s in sizes.values()), sizes
    assert sum(sizes.values()) <= 6_000, sizes
    assert log.written == 40 and log.dropped == 0
    kept = lines(folder)
    assert [r["timestamp"] for r in kept] == sorted(r["timestamp"] for r in kept)
    assert "user" not in (folder / names[-1]).read_text()  # no credentials of a backend URL
    assert kept[-1]["backend"] == "10.0.0.1:8000"
    # The next day starts a file of its own, and name order is write order.
    clock.t += 86_400
    fill(log, 1, 100)
    log.close()
    newest = sorted(folder.glob("*.jsonl"))[-1]
    assert newest.name == file_name(time.strftime("%Y-%m-%d", time.gmtime(clock.t)), 0)
    assert sum(p.stat().st_size for p in folder.glob("*.jsonl")) <= 6_000


def test_a_restart_appends_to_the_last_file_with_the_same_key(tmp_path):
    clock = Clock()
    folder = tmp_path / "requests"
    log = RequestLog(folder, 1 << 20, 1 << 22, flush_lines=100, clock=clock)
    fill(log, 3)
    assert not list(folder.glob("*.jsonl"))  # buffered until a flush
    log.close()
    again = RequestLog(folder, 1 << 20, 1 << 22, clock=clock)
    fill(again, 3)
    again.close()
    (only,) = folder.glob("*.jsonl")
    rows = lines(folder)
    assert len(rows) == 6
    assert rows[0]["hash_ids"] == rows[3]["hash_ids"]  # one key: the same prompt, same hashes
    assert rows[0]["session"] == rows[3]["session"]
    # Another deployment (another key) gives other hashes for the same prompt.
    other = RequestLog(tmp_path / "other", clock=clock)
    fill(other, 1)
    other.close()
    assert lines(tmp_path / "other")[0]["hash_ids"] != rows[0]["hash_ids"]
    assert stat.S_IMODE(only.stat().st_mode) == 0o600


def test_keyed_hashes_keep_prefixes_and_take_text_chunks_and_wide_hashes(tmp_path):
    log = RequestLog(tmp_path / "r")
    a = text_blocks("x" * 640, 160).hashes
    b = text_blocks("x" * 640 + "y" * 640, 320).hashes
    ka, kb = log.keys.blocks(a), log.keys.blocks(b)
    assert ka == kb[: len(ka)] and len(set(kb)) == len(kb)
    assert not set(ka) & {h & (2**53 - 1) for h in a}
    wide = log.keys.blocks([2**200 + 5, -1, 0])
    assert all(0 <= h < 2**53 for h in wide)
    assert log.keys.session("abc") != log.keys.session("abd")


def test_a_failing_disk_drops_lines_without_failing_requests(tmp_path):
    clock = Clock()
    folder = tmp_path / "r"
    log = RequestLog(folder, flush_lines=1, clock=clock)
    blocker = folder / file_name(time.strftime("%Y-%m-%d", time.gmtime(clock.t)), 0)
    blocker.mkdir()  # the day's file cannot be opened (even by root)
    fill(log, 2)
    assert log.dropped == 2 and log.written == 0
    blocker.rmdir()
    fill(log, 1)
    assert log.written == 1 and len(lines(folder)) == 1


def test_a_link_or_fifo_planted_in_the_folder_is_never_written_through(tmp_path):
    """Before, the day's file was opened through a planted link: the target outside the
    folder was appended to and made 0600."""
    clock = Clock()
    folder = tmp_path / "r"
    folder.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    outside.chmod(0o644)
    day = time.strftime("%Y-%m-%d", time.gmtime(clock.t))
    (folder / file_name(day, 0)).symlink_to(outside)
    log = RequestLog(folder, flush_lines=1, clock=clock)
    fill(log, 2)
    assert outside.read_text() == "keep\n" and stat.S_IMODE(outside.stat().st_mode) == 0o644
    assert log.dropped == 2 and log.written == 0
    (folder / file_name(day, 0)).unlink()
    os.mkfifo(folder / file_name(day, 0))  # no reader: an open that waited would hang here
    fill(log, 1)
    assert log.dropped == 3 and log.written == 0
    log.close()


def test_an_unwritable_state_folder_is_a_user_error(tmp_path):
    from fleetctl.daemon.serve import open_request_log

    class Inv:
        class spec:
            class router:
                request_log = RequestLogSpec()

    class Dir:
        requests_path = tmp_path / "file" / "requests"

    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="--no-request-log"):
        open_request_log(Inv, Dir, None)  # type: ignore[arg-type]
    assert open_request_log(Inv, Dir, False) is None  # type: ignore[arg-type]
