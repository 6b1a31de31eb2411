"""Real SSH test hosts: one network namespace, hostname and sshd per host, all on this machine."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Runs started at the same time must not pick the same subnet between looking and claiming it.
LOCK = Path(tempfile.gettempdir()) / "fleetctl-sshhosts.lock"


def available() -> str | None:
    """Why test hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in (SSHD, SSH, "/usr/bin/ssh-keygen", "/usr/bin/unshare"):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing (apt-get install openssh-server openssh-client util-linux)"
    if shutil.which("ip") is None:
        return "ip (iproute2) is missing"
    return None


def require() -> None:
    """Skip the calling test where test hosts cannot be built, but fail it in CI."""
    import pytest

    why = available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"SSH test hosts are required in CI: {why}")
        pytest.skip(why)


def _run(*cmd: str, stdin: str | None = None) -> str:
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def _keygen(*paths: Path) -> None:
    # One ssh-keygen per key, all at once: 64 hosts start in well under a second this way.
    procs = [
        subprocess.Popen(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(p)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for p in paths
    ]
    for p, proc in zip(paths, procs, strict=True):
        if proc.wait() != 0:
            raise RuntimeError(
                f"ssh-keygen {p}: {proc.stderr.read().decode() if proc.stderr else ''}"
            )


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.231.x.0/24 that overlaps no route in any table (the default route aside)."""
    routes = json.loads(_run("ip", "-j", "-4", "route", "show", "table", "all") or "[]")
    used = []
    for r in routes:
        dst = r.get("dst", "default")
        if dst != "default":
            used.append(ipaddress.ip_network(dst if "/" in dst else dst + "/32", strict=False))
    for x in [*range(secrets.randbelow(256), 256), *range(256)]:
        net = ipaddress.IPv4Network(f"10.231.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.231.x.0/24 subnet")


@dataclass
class Host:
    name: str
    address: str
    namespace: str
    dir: Path
    host_key_line: str = ""  # the *current* key; the run's known_hosts keeps the first one
    port: int = 22
    ssh_options: dict[str, str] = field(default_factory=dict)  # ssh_config keywords
    proc: subprocess.Popen | None = None


class TestHosts:
    """`with TestHosts(n) as hosts:` gives n hosts reachable as root@hosts[i].address by key."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, n: int, names: list[str] | None = None, start_timeout: float = 120):
        if not 1 <= n <= 253:
            raise ValueError("1 to 253 hosts fit one /24")
        self.names = names or [f"host{i}" for i in range(n)]
        if len(self.names) != n:
            raise ValueError(f"{len(self.names)} names for {n} hosts")
        self.run_id = secrets.token_hex(3)
        self.bridge = f"fl{self.run_id}"  # interface names are 15 characters at most
        self.start_timeout = start_timeout
        self.hosts: list[Host] = []
        self.dir = Path(tempfile.mkdtemp(prefix=f"fleetctl-ssh-{self.run_id}-"))
        self.client_key = self.dir / "client_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.ssh_config = self.dir / "ssh_config"

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __enter__(self) -> TestHosts:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for i, name in enumerate(self.names):
            d = self.dir / f"h{i}"
            (d / "bin").mkdir(parents=True)
            self.hosts.append(Host(name, "", f"fl-{self.run_id}-{i}", d))
        _keygen(self.client_key, *(h.dir / "host_ed25519" for h in self.hosts))
        (self.dir / "authorized_keys").write_text(self.client_key.with_suffix(".pub").read_text())
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation chroot

        # Hosts are ports of one bridge: the root namespace reaches all of them through one
        # route, and 64 veth pairs still come up in one `ip -batch`.
        with LOCK.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            net = _free_subnet()
            gw = net.network_address + 1
            cmds = [
                f"link add {self.bridge} type bridge",
                f"addr add {gw}/24 dev {self.bridge}",
                f"link set {self.bridge} up",
            ]
            for i, h in enumerate(self.hosts):
                h.address = str(gw + 1 + i)
                veth = f"{self.bridge}h{i}"
                cmds += [
                    f"netns add {h.namespace}",
                    f"link add {veth} type veth peer name eth0 netns {h.namespace}",
                    f"link set {veth} master {self.bridge} up",
                ]
            _run("ip", "-batch", "-", stdin="\n".join(cmds) + "\n")

        for h in self.hosts:
            self._write_config(h)
            h.ssh_options = {
                "HostName": h.address,
                "Port": str(h.port),
                "User": "root",
                "IdentityFile": str(self.client_key),
                "IdentitiesOnly": "yes",
                "UserKnownHostsFile": str(self.known_hosts),
                "GlobalKnownHostsFile": "/dev/null",
                "StrictHostKeyChecking": "yes",
                "BatchMode": "yes",
            }
        self.known_hosts.write_text("".join(h.host_key_line + "\n" for h in self.hosts))
        self.ssh_config.write_text(
            "".join(
                f"Host {h.name}\n" + "".join(f"  {k} {v}\n" for k, v in h.ssh_options.items())
                for h in self.hosts
            )
        )
        net_up = 'ip link set lo up && ip addr add "$2"/24 dev eth0 && ip link set eth0 up && '
        for h in self.hosts:
            self._spawn(h, net_up)
        self._wait_listening(self.hosts)

    def _write_config(self, h: Host) -> None:
        key = h.dir / "host_ed25519"
        h.host_key_line = f"{h.address} {' '.join(Path(f'{key}.pub').read_text().split()[:2])}"
        # SetEnv (OpenSSH >= 8.7) is applied after sshd sets its default PATH, so the host's
        # bin/ wins without ForceCommand or PermitUserEnvironment. Hosts share one file
        # system: each gets a HOME of its own (where apply keeps ~/.fleetctl).
        (h.dir / "home").mkdir(exist_ok=True)
        (h.dir / "sshd_config").write_text(
            f"""\
Port {h.port}
ListenAddress 0.0.0.0
HostKey {key}
AuthorizedKeysFile {self.dir / "authorized_keys"}
StrictModes no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
PrintLastLog no
PidFile {h.dir / "sshd.pid"}
SetEnv PATH={h.dir / "bin"}:{STD_PATH} HOME={h.dir / "home"}
"""
        )

    def _spawn(self, h: Host, net_up: str = "") -> None:
        # ip netns exec and unshare exec in place, so the Popen's pid is sshd's own pid.
        script = f'{net_up}hostname "$1" && exec {SSHD} -D -e -f "$3"'
        cmd = ["ip", "netns", "exec", h.namespace, "unshare", "--uts", "sh", "-c", script]
        cmd += ["sh", h.name, h.address, str(h.dir / "sshd_config")]
        with (h.dir / "sshd.log").open("w") as log:
            h.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _wait_listening(self, hosts: list[Host]) -> None:
        # sshd -e logs "Server listening" once its socket is bound: no probing of the network.
        end = time.monotonic() + self.start_timeout
        waiting = list(hosts)
        while waiting:
            for h in list(waiting):
                log = (h.dir / "sshd.log").read_text()
                if "Server listening on 0.0.0.0" in log:
                    waiting.remove(h)
                elif h.proc is None or h.proc.poll() is not None:
                    raise RuntimeError(f"sshd of {h.name} exited: {log}")
            if waiting and time.monotonic() > end:
                raise RuntimeError(f"sshd of {waiting[0].name} did not start in time")
            if waiting:
                time.sleep(0.01)

    def _namespace_pids(self, hosts: list[Host]) -> list[int]:
        """Processes inside these hosts' namespaces: sshd and the sessions it forked.

        sshd's session children call setsid(), so only their network namespace (private to this
        run) ties them to us; this is what `ip netns pids` does, for all hosts in one pass.
        """
        inodes = set()
        for h in hosts:
            with contextlib.suppress(FileNotFoundError):
                inodes.add(os.stat(f"/run/netns/{h.namespace}").st_ino)
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                        pids.append(int(entry))
                except OSError:
                    pass  # exited meanwhile
        return pids

    def _kill(self, hosts: list[Host]) -> None:
        for h in hosts:
            if h.proc is not None and h.proc.poll() is None:
                h.proc.kill()
        for h in hosts:
            if h.proc is not None:
                h.proc.wait()
                h.proc = None
        for _ in range(100):
            pids = self._namespace_pids(hosts)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def stop(self, i: int) -> None:
        """Host down: its sshd and sessions die, connections are refused."""
        self._kill([self.hosts[i]])

    def start(self, i: int) -> None:
        """Start a stopped host's sshd again (its network is still up)."""
        h = self.hosts[i]
        if h.proc is None:
            self._spawn(h)
            self._wait_listening([h])

    def rekey(self, i: int) -> None:
        """Give host i a new host key and restart it; the run's known_hosts keeps the old one."""
        h = self.hosts[i]
        self.stop(i)
        for f in ("host_ed25519", "host_ed25519.pub"):
            (h.dir / f).unlink()
        _keygen(h.dir / "host_ed25519")
        self._write_config(h)
        self.start(i)

    def install(self, i: int, name: str, text: str) -> Path:
        """An executable `name` on host i's PATH for SSH sessions (e.g. a fake nvidia-smi)."""
        path = self.hosts[i].dir / "bin" / name
        path.write_text(text)
        path.chmod(0o755)
        return path

    def ssh_argv(self, i: int, *command: str) -> list[str]:
        """The real ssh client's argv running `command` on host i; -F none keeps ~/.ssh out."""
        opts = self.hosts[i].ssh_options
        argv = [SSH, "-F", "none", "-o", "ConnectTimeout=5"]
        for k, v in opts.items():
            if k != "HostName":
                argv += ["-o", f"{k}={v}"]
        return [*argv, opts["HostName"], *command]

    def close(self) -> None:
        """Remove everything this run made; safe to call twice or after a failed setup."""
        self._kill(self.hosts)
        # Veths go first and explicitly: a deleted namespace frees its devices only later.
        cmds = [f"link del {self.bridge}h{i}" for i in range(len(self.hosts))]
        cmds.append(f"link del {self.bridge}")
        cmds += [f"netns del {h.namespace}" for h in self.hosts]
        # -force goes on past names that were never created; their errors are expected.
        subprocess.run(
            ["ip", "-force", "-batch", "-"],
            input="\n".join(cmds) + "\n",
            text=True,
            capture_output=True,
        )
        shutil.rmtree(self.dir, ignore_errors=True)
