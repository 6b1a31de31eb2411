"""route-serve following a state folder: a state or health file that cannot be used is
refused in one line each time, the last good backends keep serving, the next good write is
picked up, and SIGHUP and SIGTERM stay clean."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.daemon.test_route_serve import INVENTORY, Router, _backend_count, _wait_for
from tests.procs import NAME, Emulator, free_port

FAILED = "reload failed, keeping the last good backends: "


@pytest.fixture(scope="module")
def emus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state-reload")
    two = [Emulator(tmp), Emulator(tmp)]
    try:
        for e in two:
            e.wait_healthy()
        yield two
    finally:
        for e in two:
            e.stop()


def _inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        INVENTORY.replace(
            "  - name: rtx-[1:4]\n", "  - name: rtx-[1:4]\n    host: 127.0.0.[1:4]\n"
        ).replace("  - name: a100-1\n", "  - name: a100-1\n    host: 127.0.9.1\n")
    )
    return inv


def _deployments(inv: Path, emus: list[Emulator]):  # type: ignore[no-untyped-def]
    """One RTX-4090 deployment of the plan per emulator, pointed at it."""
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.model.catalog import load_catalog
    from fleetctl.planner import plan_fleet

    plan = plan_fleet(load_inventory(inv, load_catalog()))
    rtx = [d for d in plan.deployments if d.gpu_type == "RTX-4090"]
    return [
        dataclasses.replace(d, host="127.0.0.1", port=e.port)
        for d, e in zip(rtx, emus, strict=False)
    ]


def _start(inv: Path, state_dir: Path, log: Path, *extra: str) -> Router:
    port = free_port()
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv), "--state-dir", str(state_dir)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--listen", f"127.0.0.1:{port}", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    r = Router.__new__(Router)
    r.port, r.proc, r.log = port, proc, log
    end = time.monotonic() + 60  # only stops a hang: it answers as soon as it listens
    while True:
        try:
            _backend_count(r)
            return r
        except OSError:
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.05)


def _put(path: Path, text: str) -> None:
    """Write `text` in one step (a rename), so the watch never sees half of it: each write is
    one change, and one failed reload."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text)
    tmp.replace(path)


def _failures(r: Router) -> list[str]:
    return [line for line in r.log.read_text().splitlines() if FAILED in line]


def _classes(r: Router) -> set[str]:
    """The node class of every backend, as /metrics labels them."""
    return {
        line.split('node_class="', 1)[1].split('"', 1)[0]
        for line in r.metrics().splitlines()
        if line.startswith("fleetctl_backend_up{")
    }


def test_a_bad_state_or_health_file_keeps_the_last_good_backends(emus, tmp_path):
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir

    inv = _inventory(tmp_path)
    one, two = _deployments(inv, emus)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, (one,)))
    # `fleetctl health` found rtx-1 unlike its class: the router gives it a class of its own.
    sdir.health_path.write_text(json.dumps({"format": 1, "equivalent": {one.node: False}}))
    r = _start(inv, sdir.root, tmp_path / "router.log")
    own = f"{one.gpu_type}/{one.variant}/nonequivalent:{one.node}"
    plain = f"{two.gpu_type}/{two.variant}"
    try:
        assert _backend_count(r) == 1 and _classes(r) == {own}
        # A file cut short (as a write that ran out of disk leaves it): refused in one line naming the file and what to do.
        good = sdir.state_path.read_text()
        _put(sdir.state_path, good[: len(good) // 2])
        _wait_for(lambda: len(_failures(r)) == 1, "the failed reload's line")
        (line,) = _failures(r)
        assert f"{sdir.state_path}: the state file is not usable: not JSON" in line
        assert line.endswith("then adopts the servers that run)"), line
        # ... and the last good state goes on serving.
        status, headers, _ = r.complete()
        assert status == 200 and headers["X-Fleet-Class"] == own
        # A file that cannot be read at all (here a symlink to itself) is an operational
        # failure, not a mistake in the file: refused all the same.
        loop = sdir.root / "loop"
        loop.symlink_to(sdir.state_path.name)
        loop.replace(sdir.state_path)
        _wait_for(lambda: len(_failures(r)) == 2, "the unreadable file's line")
        line = _failures(r)[-1]
        assert f"{sdir.state_path}: cannot read the state file: Too many levels" in line, line
        assert line.endswith("(check that it is a file this user can read)"), line
        # Every failure is said again, on SIGHUP too, without a traceback.
        r.proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: len(_failures(r)) == 3, "the third failed reload's line")
        assert r.complete()[0] == 200
        # The next good write is picked up.
        sdir.save_state(State(2, (one, two)))
        _wait_for(lambda: _backend_count(r) == 2, "the reload of the mended state")
        assert _classes(r) == {own, plain}
        # A health record of another format is refused too, and its last good one kept.
        _put(sdir.health_path, json.dumps({"format": 2, "equivalent": {}}))
        _wait_for(lambda: len(_failures(r)) == 4, "the refused health record's line")
        line = _failures(r)[-1]
        assert f"{sdir.health_path}: the health record is not usable: format 2" in line, line
        assert "(run `fleetctl health` to write it again)" in line
        assert _backend_count(r) == 2 and _classes(r) == {own, plain}
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(30) == 0, r.log.read_text()
    finally:
        r.stop()
    text = r.log.read_text()
    assert "Traceback" not in text and "Exception" not in text, text


def test_a_state_file_that_is_not_a_regular_file_never_stops_the_router(emus, tmp_path):
    """A FIFO in state.json's place: opening it waits for a writer, and route-serve reloads
    in its event loop, so before it stopped answering anything. A device (/dev/zero) was read
    for 64 MiB before being refused. Both are refused at once, in one line each, and the last
    good backends go on serving."""
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir

    inv = _inventory(tmp_path)
    one, _ = _deployments(inv, emus)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, (one,)))
    r = _start(inv, sdir.root, tmp_path / "router.log")
    try:
        fifo = sdir.root / "fifo"
        os.mkfifo(fifo)
        fifo.replace(sdir.state_path)
        _wait_for(lambda: len(_failures(r)) == 1, "the FIFO's line", timeout=20)
        assert "cannot read the state file: not a regular file" in _failures(r)[-1]
        assert r.complete()[0] == 200
        zero = sdir.root / "zero"
        zero.symlink_to("/dev/zero")
        zero.replace(sdir.state_path)
        _wait_for(lambda: len(_failures(r)) == 2, "the device's line", timeout=20)
        assert "cannot read the state file: not a regular file" in _failures(r)[-1]
        assert _backend_count(r) == 1 and r.complete()[0] == 200
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(30) == 0, r.log.read_text()
    finally:
        r.stop()


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("health.json", '{"format": 2, "equivalent": {}}', "the health record is not usable"),
        ("health.json", '{"format": 1, "equivalent": [', "the health record is not usable"),
        ("state.json", '{"format": true}', "the state file is not usable: format: expected"),
    ],
    ids=["health-newer", "health-cut", "state-format-true"],
)
def test_route_serve_refuses_a_bad_file_at_start(tmp_path, name, text, words):
    inv = _inventory(tmp_path)
    (tmp_path / ".fleetctl").mkdir()
    (tmp_path / ".fleetctl" / name).write_text(text)
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv)]
    r = subprocess.run(
        [*cmd, "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and name in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_route_serve_refuses_a_request_log_key_that_is_not_a_regular_file(tmp_path):
    """The request log's key read through the same door as the state files: a FIFO there
    kept route-serve from ever listening, a device (/dev/zero) was read without end."""
    inv = _inventory(tmp_path)
    requests = tmp_path / ".fleetctl" / "requests"
    requests.mkdir(parents=True)
    os.mkfifo(requests / ".key", 0o600)
    backends = tmp_path / "backends.json"
    entry = {"url": "http://127.0.0.1:9", "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME}
    backends.write_text(json.dumps({"backends": [entry]}))
    cmd = [sys.executable, "-m", "fleetctl", "route-serve", str(inv), "--backends", str(backends)]
    r = subprocess.run(
        [*cmd, "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,  # only stops the hang it had
    )
    assert r.returncode == 2, r.stderr
    assert "cannot keep the request log: not a regular file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
