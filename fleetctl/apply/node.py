"""What apply does on one node: start, stop and inspect supervised vLLM servers over SSH.

Each server owns `~/.fleetctl/servers/SID/` on its node: `manifest.json` (what runs: flags
hash, port, GPUs, start time), `env` (0600: secrets, the model's environment,
CUDA_VISIBLE_DEVICES and a token), `pid`, and `log`. The token in the server's environment is
inherited by every process it spawns, so a stop finds vLLM's engine processes even when they
left the process group, and a recycled pid is never mistaken for ours.

Every remote argument is shell-quoted; secrets travel on the channel's stdin into the 0600
file and never appear on a command line. The scripts need only POSIX sh, awk and /proc.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shlex
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fleetctl.base.errors import shown
from fleetctl.base.names import ENV_KEY, control_char
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.ssh import Result, quote

Supervisor = Literal["auto", "systemd", "nohup"]
TOKEN_VAR = "FLEETCTL_SERVER_TOKEN"


class Runner(Protocol):
    """An open session on a node (SshSession, or a local stand-in)."""

    def run(
        self, command: str, timeout_s: float | None = None, stdin: str | None = None
    ) -> Result: ...


def server_id(d: Deployment) -> str:
    """The server's folder name on its node: the port makes it unique there."""
    return f"{d.port}-{re.sub(r'[^A-Za-z0-9._-]+', '_', d.model)}"


# Helpers every script starts with. $1.. are the script's own arguments.
_PRELUDE = r"""
set -u
root="$HOME/.fleetctl/servers"
listening() {  # is TCP port $1 in LISTEN state in this network namespace?
  h=$(printf ':%04X' "$1")
  awk -v h="$h" '$4 == "0A" && substr($2, length($2) - 4) == h { f = 1 } END { exit !f }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
holder() {  # who listens on port $1: "pid cmdline", best effort
  p=$(ss -ltnpH "sport = :$1" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n 1)
  if [ -n "$p" ]; then echo "$p $(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null)"; else echo "?"; fi
}
carriers() {  # pids of live processes whose environment holds token $1
  grep -l -s -z -x "FLEETCTL_SERVER_TOKEN=$1" /proc/[0-9]*/environ 2>/dev/null \
    | sed 's,/proc/\([0-9]*\)/environ,\1,' | while read -r p; do
      s=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -c1)
      [ -n "$s" ] && [ "$s" != Z ] && echo "$p"
    done
}
dollars() {  # $1 with every $ doubled, and nothing else changed
  s=$1; out=""
  while :; do
    case $s in
      *'$'*) out="$out${s%%\$*}\$\$"; s=${s#*\$} ;;
      *) printf '%s' "$out$s"; return ;;
    esac
  done
}
alive() {  # is the server in folder $1 running? (its supervisor knows, else its token)
  if [ -f "$1/unit" ]; then
    systemctl $(cat "$1/scope") is-active --quiet "$(cat "$1/unit")"
  else
    [ -n "$(carriers "$(cat "$1/token" 2>/dev/null)")" ]
  fi
}
"""

_START = r"""
sid="$1"; port="$2"; manifest="$3"; supervisor="$4"; shift 4
d="$root/$sid"
mkdir -p "$root" && chmod 700 "$HOME/.fleetctl" || exit 5
if [ -d "$d" ] && alive "$d"; then echo "fleetctl: server $sid already runs" >&2; exit 4; fi
rm -rf "$d" && mkdir -m 700 "$d" || exit 5
umask 077
cat > "$d/env" || exit 5
# Defense in depth: the file is sourced by sh, so every line must be KEY='quoted value'.
if grep -q -v -E "^[A-Za-z_][A-Za-z0-9_]*='([^']|'\\\\'')*'$" "$d/env"; then
  echo "fleetctl: refusing an env file line that is not KEY='value'" >&2
  rm -rf "$d"; exit 5
fi
sed -n "s/^FLEETCTL_SERVER_TOKEN='\\(.*\\)'\$/\\1/p" "$d/env" > "$d/token"
if listening "$port"; then
  echo "port $port is already taken by: $(holder "$port")" >&2
  rm -rf "$d"; exit 3
fi
printf '%s\n' "$manifest" > "$d/manifest.json"
cd "$d" || exit 5
if [ "$supervisor" = auto ]; then
  supervisor=nohup
  if [ -d /run/systemd/system ] && command -v systemd-run >/dev/null; then
    if [ "$(id -u)" = 0 ] || systemctl --user show-environment >/dev/null 2>&1; then
      supervisor=systemd
    fi
  fi
fi
if [ "$supervisor" = systemd ]; then
  scope=""; [ "$(id -u)" = 0 ] || scope="--user"
  printf '%s' "$scope" > "$d/scope"
  exe=$(command -v "$1") || { echo "fleetctl: $1 is not on the PATH" >&2; exit 127; }
  shift
  unit="fleetctl-$sid"
  # systemd expands $VAR and ${VAR} in a unit's command line (from the env file: a secret
  # would land on the command line); $$ is its escape for a literal $.
  n=$#
  for a in "$@"; do set -- "$@" "$(dollars "$a")"; done
  shift "$n"
  systemctl $scope reset-failed "$unit" >/dev/null 2>&1
  systemd-run $scope --quiet --collect --unit "$unit" \
    --property=EnvironmentFile="$d/env" --property=WorkingDirectory="$d" \
    --property=StandardOutput=append:"$d/log" --property=StandardError=append:"$d/log" \
    --property=KillMode=control-group --property=TimeoutStopSec=30 -- "$exe" "$@" || exit 6
  printf '%s' "$unit" > "$d/unit"
  pid=$(systemctl $scope show -p MainPID --value "$unit")
else
  # setsid: the server leads its own session, so it outlives this SSH channel and its
  # group can be signalled at once. The env file is sourced, never put on a command line;
  # the token (no secret) is set by `env` first, so the process carries it from its start.
  setsid nohup env "FLEETCTL_SERVER_TOKEN=$(cat "$d/token")" \
    sh -c 'set -a; . ./env; set +a; exec "$@"' fleetctl-server "$@" \
    > "$d/log" 2>&1 < /dev/null &
  pid=$!
fi
echo "$pid" > "$d/pid"
echo "supervisor=$supervisor pid=$pid"
"""

_STOP = r"""
grace="$1"; shift
for sid in "$@"; do
  d="$root/$sid"
  [ -d "$d" ] || continue
  token=$(cat "$d/token" 2>/dev/null)
  if [ -f "$d/unit" ]; then
    systemctl $(cat "$d/scope") stop "$(cat "$d/unit")" >/dev/null 2>&1
  fi
  pid=$(cat "$d/pid" 2>/dev/null)
  pids=$(carriers "$token")
  [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
  n=0
  while [ -n "$(carriers "$token")" ] && [ "$n" -lt "$((grace * 10))" ]; do
    sleep 0.1; n=$((n + 1))
  done
  pids=$(carriers "$token")
  if [ -n "$pids" ]; then
    kill -KILL $pids 2>/dev/null && echo "killed $sid after ${grace}s: $pids"
    # SIGKILL is asynchronous: wait (bounded) until they are gone, so a replacement on the
    # same port does not find it still taken.
    n=0
    while [ -n "$(carriers "$token")" ] && [ "$n" -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
  fi
  rm -rf "$d"
  echo "stopped $sid"
done
rmdir "$root" "$HOME/.fleetctl" 2>/dev/null
exit 0
"""

_INSPECT = r"""
[ -d "$root" ] || exit 0
for d in "$root"/*/; do
  d=${d%/}; [ -f "$d/manifest.json" ] || continue
  echo "@@server ${d##*/}"
  if alive "$d"; then a=1; else a=0; fi
  echo "alive=$a"
  port=$(sed -n 's/.*"port": *\([0-9]*\).*/\1/p' "$d/manifest.json")
  if [ -n "$port" ] && listening "$port"; then
    echo "listening=1"
    # Who holds the port matters only when it is not ours (ss -p reads every process's fds).
    [ "$a" = 0 ] && echo "holder=$(holder "$port")"
  else
    echo "listening=0"
  fi
  echo "pid=$(cat "$d/pid" 2>/dev/null)"
  echo "manifest=$(tr -d '\n' < "$d/manifest.json")"
done
"""

_TAIL = r"""
n="$1"; sid="$2"
tail -n "$n" "$root/$sid/log" 2>/dev/null || echo "(no log at ~/.fleetctl/servers/$sid/log)"
"""

# The start-up lines vLLM logs with a duration (fleetctl/apply/warmup.py reads them); bounded.
_STARTUP = r"""
grep -E 'took|takes|finished in' "$root/$1/log" 2>/dev/null | head -n 200
"""

_ALIVE = r"""
for sid in "$@"; do
  if [ -d "$root/$sid" ] && alive "$root/$sid"; then echo "$sid 1"; else echo "$sid 0"; fi
done
"""


# Writes stdin (base64) to folder $1, file $2, through a temporary name: a half-copied file
# never stands where vLLM reads it.
_PUT = r"""
mkdir -p "$1" || exit 1
base64 -d > "$1/.$2.part" && mv -f "$1/.$2.part" "$1/$2"
"""


def _script(body: str, *args: str) -> str:
    return "sh -c " + shlex.quote(_PRELUDE + body) + " fleetctl " + quote(*args)


@dataclass(frozen=True)
class Live:
    """One server found on a node, as its folder and the process table say."""

    sid: str
    alive: bool
    listening: bool
    pid: int | None
    manifest: dict[str, Any]
    holder: str = ""  # "pid cmdline" of whoever listens on the port

    @property
    def args_hash(self) -> str:
        return str(self.manifest.get("args_hash", ""))

    @property
    def port(self) -> int:
        return int(self.manifest.get("port", 0))

    @property
    def gpus(self) -> set[int]:
        return set(self.manifest.get("gpu_indices", ()))

    @property
    def argv(self) -> list[str]:
        return list(self.manifest.get("argv", ()))

    @property
    def foreign_holder(self) -> str:
        """The listener's command line when a process fleetctl did not start holds the port."""
        if not self.listening or self.alive:
            return ""
        pid, _, cmd = self.holder.partition(" ")
        return cmd.strip() or f"pid {pid}"


def env_file(d: Deployment, secret_env: dict[str, str], token: str) -> str:
    """The server's environment as `KEY='value'` lines: sh (set -a) and systemd both read it.

    The inventory refuses bad names and control characters already; a plan file or a caller
    that skipped it is refused here too, since the node sources this file with sh.
    """
    merged = {**dict(d.env), **secret_env, TOKEN_VAR: token}
    for k, v in merged.items():
        if not ENV_KEY.fullmatch(k):
            raise ValueError(f"not an environment variable name: {shown(k)}")
        if control_char(v) is not None:
            raise ValueError(f"environment variable {k} holds a control character")
    return "".join(f"{k}={_squote(v)}\n" for k, v in sorted(merged.items()))


def _squote(value: str) -> str:
    """Always single-quoted (the node checks every line's form): ' becomes '\\''."""
    return "'" + value.replace("'", "'\\''") + "'"


def manifest(d: Deployment, sid: str, token: str, started_at: str) -> dict[str, Any]:
    """What the node records about a server; no secrets (the argv has none)."""
    return {
        "sid": sid,
        "node": d.node,
        "model": d.model,
        "variant": d.variant,
        "gpu_indices": list(d.gpu_indices),
        "port": d.port,
        "args_hash": d.args_hash,
        "token": token,
        "started_at": started_at,
        "argv": list(d.vllm_args),
    }


class NodeAgent:
    """The node-side operations, over one open session."""

    def __init__(self, session: Runner, vllm_command: str = "vllm", timeout_s: float = 60):
        self.session = session
        self.vllm = shlex.split(vllm_command)
        self.timeout_s = timeout_s

    def put_file(self, folder: str, name: str, data: bytes) -> None:
        """Write `data` to `folder`/`name` on the node (the folder made if need be). Raises
        StartError("copy-failed")."""
        text = base64.b64encode(data).decode()
        res = self.session.run(_script(_PUT, folder, name), self.timeout_s, stdin=text)
        if not res.ok:
            detail = (res.stderr or res.stdout).strip()[-300:]
            raise StartError("copy-failed", f"{folder}/{name}: {detail}")

    def start(
        self,
        d: Deployment,
        secret_env: dict[str, str],
        started_at: str,
        supervisor: Supervisor = "auto",
    ) -> tuple[str, str]:
        """Start `d` detached; returns (sid, how it runs). Raises StartError."""
        sid = server_id(d)
        token = f"{sid}-{secrets.token_hex(8)}"
        doc = json.dumps(manifest(d, sid, token, started_at), separators=(",", ": "))
        argv = [*self.vllm, *d.vllm_args]
        cmd = _script(_START, sid, str(d.port), doc, supervisor, *argv)
        res = self.session.run(cmd, self.timeout_s, stdin=env_file(d, secret_env, token))
        if res.exit_code == 3:
            raise StartError("port-taken", res.stderr.strip())
        if not res.ok:
            raise StartError("start-failed", (res.stderr or res.stdout).strip()[-500:])
        return sid, res.stdout.strip()

    def stop(self, sids: list[str], grace_s: int = 30) -> str:
        """Stop these servers (TERM, then KILL after `grace_s`) and remove their folders."""
        if not sids:
            return ""
        res = self.session.run(_script(_STOP, str(grace_s), *sids), grace_s + self.timeout_s)
        return res.stdout

    def inspect(self) -> list[Live]:
        """Every server fleetctl started on this node, alive or not."""
        res = self.session.run(_script(_INSPECT), self.timeout_s)
        return parse_inspect(res.stdout)

    def alive(self, sids: list[str]) -> dict[str, bool]:
        res = self.session.run(_script(_ALIVE, *sids), self.timeout_s)
        out = {}
        for line in res.stdout.splitlines():
            sid, _, flag = line.rpartition(" ")
            out[sid] = flag == "1"
        return out

    def log_tail(self, sid: str, lines: int = 30) -> str:
        return self.session.run(_script(_TAIL, str(lines), sid), self.timeout_s).stdout

    def startup_phases(self, sid: str) -> dict[str, float]:
        """The start-up phases the server's log names so far (calibration.parse_startup_log)."""
        from fleetctl.model.calibration import parse_startup_log

        return parse_startup_log(self.session.run(_script(_STARTUP, sid), self.timeout_s).stdout)


class StartError(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def parse_inspect(text: str) -> list[Live]:
    """Read the inspect script's `@@server` blocks; a damaged manifest reads as empty."""
    out: list[Live] = []
    block: dict[str, str] = {}

    def flush() -> None:
        if not block:
            return
        try:
            doc = json.loads(block.get("manifest", "") or "{}")
        except ValueError:
            doc = {}
        pid = block.get("pid", "")
        out.append(
            Live(
                sid=block["sid"],
                alive=block.get("alive") == "1",
                listening=block.get("listening") == "1",
                pid=int(pid) if pid.isdigit() else None,
                manifest=doc if isinstance(doc, dict) else {},
                holder=block.get("holder", "").strip(),
            )
        )

    for line in text.splitlines():
        if line.startswith("@@server "):
            flush()
            block = {"sid": line.split(" ", 1)[1].strip()}
        elif block and "=" in line:
            key, _, value = line.partition("=")
            block[key] = value
    flush()
    return out
