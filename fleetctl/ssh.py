"""SSH to the nodes: the one module that imports paramiko. Named errors, timeouts, host keys.

It behaves like OpenSSH where users expect it to: ~/.ssh/config (User, Port, IdentityFile,
ProxyJump) applies, the agent and default keys are tried, and known_hosts is checked strictly;
`accept_new` adds unknown hosts the way `StrictHostKeyChecking=accept-new` does, and a
changed key is always refused. One connection per node serves all its commands.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ErrorKind = Literal[
    "unreachable",
    "auth-failed",
    "host-key-unknown",
    "host-key-changed",
    "timeout",
    "command-failed",
]


class NodeError(Exception):
    """A named failure on one node; it never stops the other nodes."""

    def __init__(self, kind: ErrorKind, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass(frozen=True)
class Target:
    """Where and how to reach one node."""

    name: str
    host: str
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    proxy_jump: str | None = None


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class SshOptions:
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_new: bool = False
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 30.0
    ssh_config: Path | None = None  # default ~/.ssh/config


def quote(*args: str) -> str:
    """A remote command line with every argument shell-quoted."""
    return " ".join(shlex.quote(a) for a in args)


class SshSession:
    """One SSH connection to a node; run commands on it, then close it."""

    def __init__(self, target: Target, options: SshOptions):
        self.target = target
        self.options = options
        self._client: Any = None
        self._jump: Any = None

    def __enter__(self) -> SshSession:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        import paramiko

        t, o = _resolve(self.target, self.options), self.options
        known = o.known_hosts or Path.home() / ".ssh" / "known_hosts"
        client = paramiko.SSHClient()
        if known.exists():
            client.load_host_keys(str(known))
        client.set_missing_host_key_policy(
            _AcceptNew(known) if o.accept_new else paramiko.RejectPolicy()
        )
        sock = self._jump_channel(t, o) if t.proxy_jump else None
        try:
            client.connect(
                t.host,
                port=t.port,
                username=t.user,
                key_filename=[str(Path(t.identity_file).expanduser())] if t.identity_file else None,
                timeout=o.connect_timeout_s,
                banner_timeout=o.connect_timeout_s,
                auth_timeout=o.connect_timeout_s,
                sock=sock,
                allow_agent=True,
                look_for_keys=t.identity_file is None,
            )
        except paramiko.BadHostKeyException as e:
            raise NodeError(
                "host-key-changed",
                f"{t.host}'s host key differs from known_hosts: refusing (if the host was "
                f"reinstalled, remove its old line with `ssh-keygen -R {t.host}`)",
            ) from e
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise NodeError(
                    "host-key-unknown",
                    f"{t.host} is not in {known}: "
                    "add it (ssh-keyscan) or pass --accept-new-host-keys",
                ) from e
            if isinstance(e, paramiko.AuthenticationException):
                raise NodeError("auth-failed", f"{t.user or 'the user'}@{t.host}: {e}") from e
            raise NodeError("unreachable", f"{t.host}:{t.port}: {e}") from e
        except TimeoutError as e:
            raise NodeError(
                "timeout", f"{t.host}:{t.port}: no answer in {o.connect_timeout_s:g} s"
            ) from e
        except OSError as e:
            raise NodeError("unreachable", f"{t.host}:{t.port}: {e.strerror or e}") from e
        self._client = client

    def _jump_channel(self, t: Target, o: SshOptions) -> Any:
        """A channel through the ProxyJump host, as `ssh -J` makes."""
        user, _, hostport = (t.proxy_jump or "").rpartition("@")
        host, _, port = hostport.partition(":")
        # The jump host takes the same user and key unless the ProxyJump spec names a user.
        hop = Target(f"{t.name}-jump", host, int(port or 22), user or t.user, t.identity_file)
        jump = SshSession(hop, o)
        jump.connect()
        self._jump = jump
        transport = jump._client.get_transport()
        try:
            return transport.open_channel("direct-tcpip", (t.host, t.port), ("127.0.0.1", 0))
        except Exception as e:
            raise NodeError("unreachable", f"{t.host}:{t.port} via {host}: {e}") from e

    def run(self, command: str, timeout_s: float | None = None, stdin: str | None = None) -> Result:
        """Run a shell command line (quote its arguments with `quote`)."""
        if self._client is None:
            self.connect()
        limit = timeout_s or self.options.command_timeout_s
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
                    raise NodeError("timeout", f"`{command[:60]}` ran past {limit:g} s")
                time.sleep(0.01)
            out = stdout_f.read().decode("utf-8", "replace")
            err = stderr_f.read().decode("utf-8", "replace")
            return Result(out, err, channel.recv_exit_status())
        except NodeError:
            raise
        except (OSError, EOFError) as e:
            raise NodeError("unreachable", f"{self.target.host}: connection lost ({e})") from e
        except Exception as e:  # paramiko raises its own socket.timeout subclasses
            if "timed out" in str(e).lower() or isinstance(e, TimeoutError):
                raise NodeError("timeout", f"`{command[:60]}` ran past {limit:g} s") from e
            raise NodeError("command-failed", f"`{command[:60]}`: {e}") from e

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._jump is not None:
            self._jump.close()
            self._jump = None


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


class _AcceptNew:
    """paramiko policy for an unknown host: remember its key (OpenSSH's accept-new)."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.known_hosts.open("a", encoding="utf-8") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
