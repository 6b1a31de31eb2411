"""A stand-in for `systemd-run` and `systemctl` on SSH test hosts, which run no systemd.

It reproduces what matters to fleetctl's node scripts, as systemd.exec(5) and systemd-run(1)
document it: the unit's environment comes only from EnvironmentFile= (KEY=VALUE lines, single
and double quotes, backslash escapes); in the command line, "$$" is a literal "$", "${NAME}" is
replaced by the variable's value, and a word that is exactly "$NAME" is replaced by the value
split at whitespace. The real thing cannot run here (no systemd as PID 1); this is the
documented contract the test holds fleetctl's escaping against.

Usage: fake_systemd.py systemd-run [--user] [--quiet] [--collect] --unit U --property=K=V...
  -- EXE ARGS...  |  fake_systemd.py systemctl [--user] reset-failed|show|is-active|stop ... U
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

STATE = Path(os.environ.get("HOME", "/tmp")) / ".fake-systemd"
_VAR = re.compile(r"\$(\$|\{([A-Za-z_][A-Za-z0-9_]*)\})")


def parse_env_file(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("#", ";")):
            continue
        key, _, raw = line.partition("=")
        value, quote, i = [], "", 0
        while i < len(raw):
            c = raw[i]
            if quote == "'":
                if c == "'":
                    quote = ""
                else:
                    value.append(c)
            elif quote == '"':
                if c == '"':
                    quote = ""
                elif c == "\\" and i + 1 < len(raw):
                    i += 1
                    value.append(raw[i])
                else:
                    value.append(c)
            elif c in "'\"":
                quote = c
            elif c == "\\" and i + 1 < len(raw):
                i += 1
                value.append(raw[i])
            else:
                value.append(c)
            i += 1
        out[key.strip()] = "".join(value)
    return out


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    out: list[str] = []
    for word in argv:
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            out += env.get(whole.group(1), "").split()
            continue
        out.append(_VAR.sub(lambda m: "$" if m.group(1) == "$" else env.get(m.group(2), ""), word))
    return out


def systemd_run(args: list[str]) -> int:
    props: dict[str, str] = {}
    unit = ""
    while args and args[0] != "--":
        a = args.pop(0)
        if a == "--unit":
            unit = args.pop(0)
        elif a.startswith("--property="):
            k, _, v = a[len("--property=") :].partition("=")
            props[k] = v
    command = args[1:]
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    if "EnvironmentFile" in props:
        env.update(parse_env_file(Path(props["EnvironmentFile"]).read_text()))
    log = props.get("StandardOutput", "append:/dev/null").removeprefix("append:")
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            expand(command, env),
            env=env,
            cwd=props.get("WorkingDirectory"),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
            start_new_session=True,
        )
    STATE.mkdir(exist_ok=True)
    (STATE / unit).write_text(str(proc.pid))
    return 0


def systemctl(args: list[str]) -> int:
    args = [a for a in args if a not in ("--user", "--quiet", "-p", "MainPID", "--value")]
    verb, unit = args[0], args[-1]
    pid_file = STATE / unit
    pid = int(pid_file.read_text()) if pid_file.exists() else 0
    if verb == "show":
        print(pid)
    elif verb == "is-active":
        try:
            os.kill(pid, 0) if pid else None
            return 0 if pid else 3
        except OSError:
            return 3
    elif verb == "stop" and pid:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGTERM)
    return 0


if __name__ == "__main__":
    tool, rest = sys.argv[1], sys.argv[2:]
    sys.exit(systemd_run(rest) if tool == "systemd-run" else systemctl(rest))
