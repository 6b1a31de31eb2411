"""SSH failures as operators see them: one line per node, real sockets on loopback, no noise."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleetctl.fleet import ssh
from fleetctl.fleet.ssh import NodeError, SshOptions, SshSession, Target
from tests.conftest import REPO, record_the_plan_as_applied

CONNECT_TIMEOUT_S = 2
NOISE = ("Traceback", "Exception (client)", "paramiko", "Error reading SSH protocol banner")


class Loopback:
    """A TCP server on 127.0.0.1 that accepts every connection, then sends `greeting` (or
    nothing) and keeps the connection open until closed."""

    def __init__(self, greeting: bytes = b""):
        self.greeting = greeting
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.accepted = threading.Event()
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed: the test is over
                return
            self.conns.append(conn)
            if self.greeting:
                conn.sendall(self.greeting)
            self.accepted.set()

    def close(self) -> None:
        # shutdown() wakes the accept() blocked in the thread; close() alone may not.
        for s in (self.server, *self.conns):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self._thread.join(5)


@pytest.fixture
def silent():
    srv = Loopback()
    yield srv
    srv.close()


@pytest.fixture
def garbage():
    srv = Loopback(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    yield srv
    srv.close()


@pytest.fixture
def refused():
    """A loopback port that is bound but not listening: connecting to it is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def options(tmp_path: Path, timeout: float = CONNECT_TIMEOUT_S) -> SshOptions:
    # No ~/.ssh/config: a Host * ProxyJump there must not send test traffic off this machine.
    return SshOptions(
        known_hosts=tmp_path / "known_hosts",
        connect_timeout_s=timeout,
        ssh_config=tmp_path / "no_ssh_config",
    )


def connect(tmp_path: Path, port: int, timeout: float = CONNECT_TIMEOUT_S) -> NodeError:
    with pytest.raises(NodeError) as e:
        SshSession(Target("n1", "127.0.0.1", port), options(tmp_path, timeout)).connect()
    return e.value


# --- the classification, as a pure function ----------------------------------------------------

T = Target("a100-1", "10.0.1.11", 22, "root", "~/.ssh/fleet")
OPTS = SshOptions(known_hosts=Path("/k/known_hosts"), connect_timeout_s=10)


def line(e: BaseException, t: Target = T) -> str:
    return ssh.describe(e, t, OPTS).line()


def test_each_failure_class_is_one_line_with_what_to_do():
    import paramiko

    refused = line(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert refused == (
        "a100-1 (10.0.1.11:22): connection refused: is sshd running there, on port 22?"
    )
    no_route = line(OSError(errno.EHOSTUNREACH, "No route to host"))
    assert no_route.startswith("a100-1 (10.0.1.11:22): no route to host:")
    assert "unreachable" in line(OSError(errno.ENETUNREACH, "Network is unreachable"))
    dns = line(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert "cannot resolve" in dns and "host" in dns
    slow = line(TimeoutError("timed out"))
    assert "no answer within 10 s" in slow and "firewall" in slow
    assert "--accept-new-host-keys" in line(describe_unknown())
    key = paramiko.Ed25519Key.generate() if hasattr(paramiko.Ed25519Key, "generate") else None
    changed = ssh.describe(paramiko.BadHostKeyException("10.0.1.11", key, key), T, OPTS)
    assert changed.kind == "host-key-changed"
    assert "man-in-the-middle" in changed.line() and "ssh-keygen -R 10.0.1.11" in changed.line()
    auth = ssh.describe(paramiko.AuthenticationException("Authentication failed."), T, OPTS)
    assert auth.kind == "auth-failed"
    assert "root" in auth.line() and "~/.ssh/fleet" in auth.line()
    assert "identity_file" in auth.line()
    for e in (refused, no_route, dns, slow):
        assert "\n" not in e


def describe_unknown() -> BaseException:
    from fleetctl.fleet.ssh import UnknownHostKey

    return UnknownHostKey("10.0.1.11")


def test_no_banner_names_the_timeout_and_what_was_said():
    from fleetctl.fleet.ssh import NoBanner

    assert line(NoBanner(b"")) == (
        "a100-1 (10.0.1.11:22): no SSH banner within 10 s: is sshd listening there?"
    )
    said = line(NoBanner(b"HTTP/1.1 400 Bad Request\r\n\r\n"))
    assert "'HTTP/1.1 400 Bad Request'" in said and "port 22 is not sshd's" in said
    closed = line(NoBanner(b"", closed=True))
    assert "closed the connection" in closed


def test_a_failing_jump_host_is_named():
    inner = ssh.describe(ConnectionRefusedError(errno.ECONNREFUSED, "refused"), T, OPTS)
    from fleetctl.fleet.ssh import JumpFailed

    via = Target("a100-1", "10.0.1.11", 22, "root", None, "ops@bastion:2222")
    out = ssh.describe(JumpFailed("ops@bastion:2222", inner), via, OPTS).line()
    assert out.startswith("a100-1 (10.0.1.11:22): via jump host ops@bastion:2222:")
    assert "connection refused" in out


def test_timeouts_are_finite_and_bounded():
    from fleetctl.base.errors import UserError

    for bad in (float("inf"), float("nan"), 0, -1):
        with pytest.raises(UserError):
            SshOptions(connect_timeout_s=bad)
        with pytest.raises(UserError):
            SshOptions(command_timeout_s=bad)
    assert SshOptions(connect_timeout_s=1e300).connect_timeout_s <= 300
    assert SshOptions(command_timeout_s=1e300).command_timeout_s <= 86_400


# --- real sockets on loopback ------------------------------------------------------------------


def test_a_silent_host_fails_within_the_connect_timeout(tmp_path, silent):
    start = time.monotonic()
    e = connect(tmp_path, silent.port)
    took = time.monotonic() - start
    assert silent.accepted.is_set()
    assert e.kind == "timeout"
    assert e.line() == (
        f"n1 (127.0.0.1:{silent.port}): no SSH banner within 2 s: is sshd listening there?"
    )
    # It waited the whole connect timeout for a banner, and not much longer (paramiko alone
    # would wait 15 s): 2 s, with 5 s of margin above for a loaded machine.
    assert CONNECT_TIMEOUT_S - 0.1 <= took < CONNECT_TIMEOUT_S + 5, took


def test_garbage_instead_of_a_banner(tmp_path, garbage):
    start = time.monotonic()
    e = connect(tmp_path, garbage.port)
    assert time.monotonic() - start < CONNECT_TIMEOUT_S + 5
    assert e.kind == "not-ssh"
    assert "'HTTP/1.1 400 Bad Request'" in e.line() and "\n" not in e.line()


def test_a_banner_then_silence_fails_within_the_connect_timeout(tmp_path):
    srv = Loopback(b"SSH-2.0-OpenSSH_9.6\r\n")
    try:
        start = time.monotonic()
        e = connect(tmp_path, srv.port)
        took = time.monotonic() - start
    finally:
        srv.close()
    # The key exchange had what was left of the one deadline: about 2 s in all, not paramiko's
    # own 15 s, and not less than the deadline either.
    assert CONNECT_TIMEOUT_S - 0.1 <= took < CONNECT_TIMEOUT_S + 5, took
    assert e.kind == "timeout"
    assert e.line() == (
        f"n1 (127.0.0.1:{srv.port}): SSH key exchange did not finish within 2 s: "
        "is the host overloaded?"
    )


def test_refused(tmp_path, refused):
    e = connect(tmp_path, refused)
    assert e.kind == "unreachable"
    assert e.line() == (
        f"n1 (127.0.0.1:{refused}): connection refused: is sshd running there, on port {refused}?"
    )


# --- the commands, in a fresh process: what reaches the terminal -------------------------------


def inventory(tmp_path: Path, nodes: dict[str, int], model: bool = False) -> Path:
    lines = [f"ssh: {{user: root, connect_timeout_s: {CONNECT_TIMEOUT_S}}}", "nodes:"]
    for name, port in nodes.items():
        lines += [
            f"  - name: {name}",
            "    host: 127.0.0.1",
            f"    port: {port}",
            "    gpus: {type: RTX-4090, count: 1}",
        ]
    if model:
        lines += [
            "models:",
            "  - name: llama-3-8b",
            "    profile: llama-3-8b",
            "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}",
            "    max_context: 4096",
        ]
    path = tmp_path / "inventory.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def fleetctl(home: Path, *args: object) -> tuple[subprocess.CompletedProcess[str], float]:
    """The real entry point in a fresh process; HOME is the test's, so no ~/.ssh applies."""
    start = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "fleetctl", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(home)},
    )
    return p, time.monotonic() - start


@pytest.mark.parametrize("command", ["probe", "health", "status", "apply", "destroy"])
def test_each_command_prints_one_line_per_broken_node(tmp_path, silent, garbage, refused, command):
    nodes = {"silent-1": silent.port, "garbage-1": garbage.port, "refused-1": refused}
    inv = inventory(tmp_path, nodes, model=command in ("apply", "status"))
    if command == "status":  # status asks the nodes only about servers recorded
        record_the_plan_as_applied(inv)
    extra = ["--yes"] if command in ("apply", "destroy") else []
    p, took = fleetctl(tmp_path, command, inv, "--known-hosts", tmp_path / "known_hosts", *extra)
    both = p.stdout + p.stderr
    assert p.returncode == 1, both
    for noise in NOISE:
        assert noise not in both, both
    expected = {
        "silent-1": f"(127.0.0.1:{silent.port}): no SSH banner within 2 s: is sshd listening there?",
        "garbage-1": f"(127.0.0.1:{garbage.port}): answered 'HTTP/1.1 400 Bad Request'",
        "refused-1": f"(127.0.0.1:{refused}): connection refused",
    }
    for node, text in expected.items():
        hits = [ln for ln in both.splitlines() if node in ln and text in ln]
        assert len(hits) == 1, (node, both)
    # All nodes at once: the silent one is bounded by the connect timeout, not paramiko's 15 s.
    assert took < CONNECT_TIMEOUT_S + 10, took
    if command in ("probe", "health", "status"):
        assert "could not " in both and " 3 of 3 nodes" in both, both


@pytest.mark.parametrize("command", ["apply", "destroy"])
def test_apply_and_destroy_print_each_failure_once_and_never_nothing_to_do(
    tmp_path, refused, command
):
    """One line per failure with node, server and why (not a second one as it happens), and
    a summary that counts what failed rather than saying there was nothing to do."""
    with socket.socket() as other:  # a second refused port: each node its own address
        other.bind(("127.0.0.1", 0))
        ports = {"rtx-1": refused, "rtx-2": other.getsockname()[1]}
        inv = inventory(tmp_path, ports, model=command == "apply")
        args = (command, inv, "--known-hosts", tmp_path / "known_hosts", "--yes")
        p, _ = fleetctl(tmp_path, *args)
    assert p.returncode == 1, p.stdout + p.stderr
    both = p.stdout + p.stderr
    server = " llama-3-8b GPUs 0" if command == "apply" else ""
    for node, port in ports.items():
        hits = [ln for ln in both.splitlines() if f"127.0.0.1:{port}" in ln]
        assert hits == [
            f"failed {node}{server}: unreachable (127.0.0.1:{port}): connection refused: "
            f"is sshd running there, on port {port}?"
        ], both
    assert f"{command}: 0 done; 2 failed." in both and "nothing to do" not in both, both


def test_debug_shows_the_details(tmp_path, garbage):
    inv = inventory(tmp_path, {"garbage-1": garbage.port})
    p, _ = fleetctl(tmp_path, "--debug", "probe", inv, "--known-hosts", tmp_path / "known_hosts")
    assert p.returncode == 1
    assert "Traceback" in p.stderr and "paramiko" in p.stderr


def test_status_of_a_fleet_it_could_not_reach_is_not_ok(tmp_path, refused, silent):
    inv = inventory(tmp_path, {"rtx-1": refused, "rtx-2": silent.port}, model=True)
    record_the_plan_as_applied(inv)  # status asks the nodes only about servers recorded
    p, _ = fleetctl(tmp_path, "status", inv, "--known-hosts", tmp_path / "known_hosts", "--json")
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is False and {s["condition"] for s in doc["servers"]} == {"unreachable"}
    assert [u["node"] for u in doc["unreachable"]] == ["rtx-1", "rtx-2"]
    assert [u["kind"] for u in doc["unreachable"]] == ["unreachable", "timeout"]


@pytest.mark.parametrize("value", ["inf", "nan", "0"])
def test_a_command_timeout_that_is_not_a_finite_number_is_refused(tmp_path, refused, value):
    inv = inventory(tmp_path, {"rtx-1": refused})
    p, _ = fleetctl(tmp_path, "probe", inv, "--timeout", value)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("error: the command timeout must be a finite number")
