"""SSH to the nodes: the one module that imports paramiko. Named errors, timeouts, host keys.

It behaves like OpenSSH where users expect it to: ~/.ssh/config (User, Port, IdentityFile,
ProxyJump) applies, the agent and default keys are tried, and known_hosts is checked strictly;
`accept_new` adds unknown hosts the way `StrictHostKeyChecking=accept-new` does, and a
changed key is always refused. One connection per node serves all its commands.
"""

from __future__ import annotations

import errno
import logging
import math
import shlex
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fleetctl.base import names
from fleetctl.base.errors import UserError, what_and_fix
from fleetctl.base.limits import MAX_CONNECT_TIMEOUT_S as MAX_CONNECT
from fleetctl.base.limits import MAX_TIMEOUT_S

# paramiko logs handshake failures (with tracebacks) from its transport thread: they would
# bury the one line per node that fleetctl prints, so they stay here unless --debug asks.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False
log = logging.getLogger("fleetctl.ssh")

# The same ranges the inventory enforces (base/limits.py), held again here: a timeout that is
# infinite or too large for a socket would hang or overflow the first connection.
MAX_CONNECT_TIMEOUT_S = MAX_CONNECT
MAX_COMMAND_TIMEOUT_S = MAX_TIMEOUT_S

ErrorKind = Literal[
    "unreachable",
    "not-ssh",
    "auth-failed",
    "host-key-unknown",
    "host-key-changed",
    "timeout",
    "command-failed",
]


class NodeError(Exception):
    """A named failure on one node; it never stops the other nodes.

    `detail` says what happened and what to do; `where` is the address it happened at.
    """

    def __init__(self, kind: ErrorKind, detail: str, where: str = "", node: str = ""):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.where, self.node = kind, detail, where, node

    def line(self, node: str | None = None) -> str:
        """The operator's one line: `a100-1 (10.0.1.11:22): what happened: what to do`."""
        name = node or self.node
        head = f"{name} ({self.where})" if self.where else name
        return f"{head}: {self.detail}" if head else self.detail

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail, "where": self.where, "line": self.line()}


@dataclass(frozen=True)
class Target:
    """Where and how to reach one node."""

    name: str
    host: str
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None

    @property
    def address(self) -> str:
        return names.host_port(self.host, self.port)


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def _seconds(value: float, what: str, ceiling: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise UserError(
            f"the {what} must be a finite number of seconds above 0, got {value!r}",
            None,
            f"use a value up to {ceiling:g}",
        )
    return min(float(value), ceiling)


@dataclass(frozen=True)
class SshOptions:
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_new: bool = False
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 30.0
    ssh_config: Path | None = None  # default ~/.ssh/config

    def __post_init__(self) -> None:
        c = _seconds(self.connect_timeout_s, "SSH connect timeout", MAX_CONNECT_TIMEOUT_S)
        r = _seconds(self.command_timeout_s, "command timeout", MAX_COMMAND_TIMEOUT_S)
        object.__setattr__(self, "connect_timeout_s", c)
        object.__setattr__(self, "command_timeout_s", r)

    @property
    def known_hosts_path(self) -> Path:
        return self.known_hosts or Path.home() / ".ssh" / "known_hosts"


def known_hosts_name(host: str, port: int) -> str:
    """How known_hosts names a host, as OpenSSH (and paramiko) write it: the bare address on
    port 22, `[host]:port` on any other (IPv4, IPv6 or a name alike)."""
    return host if port == 22 else f"[{host}]:{port}"


def quote(*args: str) -> str:
    """A remote command line with every argument shell-quoted."""
    return " ".join(shlex.quote(a) for a in args)


# --- failures, and what they mean to an operator ---------------------------------------------


class NoBanner(Exception):
    """The TCP connection opened but no SSH banner came: silence, other words, or a close."""

    def __init__(self, received: bytes, closed: bool = False):
        super().__init__(f"no SSH banner (received {received[:40]!r}, closed={closed})")
        self.received, self.closed = received, closed


class Handshake(Exception):
    """The banner came but key exchange did not finish in time."""


class UnknownHostKey(Exception):
    """The host is not in known_hosts and accept-new is off (OpenSSH's StrictHostKeyChecking)."""

    def __init__(self, host: str):
        super().__init__(f"{host} not found in known_hosts")
        self.host = host


class JumpFailed(Exception):
    """The ProxyJump hop failed: `error` is the hop's own failure."""

    def __init__(self, hop: str, error: NodeError):
        super().__init__(f"via {hop}: {error}")
        self.hop, self.error = hop, error


def describe(e: BaseException, t: Target, o: SshOptions) -> NodeError:
    """What a connection failure means, and what to do about it, as one line (pure)."""
    kind, what = _classify(e, t, o)
    return NodeError(kind, what, t.address, t.name)


def _classify(e: BaseException, t: Target, o: SshOptions) -> tuple[ErrorKind, str]:
    wait = f"{o.connect_timeout_s:g} s"
    if isinstance(e, NodeError):
        return e.kind, e.detail
    if isinstance(e, JumpFailed):
        inner = e.error
        hop = f"via jump host {e.hop}"
        return inner.kind, f"{hop}: {inner.detail}"
    if isinstance(e, NoBanner):
        if e.received:
            said = _shown(e.received)
            return "not-ssh", (
                f"answered {said} instead of an SSH banner: port {t.port} is not sshd's; "
                "check the node's port (nodes[].port, ssh.port)"
            )
        if e.closed:
            return "unreachable", (
                "closed the connection before its SSH banner: sshd may be refusing this client "
                "(MaxStartups, TCP wrappers, fail2ban)"
            )
        return "timeout", f"no SSH banner within {wait}: is sshd listening there?"
    if isinstance(e, Handshake):
        return "timeout", f"SSH key exchange did not finish within {wait}: is the host overloaded?"
    if isinstance(e, UnknownHostKey):
        return "host-key-unknown", (
            f"host key unknown (not in {o.known_hosts_path}): pass --accept-new-host-keys to "
            f"trust it on first use, or add it with `ssh-keyscan -p {t.port} {t.host} >> "
            f"{o.known_hosts_path}`"
        )
    if isinstance(e, socket.gaierror):
        return "unreachable", (
            f"cannot resolve host name '{t.host}' ({e.strerror or e}): check nodes[].host in "
            "the inventory, or DNS"
        )
    if isinstance(e, ConnectionRefusedError):
        return "unreachable", f"connection refused: is sshd running there, on port {t.port}?"
    if isinstance(e, TimeoutError):
        return "timeout", (
            f"no answer within {wait} connecting: is the host up, or does a firewall drop "
            f"port {t.port}?"
        )
    if isinstance(e, ConnectionResetError | EOFError | BrokenPipeError):
        return "unreachable", (
            "the connection was closed during the SSH handshake: sshd may be refusing this "
            "client (MaxStartups, TCP wrappers, fail2ban)"
        )
    if isinstance(e, FileNotFoundError) and e.filename:
        return "auth-failed", (
            f"identity file {e.filename} does not exist: fix ssh.identity_file in the inventory "
            "(or IdentityFile in ~/.ssh/config)"
        )
    if isinstance(e, OSError) and not type(e).__module__.startswith("paramiko"):
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            said = (e.strerror or "no route to host").lower()
            return "unreachable", f"{said}: is the address right, and the network (VPN, routes) up?"
        return "unreachable", f"cannot connect: {e.strerror or e}"
    return _classify_paramiko(e, t)


def _classify_paramiko(e: BaseException, t: Target) -> tuple[ErrorKind, str]:
    import paramiko

    user = t.user or "the local user"
    if isinstance(e, paramiko.BadHostKeyException):
        return "host-key-changed", (
            "host key CHANGED since known_hosts recorded it (a reinstall, or a "
            "man-in-the-middle): refusing; if the host was reinstalled, remove the old key "
            f"with `ssh-keygen -R {shlex.quote(known_hosts_name(t.host, t.port))}` and connect "
            "again"
        )
    if isinstance(e, paramiko.PasswordRequiredException):
        return "auth-failed", (
            f"identity file {t.identity_file or '(default)'} is encrypted: load it into "
            "ssh-agent (`ssh-add`), which fleetctl uses"
        )
    if isinstance(e, paramiko.AuthenticationException) or "No authentication methods" in str(e):
        keys = (
            f"key {t.identity_file} and the agent's keys"
            if t.identity_file
            else "the agent's keys and ~/.ssh/id_*"
        )
        return "auth-failed", (
            f"authentication as {user} failed (tried {keys}): set ssh.identity_file or "
            "nodes[].user in the inventory, or IdentityFile in ~/.ssh/config"
        )
    if isinstance(e, paramiko.ChannelException):
        return "unreachable", f"the jump host could not open a connection here: {e.text}"
    if isinstance(e, paramiko.IncompatiblePeer):
        return "not-ssh", f"speaks an SSH version fleetctl cannot use: {e}"
    return "unreachable", f"SSH handshake failed: {_shown(str(e).encode())}"


def _shown(data: bytes, limit: int = 40) -> str:
    """The first line of what a peer said, printable and short, quoted."""
    first = data.split(b"\n", 1)[0].rstrip(b"\r")
    text = "".join(c if c.isprintable() else "?" for c in first.decode("utf-8", "replace"))
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class SshSession:
    """One SSH connection to a node; run commands on it, then close it."""

    def __init__(self, target: Target, options: SshOptions):
        self.target = target
        self.options = options
        self._client: Any = None
        self._jump: SshSession | None = None

    def __enter__(self) -> SshSession:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        """Open the connection; NodeError (one line, see `describe`) on any failure.

        One deadline, the connect timeout, covers TCP, the banner and key exchange: paramiko's
        own banner and auth timeouts (15 s and 30 s) would otherwise outlast it.
        """
        t = self.target
        try:
            t = _resolve(self.target, self.options)
            self._client = self._open(t, time.monotonic() + self.options.connect_timeout_s)
        except Exception as e:
            self.close()
            err = describe(e, t, self.options)
            log.debug("%s", err.line(), exc_info=True)
            raise err from e

    def _open(self, t: Target, deadline: float) -> Any:
        import paramiko

        o = self.options
        if t.identity_file and not Path(t.identity_file).expanduser().is_file():
            raise FileNotFoundError(errno.ENOENT, "no such file", t.identity_file)
        heard = b""
        if t.proxy_jump:
            sock: Any = self._jump_channel(t, deadline)
        else:
            sock = socket.create_connection((t.host, t.port), timeout=_left(deadline))
            heard = _await_banner(sock, deadline)
        client = paramiko.SSHClient()
        self._client = client  # closed by connect() if what follows fails
        if o.known_hosts_path.exists():
            client.load_host_keys(str(o.known_hosts_path))
        client.set_missing_host_key_policy(
            _AcceptNew(o.known_hosts_path) if o.accept_new else _RejectUnknown()
        )
        try:
            client.connect(
                t.host,
                port=t.port,
                username=t.user,
                key_filename=[str(Path(t.identity_file).expanduser())] if t.identity_file else None,
                timeout=_left(deadline),
                banner_timeout=_left(deadline),
                auth_timeout=_left(deadline),
                channel_timeout=_left(deadline),
                sock=sock,
                allow_agent=True,
                look_for_keys=t.identity_file is None,
            )
        except paramiko.SSHException as e:
            # paramiko stops waiting at the deadline and then fails on the missing session:
            # what it never got (the banner, the key exchange) is the real story.
            transport = client.get_transport()
            if transport is not None and not transport.remote_version:
                raise NoBanner(heard) from e
            if transport is not None and transport.host_key is None:
                raise Handshake(str(e)) from e
            raise
        return client

    def _jump_channel(self, t: Target, deadline: float) -> Any:
        """A channel through the ProxyJump host, as `ssh -J` makes."""
        spec = t.proxy_jump or ""
        try:  # the inventory's is parsed at validation; ~/.ssh/config's only here
            hop_at = names.jump(spec)
        except ValueError as e:
            what, fix = what_and_fix(e)
            raise NodeError("unreachable", f"{what}: {fix}") from None
        # The jump host takes the same user and key unless the ProxyJump spec names a user.
        hop = Target(
            f"{t.name}-jump", hop_at.host, hop_at.port, hop_at.user or t.user, t.identity_file
        )
        left = max(0.1, deadline - time.monotonic())
        jump = SshSession(hop, _with_connect_timeout(self.options, left))
        self._jump = jump
        try:
            jump.connect()
        except NodeError as e:
            raise JumpFailed(spec, e) from e
        transport = jump._client.get_transport()
        return transport.open_channel(
            "direct-tcpip", (t.host, t.port), ("127.0.0.1", 0), timeout=_left(deadline)
        )

    def run(self, command: str, timeout_s: float | None = None, stdin: str | None = None) -> Result:
        """Run a shell command line (quote its arguments with `quote`)."""
        if self._client is None:
            self.connect()
        limit = self.options.command_timeout_s
        if timeout_s is not None and math.isfinite(timeout_s) and timeout_s > 0:
            limit = min(timeout_s, MAX_COMMAND_TIMEOUT_S)
        t = self.target
        try:
            stdin_f, stdout_f, stderr_f = self._client.exec_command(command, timeout=limit)
            if stdin is not None:
                stdin_f.write(stdin)
                stdin_f.channel.shutdown_write()
            deadline = time.monotonic() + limit
            channel = stdout_f.channel
            while not channel.exit_status_ready():
                if time.monotonic() > deadline:
                    channel.close()
                    raise NodeError(
                        "timeout", f"`{command[:60]}` ran past {limit:g} s", t.address, t.name
                    )
                time.sleep(0.01)
            out = stdout_f.read().decode("utf-8", "replace")
            err = stderr_f.read().decode("utf-8", "replace")
            return Result(out, err, channel.recv_exit_status())
        except NodeError:
            raise
        except (OSError, EOFError) as e:
            what = f"connection lost ({e or type(e).__name__}): is the host still up?"
            raise NodeError("unreachable", what, t.address, t.name) from e
        except Exception as e:  # paramiko raises its own socket.timeout subclasses
            if "timed out" in str(e).lower() or isinstance(e, TimeoutError):
                what = f"`{command[:60]}` ran past {limit:g} s"
                raise NodeError("timeout", what, t.address, t.name) from e
            raise NodeError("command-failed", f"`{command[:60]}`: {e}", t.address, t.name) from e

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None


def _left(deadline: float) -> float:
    """Seconds until the deadline, never zero (a zero timeout means "do not wait" to sockets)."""
    return max(0.05, deadline - time.monotonic())


def _await_banner(sock: socket.socket, deadline: float) -> bytes:
    """The first bytes the server sends, left unread for paramiko; NoBanner if none come.

    Waiting here, before paramiko starts its transport thread, is what makes a silent host a
    clean timeout: paramiko would block on the banner past the deadline and then log it.
    """
    sock.settimeout(_left(deadline))
    try:
        data = sock.recv(256, socket.MSG_PEEK)
    except TimeoutError:
        sock.close()
        raise NoBanner(b"") from None
    except OSError:
        sock.close()
        raise
    if not data:
        sock.close()
        raise NoBanner(b"", closed=True)
    return data


def _with_connect_timeout(o: SshOptions, seconds: float) -> SshOptions:
    return SshOptions(o.known_hosts, o.accept_new, seconds, o.command_timeout_s, o.ssh_config)


def _resolve(t: Target, o: SshOptions) -> Target:
    """Apply ~/.ssh/config: the inventory wins where it says something."""
    import paramiko

    path = o.ssh_config or Path.home() / ".ssh" / "config"
    if not path.is_file():
        return t
    cfg = paramiko.SSHConfig.from_path(str(path)).lookup(t.host)
    files = cfg.get("identityfile") or []
    return Target(
        t.name,
        cfg.get("hostname", t.host),
        t.port if t.port != 22 else int(cfg.get("port", 22)),
        t.user or cfg.get("user"),
        t.identity_file or (files[0] if files else None),
        t.proxy_jump or cfg.get("proxyjump"),
    )


class _RejectUnknown:
    """paramiko policy for an unknown host: refuse it (OpenSSH's StrictHostKeyChecking=yes)."""

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        raise UnknownHostKey(hostname)


class _AcceptNew:
    """paramiko policy for an unknown host: remember its key (OpenSSH's accept-new)."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.known_hosts.open("a", encoding="utf-8") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
