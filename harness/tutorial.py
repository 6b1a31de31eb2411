"""The tutorial (docs/tutorial.md) run as written, step by step: shared by its test and by
the first-hour benchmark.

How the page is read:
- a ```sh block is run; ```sh skip (installing, stopping) is not;
- a line ending in `&` starts in the background, as a shell would; when it names a port
  (`--port N`, `--listen HOST:N`) the next command waits until that port answers;
- a ```text block after a shell block lists lines its output must hold, whitespace aside,
  any number standing for any number and `...` for anything;
- the page's ports (8080, 8101, 8102) are replaced by free ones;
- `fleetctl traces get` downloads from `trace_mirror`, on 127.0.0.1, never the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .procs import Proc, free_ports
from .ready import first_answer

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "tutorial.md"
SLICE = REPO / "tests" / "data" / "azure_conv_slice.csv"  # source: tests/data/README.md
PAGE_PORTS = (8080, 8101, 8102)
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"\d[\d,.]*")


class StepFailed(AssertionError):
    """A tutorial command failed, or did not print what the page shows."""


@dataclass
class Step:
    script: str
    expect: list[str] = field(default_factory=list)


def steps(page: str) -> list[Step]:
    """The page's shell blocks to run, each with the lines its output must hold."""
    out: list[Step] = []
    last: str | None = None
    for lang, info, body in FENCE.findall(page):
        if lang == "sh":
            last = "skip" if "skip" in info.split() else "sh"
            if last == "sh":
                out.append(Step(body))
        elif lang == "text" and last == "sh":
            out[-1].expect += [line for line in body.splitlines() if line.strip()]
            last = None
        else:
            last = None
    return out


def commands(script: str) -> Iterator[str]:
    """Whole commands: a heredoc with its body, a line continued by `\\`."""
    lines = script.splitlines()
    i = 0
    while i < len(lines):
        cmd = lines[i]
        i += 1
        heredoc = re.search(r"<<'?(\w+)'?", cmd)
        if heredoc:
            while i < len(lines):
                cmd += "\n" + lines[i]
                i += 1
                if lines[i - 1].strip() == heredoc.group(1):
                    break
        while cmd.endswith("\\") and i < len(lines):
            cmd += "\n" + lines[i]
            i += 1
        if cmd.strip():
            yield cmd


def pattern(line: str) -> re.Pattern[str]:
    """An expected line as a regex: whitespace runs alike, numbers any number, ... anything."""
    parts = []
    for piece in re.split(r"(\.\.\.)", " ".join(line.split())):
        if piece == "...":
            parts.append(".*")
            continue
        at = 0
        for m in NUMBER.finditer(piece):
            parts.append(re.escape(piece[at : m.start()]) + r"\d[\d,.]*")
            at = m.end()
        parts.append(re.escape(piece[at:]))
    return re.compile("".join(parts))


def holds(output: str, line: str) -> bool:
    """Whether `output` has the page's `line` (see `pattern`)."""
    return pattern(line).search(" ".join(output.split())) is not None


@contextlib.contextmanager
def trace_mirror(root: Path) -> Iterator[dict[str, str]]:
    """The Azure slice served from 127.0.0.1 as `azure-conv-2023`: the environment that points
    `fleetctl traces` there (a registry entry with the slice's size and checksum) and at a
    cache of its own under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    data = SLICE.read_bytes()
    (root / SLICE.name).write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kw):  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kw)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    entry = {
        "name": "azure-conv-2023",
        "url": f"http://127.0.0.1:{server.server_address[1]}/{SLICE.name}",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    registry = root / "registry.json"
    registry.write_text(json.dumps([entry]))
    try:
        yield {"FLEETCTL_TRACE_REGISTRY": str(registry), "FLEETCTL_CACHE": str(root / "cache")}
    finally:
        server.shutdown()


def run(
    work: Path,
    log_dir: Path,
    env: dict[str, str],
    page: Path = PAGE,
    until_routed: bool = False,
) -> dict[str, float]:
    """Run the page's steps in `work` (empty), background processes logging to `log_dir`;
    raise StepFailed at the first step that fails. Returns seconds from the start to the first
    routed request (`first_routed_s`) and to the end (`total_s`); with `until_routed`, stop
    after the step that routed the first request."""
    ports = dict(zip(PAGE_PORTS, free_ports(len(PAGE_PORTS)), strict=True))
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **env}  # no line wrapped
    background: list[Proc] = []
    started = time.monotonic()
    timings: dict[str, float] = {}
    try:
        for n, step in enumerate(steps(page.read_text())):
            output = ""
            for cmd in commands(step.script):
                for page_port, port in ports.items():
                    cmd = re.sub(rf"\b{page_port}\b", str(port), cmd)
                if cmd.rstrip().endswith("&"):
                    proc = Proc(
                        f"step{n + 1}-{len(background)}",
                        ["bash", "-c", cmd.rstrip().rstrip("&")],
                        log_dir,
                        env=env,
                        cwd=work,
                    )
                    background.append(proc)
                    named = re.search(r"(?:--port |--listen [\d.]+:)(\d+)", cmd)
                    if named:
                        first_answer(int(named.group(1)), "/health", proc, deadline_s=120)
                    continue
                done = subprocess.run(
                    ["bash", "-e", "-o", "pipefail", "-c", cmd],
                    cwd=work,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                output += done.stdout + done.stderr
                if done.returncode != 0:
                    raise StepFailed(
                        f"tutorial step {n + 1}: `{cmd}` exited {done.returncode}:\n"
                        f"{output[-3000:]}"
                    )
                if "first_routed_s" not in timings and "/v1/chat/completions" in cmd:
                    timings["first_routed_s"] = time.monotonic() - started
            for line in step.expect:
                if not holds(output, line):
                    raise StepFailed(
                        f"tutorial step {n + 1}: the page shows {line!r}, the tool printed:\n"
                        f"{output[-3000:]}"
                    )
            if until_routed and "first_routed_s" in timings:
                break
    finally:
        for proc in reversed(background):
            proc.stop()
    timings["total_s"] = time.monotonic() - started
    return timings
