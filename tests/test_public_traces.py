"""Public traces by name: `traces list`, `traces get` from a local HTTP server, and `--trace NAME`
in the commands that read traces. Nothing here touches the network."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fleetctl.base.public_traces import BUILTIN, CACHE_ENV, REGISTRY_ENV
from tests.conftest import REPO

SLICE = REPO / "tests" / "data" / "azure_conv_slice.csv"
SHARED = REPO.parent / "shared" / "traces"
SHARED_NAMES = {
    "azure-conv-2023": "AzureLLMInferenceTrace_conv.csv",
    "azure-code-2023": "AzureLLMInferenceTrace_code.csv",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
}


class Server:
    """A folder served on 127.0.0.1, and the paths asked for."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.asked: list[str] = []
        server = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                server.asked.append(self.path)
                super().do_GET()

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
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


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
