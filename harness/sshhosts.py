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


def _routes(family: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Destinations of every route of one family ("-4" or "-6"), in every table."""
    routes = json.loads(_run("ip", "-j", family, "route", "show", "table", "all") or "[]")
    out = []
    for r in routes:
        dst = r.get("dst", "default")
        if dst != "default":
            one = "/32" if family == "-4" else "/128"
            out.append(ipaddress.ip_network(dst if "/" in dst else dst + one, strict=False))
    return out


def _free_subnet() -> tuple[ipaddress.IPv4Network, ipaddress.IPv6Network]:
    """A 10.231.x.0/24 and its fd00:f1ee:0:x::/64 (a ULA) that overlap no route in any table."""
    used4, used6 = _routes("-4"), _routes("-6")
    for x in [*range(secrets.randbelow(256), 256), *range(256)]:
        net4 = ipaddress.IPv4Network(f"10.231.{x}.0/24")
        net6 = ipaddress.IPv6Network(f"fd00:f1ee:0:{x:x}::/64")
        if not any(net4.overlaps(u) for u in used4) and not any(net6.overlaps(u) for u in used6):
            return net4, net6
    raise RuntimeError("no free 10.231.x.0/24 subnet")


@dataclass
class Host:
    name: str
    address: str
    namespace: str
    dir: Path
    host_key: str = ""  # "type base64": the *current* key; the run's known_hosts keeps the first
    address6: str = ""  # an IPv6 address on its veth, when the hosts were built with ipv6=True
    port: int = 22
    ssh_options: dict[str, str] = field(default_factory=dict)  # ssh_config keywords
    proc: subprocess.Popen | None = None

    @property
    def host_key_line(self) -> str:
        """The known_hosts line of the current key, for the IPv4 address."""
        return self.known_hosts_lines.splitlines()[0]

    @property
    def known_hosts_lines(self) -> str:
        """known_hosts lines of the current key for each address, named as OpenSSH names them:
        bare on port 22, `[address]:port` on any other."""
        return "".join(
            f"{a if self.port == 22 else f'[{a}]:{self.port}'} {self.host_key}\n"
            for a in (self.address, self.address6)
            if a
        )


class TestHosts:
    """`with TestHosts(n) as hosts:` gives n hosts reachable as root@hosts[i].address by key.

    With ipv6=True each host also has hosts[i].address6 (fd00:f1ee:0:x::N/64) on its veth and the
    bridge fd00:f1ee:0:x::1, sshd listens on both families, and known_hosts has both addresses.
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self,
        n: int,
        names: list[str] | None = None,
        start_timeout: float = 120,
        ipv6: bool = False,
        port: int = 22,
    ):
        if not 1 <= n <= 253:
            raise ValueError("1 to 253 hosts fit one /24")
        self.names = names or [f"host{i}" for i in range(n)]
        if len(self.names) != n:
            raise ValueError(f"{len(self.names)} names for {n} hosts")
        self.run_id = secrets.token_hex(3)
        self.bridge = f"fl{self.run_id}"  # interface names are 15 characters at most
        self.start_timeout = start_timeout
        self.ipv6 = ipv6
        self.port = port  # sshd's, on every host
        self.gateway6 = ""  # the bridge's IPv6 address, the hosts' neighbour in the root namespace
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
            self.hosts.append(Host(name, "", f"fl-{self.run_id}-{i}", d, port=self.port))
        _keygen(self.client_key, *(h.dir / "host_ed25519" for h in self.hosts))
        (self.dir / "authorized_keys").write_text(self.client_key.with_suffix(".pub").read_text())
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation chroot

        # Hosts are ports of one bridge: the root namespace reaches all of them through one
        # route, and 64 veth pairs still come up in one `ip -batch`.
        with LOCK.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            net, net6 = _free_subnet()
            gw, gw6 = net.network_address + 1, net6.network_address + 1
            cmds = [
                f"link add {self.bridge} type bridge",
                f"addr add {gw}/24 dev {self.bridge}",
                f"link set {self.bridge} up",
            ]
            # nodad: no duplicate address detection, so an address is usable once the link
            # has carrier (the wait below sees it), not a second or more later.
            if self.ipv6:
                self.gateway6 = str(gw6)
                cmds.insert(2, f"addr add {gw6}/64 dev {self.bridge} nodad")
            for i, h in enumerate(self.hosts):
                h.address = str(gw + 1 + i)
                h.address6 = str(gw6 + 1 + i) if self.ipv6 else ""
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
        self.known_hosts.write_text("".join(h.known_hosts_lines for h in self.hosts))
        self.ssh_config.write_text(
            "".join(
                f"Host {h.name}\n" + "".join(f"  {k} {v}\n" for k, v in h.ssh_options.items())
                for h in self.hosts
            )
        )
        net_up = 'ip link set lo up && ip addr add "$2"/24 dev eth0 && '
        if self.ipv6:
            net_up += 'ip addr add "$4"/64 dev eth0 nodad && '
        net_up += "ip link set eth0 up && "
        for h in self.hosts:
            self._spawn(h, net_up)
        self._wait_listening(self.hosts)
        if self.ipv6:
            self._wait_ipv6_usable()

    def _wait_ipv6_usable(self) -> None:
        """Until every IPv6 address (bridge and hosts) is no longer tentative.

        An address on a link without carrier stays tentative (not usable as a source or a
        destination) until the link comes up; the bridge gets carrier only with its first port.
        """
        where = [(None, self.bridge, self.gateway6)]
        where += [(h.namespace, "eth0", h.address6) for h in self.hosts]
        end = time.monotonic() + self.start_timeout
        while where:
            ns, dev, addr = where[0]
            cmd = ["ip", *(["-n", ns] if ns else []), "-j", "-6", "addr", "show", "dev", dev]
            infos = [a for link in json.loads(_run(*cmd) or "[]") for a in link["addr_info"]]
            ours = [a for a in infos if a.get("local") == addr]
            if ours and not any(a.get("tentative") or a.get("dadfailed") for a in ours):
                where.pop(0)
                continue
            if time.monotonic() > end:
                raise RuntimeError(f"IPv6 on {dev} of {ns or 'the bridge'} not usable: {infos}")
            time.sleep(0.01)

    def _write_config(self, h: Host) -> None:
        key = h.dir / "host_ed25519"
        h.host_key = " ".join(Path(f"{key}.pub").read_text().split()[:2])
        # SetEnv (OpenSSH >= 8.7) is applied after sshd sets its default PATH, so the host's
        # bin/ wins without ForceCommand or PermitUserEnvironment. Hosts share one file
        # system: each gets a HOME of its own (where apply keeps ~/.fleetctl).
        (h.dir / "home").mkdir(exist_ok=True)
        (h.dir / "sshd_config").write_text(
            f"""\
Port {h.port}
ListenAddress 0.0.0.0
{"ListenAddress ::" if self.ipv6 else ""}
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
        cmd += ["sh", h.name, h.address, str(h.dir / "sshd_config"), h.address6]
        with (h.dir / "sshd.log").open("w") as log:
            h.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def _wait_listening(self, hosts: list[Host]) -> None:
        # sshd -e logs "Server listening" once its socket is bound: no probing of the network.
        end = time.monotonic() + self.start_timeout
        waiting = list(hosts)
        while waiting:
            for h in list(waiting):
                log = (h.dir / "sshd.log").read_text()
                if "Server listening on 0.0.0.0" in log and (
                    not self.ipv6 or "Server listening on :: " in log
                ):
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

    def ssh_argv(self, i: int, *command: str, address: str | None = None) -> list[str]:
        """The real ssh client's argv running `command` on host i (at `address`, default its
        IPv4 one); -F none keeps ~/.ssh out."""
        opts = self.hosts[i].ssh_options
        argv = [SSH, "-F", "none", "-o", "ConnectTimeout=5"]
        for k, v in opts.items():
            if k != "HostName":
                argv += ["-o", f"{k}={v}"]
        return [*argv, address or opts["HostName"], *command]

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
