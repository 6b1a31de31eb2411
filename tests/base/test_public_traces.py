"""Public traces by name: `traces list`, `traces get` from a local HTTP server, and `--trace NAME`
in the commands that read traces. Nothing here touches the network."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fleetctl.base.public_traces import BUILTIN, CACHE_ENV, REGISTRY_ENV
from harness.procs import Proc
from tests.conftest import DATA, REPO

SLICE = DATA / "azure_conv_slice.csv"
SHARED = REPO.parent / "shared" / "traces"
SHARED_NAMES = {
    "azure-conv-2023": "AzureLLMInferenceTrace_conv.csv",
    "azure-code-2023": "AzureLLMInferenceTrace_code.csv",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
}


class Server:
    """A folder served on 127.0.0.1, and the paths asked for. `/stall/NAME` sends the first
    half of NAME and then holds the connection until `release` is set: a download caught
    mid-way."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.asked: list[str] = []
        self.release = threading.Event()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                server.asked.append(self.path)
                if not self.path.startswith("/stall/"):
                    super().do_GET()
                    return
                body = (server.folder / self.path.removeprefix("/stall/")).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                server.release.wait(120)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=folder))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    folder = tmp_path / "www"
    folder.mkdir()
    (folder / "slice.csv").write_bytes(SLICE.read_bytes())
    s = Server(folder)
    # The socket listens from the constructor on, so requests queue until serve_forever runs.
    threading.Thread(target=s.httpd.serve_forever, daemon=True).start()
    try:
        yield s
    finally:
        s.release.set()
        s.httpd.shutdown()
        s.httpd.server_close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path: Path, server: Server, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache folder, and a registry whose azure-conv-2023 is the slice on the local server
    (size and sha256 of the slice), azure-code-2023 a checksum it does not have, and 'gone' a
    file the server does not hold."""
    body = SLICE.read_bytes()
    entries = [
        {"name": "azure-conv-2023", "url": server.url + "/slice.csv", "size": len(body)},
        {"name": "azure-code-2023", "url": server.url + "/slice.csv", "size": len(body)},
        {
            "name": "gone",
            "file": "gone.csv",
            "url": server.url + "/gone.csv",
            "size": 1,
            "sha256": "0" * 64,
        },
    ]
    entries[0]["sha256"] = sha(body)
    entries[1]["sha256"] = sha(body + b"\n")
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"traces": entries}))
    monkeypatch.setenv(REGISTRY_ENV, str(registry))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    return tmp_path / "cache" / "traces"


def cached_files(cache: Path) -> list[str]:
    """The cache's files but its lock (which writers share while they write)."""
    return sorted(p.name for p in cache.iterdir() if p.name != ".lock") if cache.exists() else []


def one_line_error(r) -> str:
    """The error line of a run that failed with exit 2: one line, after any progress notes."""
    assert r.code == 2, (r.out, r.err)
    lines = r.err.splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in r.err, r.err
    assert all(not line.startswith("error") for line in lines[:-1]), r.err
    return lines[-1]


def test_list_names_each_trace_in_80_columns(cli, monkeypatch, tmp_path):
    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    r = cli("traces", "list")
    assert r.code == 0, r.err
    assert max(len(line) for line in r.out.splitlines()) <= 80
    for t in BUILTIN:
        block = r.out.split(t.name + "  ", 1)[1].split("\n\n")[0]
        assert f"{t.size:,} bytes" in block and t.license in block and "not cached" in block
        assert f"sha256 {t.sha256}" in block and "cite " in block
    assert f"cache: {tmp_path / 'traces'}" in r.out


def test_list_json_has_full_urls_checksums_and_credits(cli, monkeypatch, tmp_path):
    monkeypatch.delenv(REGISTRY_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    r = cli("traces", "list", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert data["cache"] == str(tmp_path / "traces")
    names = [t["name"] for t in data["traces"]]
    assert names == ["azure-conv-2023", "azure-code-2023", "mooncake-conversation"]
    for t in data["traces"]:
        assert t["url"].startswith("https://raw.githubusercontent.com/")
        assert t["url"].endswith("/" + t["file"])
        assert len(t["sha256"]) == 64 and int(t["sha256"], 16) >= 0 and t["size"] > 0
        assert t["license"] in ("CC-BY-4.0", "Apache-2.0") and t["citation"] and t["description"]
        assert t["cached"] is False and t["path"].startswith(str(tmp_path / "traces"))


@pytest.mark.skipif(not SHARED.is_dir(), reason="no shared traces folder here (CI)")
@pytest.mark.parametrize("name", sorted(SHARED_NAMES))
def test_the_registry_matches_the_shared_copies(name):
    """The checksums were taken from these copies; they are the upstream repositories' blobs."""
    t = {t.name: t for t in BUILTIN}[name]
    data = (SHARED / SHARED_NAMES[name]).read_bytes()
    assert (len(data), sha(data)) == (t.size, t.sha256)


def test_get_downloads_checks_and_caches_then_does_nothing(cli, cache, server):
    r = cli("traces", "get", "azure-conv-2023")
    assert r.code == 0, r.err
    path = cache / "azure-conv-2023.csv"
    assert r.out == f"{path}\n" and "sha256 ok" in r.err
    assert path.read_bytes() == SLICE.read_bytes()
    assert cached_files(cache) == ["azure-conv-2023.csv"]  # no temporary file left behind
    assert server.asked == ["/slice.csv"]
    again = cli("traces", "get", "azure-conv-2023")
    assert again.code == 0 and again.out == r.out and "already cached" in again.err
    assert server.asked == ["/slice.csv"]
    listed = json.loads(cli("traces", "list", "--json").out)["traces"]
    assert {t["name"]: t["cached"] for t in listed}["azure-conv-2023"] is True


def test_a_damaged_cached_copy_is_fetched_again(cli, cache, server):
    cache.mkdir(parents=True)
    size = SLICE.stat().st_size
    (cache / "azure-conv-2023.csv").write_bytes(b"x" * size)  # right size, wrong bytes
    r = cli("traces", "get", "azure-conv-2023")
    assert r.code == 0, r.err
    assert (cache / "azure-conv-2023.csv").read_bytes() == SLICE.read_bytes()
    assert server.asked == ["/slice.csv"]


def test_a_checksum_mismatch_is_refused_and_nothing_is_cached(cli, cache):
    err = one_line_error(cli("traces", "get", "azure-code-2023"))
    assert "/slice.csv: azure-code-2023: " in err and "not cached" in err
    assert cached_files(cache) == []


def test_a_missing_download_is_one_line_and_caches_nothing(cli, cache):
    err = one_line_error(cli("traces", "get", "gone"))
    assert "HTTP 404" in err and "--from FILE" in err
    assert cached_files(cache) == []


def test_from_takes_a_copy_on_disk_checked_the_same_way(cli, cache, server, tmp_path):
    wrong = tmp_path / "wrong.csv"
    wrong.write_bytes(SLICE.read_bytes().replace(b"1", b"2", 1))
    err = one_line_error(cli("traces", "get", "azure-conv-2023", "--from", wrong))
    assert "sha256" in err and str(wrong) in err
    assert cached_files(cache) == []
    err = one_line_error(cli("traces", "get", "azure-conv-2023", "--from", tmp_path / "nope"))
    assert "cannot read the trace copy" in err
    r = cli("traces", "get", "azure-conv-2023", "--from", SLICE)
    assert r.code == 0, r.err
    assert (cache / "azure-conv-2023.csv").read_bytes() == SLICE.read_bytes()
    assert server.asked == []  # nothing downloaded


def test_simulate_trace_name_reads_the_cached_copy(cli, cache):
    args = ("simulate", "example:seed-mixed-8b", "--policies", "round-robin", "--json")
    err = one_line_error(cli(*args, "--trace", "azure-conv-2023"))
    assert "not downloaded" in err and "run `fleetctl traces get azure-conv-2023`" in err
    assert cli("traces", "get", "azure-conv-2023").code == 0
    by_name = cli(*args, "--trace", "azure-conv-2023")
    assert by_name.code == 0, by_name.err
    by_path = cli(*args, "--trace", SLICE)
    assert json.loads(by_name.out)["requests"] == json.loads(by_path.out)["requests"] > 0


@pytest.mark.parametrize(
    "args",
    [
        ("simulate", "example:seed-mixed-8b", "--trace"),
        ("plan", "example:seed-mixed-8b", "--workload-from"),
        ("plan", "example:seed-mixed-8b", "--what-if"),
        ("apply", "example:seed-mixed-8b", "--gate"),
    ],
)
def test_every_trace_option_takes_a_name(cli, cache, args):
    err = one_line_error(cli(*args, "azure-conv-2023"))
    assert "run `fleetctl traces get azure-conv-2023`" in err
    err = one_line_error(cli(*args, "azure-conv"))
    assert "no public trace named 'azure-conv'" in err
    assert "did you mean 'azure-conv-2023'? see `fleetctl traces list`" in err


def test_an_unknown_name_points_at_the_list(cli, cache):
    err = one_line_error(cli("traces", "get", "sharegpt-4o"))
    assert "no public trace named 'sharegpt-4o'" in err and "(see `fleetctl traces list`)" in err
    # A path that is not there is still the loader's to report, as before names existed.
    r = cli("simulate", "example:seed-mixed-8b", "--trace", "missing/trace.csv")
    assert "cannot read trace" in one_line_error(r)


def test_a_broken_registry_file_is_one_line(cli, cache, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "x", "colour": "red"}]))
    monkeypatch.setenv(REGISTRY_ENV, str(bad))
    assert "unknown field 'colour'" in one_line_error(cli("traces", "list"))
    bad.write_text(json.dumps([{"name": "x", "url": "http://127.0.0.1/x"}]))
    assert "a new trace needs" in one_line_error(cli("traces", "list"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "./../../escaped3"), ("name", "../escaped"), ("file", "../../escaped.csv")],
)
def test_a_registry_name_that_leaves_the_cache_is_refused(
    cli, cache, server, tmp_path, monkeypatch, field, value
):
    """A name or file name from the registry becomes a path in the cache: one that is not a
    plain name is refused, naming the registry entry, before anything is downloaded or
    written (the old code wrote `./../../escaped3` beside the cache, exit 0)."""
    body = SLICE.read_bytes()
    entry = {"name": "evil", "file": "evil.csv", "url": server.url + "/slice.csv"}
    entry |= {"size": len(body), "sha256": sha(body), field: value}
    registry = tmp_path / "evil.json"
    registry.write_text(json.dumps({"traces": [entry]}))
    monkeypatch.setenv(REGISTRY_ENV, str(registry))
    before = sorted(tmp_path.rglob("*"))
    for args in (("traces", "get", entry["name"]), ("traces", "list")):
        err = one_line_error(cli(*args))
        assert f"{registry}: traces[0].{field}: " in err and "not a valid name" in err, err
    assert sorted(tmp_path.rglob("*")) == before
    assert server.asked == []


def stalled_download(cache: Path, server: Server, tmp_path: Path) -> tuple[Proc, Path]:
    """`fleetctl traces get` in a process of its own, caught mid-download: its partial file is
    in the cache and the server holds the rest back."""
    body = SLICE.read_bytes()
    entry = {"name": "slow", "file": "slow.csv", "url": server.url + "/stall/slice.csv"}
    entry |= {"size": len(body), "sha256": sha(body)}
    registry = tmp_path / "slow.json"
    registry.write_text(json.dumps({"traces": [entry]}))
    env = {REGISTRY_ENV: str(registry), CACHE_ENV: os.environ[CACHE_ENV]}
    cmd = [sys.executable, "-m", "fleetctl", "traces", "get", "slow"]
    before = set(cache.glob(".*.part"))
    proc = Proc(f"traces-get-{len(server.asked)}", cmd, tmp_path, env=env, own_group=False)
    end = time.monotonic() + 60
    while not (parts := list(set(cache.glob(".*.part")) - before)):
        assert proc.alive(), proc.tail()
        assert time.monotonic() < end, "no partial file appeared"
        time.sleep(0.02)
    return proc, parts[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_download_stopped_by_a_signal_leaves_no_partial_file(cache, server, tmp_path, sig):
    proc, part = stalled_download(cache, server, tmp_path)
    proc.proc.send_signal(sig)
    assert proc.proc.wait(60) in (128 + sig, 130), proc.tail()
    assert "Traceback" not in proc.tail(), proc.tail()
    assert not part.exists() and cached_files(cache) == [], cached_files(cache)


def test_a_partial_file_of_a_killed_download_is_removed_by_the_next_run(
    cli, cache, server, tmp_path
):
    """SIGKILL runs nothing in the process, so its partial file stays until the next command
    that uses the cache finds its writer gone; a live writer's is left alone."""
    proc, part = stalled_download(cache, server, tmp_path)
    proc.proc.kill()
    proc.proc.wait(60)
    assert part.exists()  # nothing can run in a process killed so
    live, live_part = stalled_download(cache, server, tmp_path)
    try:
        assert not part.exists()  # the second download's start removed the dead one's
        assert cli("traces", "list").code == 0
        assert live_part.exists()  # its writer is alive
    finally:
        live.proc.kill()
        live.proc.wait(60)
    r = cli("traces", "get", "azure-conv-2023")
    assert r.code == 0, r.err
    assert cached_files(cache) == ["azure-conv-2023.csv"]
