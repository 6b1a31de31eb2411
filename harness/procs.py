"""The processes a benchmark or test starts: free ports, start and stop, logs, and /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all held open while picking, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def pinned(cmd: list[str], core: int | None) -> list[str]:
    return ["taskset", "-c", str(core), *cmd] if core is not None else cmd


def stop_process(proc: subprocess.Popen, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after 5 s; to its whole process group when `group`."""
    if proc.poll() is not None:
        return

    def send(sig: signal.Signals) -> None:
        if not group:
            proc.send_signal(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    send(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


class Proc:
    """A subprocess logging to `log_dir/NAME.log`; stop() always ends it.

    With `own_group` (the benchmarks) it leads its own process group, so that stop() also ends
    whatever it started and a Ctrl-C at the terminal reaches only the benchmark, which then
    stops it in order. Without (the tests), it stays in the caller's group, as Popen does."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
        own_group: bool = True,
    ):
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.own_group = own_group
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env={**os.environ, **(env or {})},
                start_new_session=own_group,
                preexec_fn=_default_sigint if _sigint_ignored() else None,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        stop_process(self.proc, group=self.own_group)


# --- what /proc says about a process tree and the machine -------------------------------------


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_kb(pid: int, key: str) -> int:
    """`key` of /proc/PID/status (VmRSS, VmHWM), summed over the process and its children."""
    return sum(status_kb(p, key) for p in descendants(pid))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime) of the process and its children."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in descendants(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def cpu_ticks() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return f[0] + f[1] + f[2] + f[5] + f[6], f[7]


def tcp_counters() -> dict[str, int]:
    """Machine-wide TcpExt counters: listen queue overflows and SYN retransmits."""
    lines = [ln.split() for ln in Path("/proc/net/netstat").read_text().splitlines()]
    for keys, values in zip(lines[::2], lines[1::2], strict=False):
        if keys[0] == "TcpExt:":
            got = dict(zip(keys[1:], map(int, values[1:]), strict=False))
            return {k: got.get(k, 0) for k in ("ListenOverflows", "TCPSynRetrans")}
    return {}


def _sigint_ignored() -> bool:
    """Whether this process ignores SIGINT: so does a suite started in the background by a
    shell without job control (`cmd &` in a script, nohup), and its children inherit it."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so a test that interrupts a
    command sees what a user's Ctrl-C does, however the suite itself was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
