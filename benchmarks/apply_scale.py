"""How long `fleetctl apply` takes on 100 nodes, and how that changes with --parallel.

Run (from the repository root, as root, in the dev venv):

    python benchmarks/apply_scale.py [--nodes 100] [--parallel 1,8,32,100] [--startup 2]

Each node is an sshd test host (harness/sshhosts.py: own network namespace, hostname and HOME)
with one declared RTX 4090, so the plan is one llama-3-8b server per node. The node's `vllm`
is a stand-in, not `fleetctl emulate`: a stdlib HTTP server that answers /health with 503 for
`--startup` seconds and then 200, and lists the served model in /v1/models. A hundred
emulators would spend ~60 CPU-seconds importing on this 2-core machine and measure that
instead; the stand-in starts in ~30 ms, so what is timed is apply itself (SSH connections,
the node-side scripts, starting, health polling, state writes) plus the modelled startup.

For each --parallel value: a fresh apply (100 creates), a second apply with nothing to change
(inspection of every node), `status`, and `destroy`, each a fresh `fleetctl` process, timed
by wall clock. `--parallel 1` runs on a tenth of the nodes (its row says how many).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.sshhosts import TestHosts  # noqa: E402

STAND_IN = r"""#!/usr/bin/env -S python3 -S
# A stand-in for `vllm serve`: healthy after STARTUP seconds, lists its model.
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
def opt(name, default):
    return args[args.index(name) + 1] if name in args else default
host, port = opt("--host", "127.0.0.1"), int(opt("--port", "8000"))
models = json.dumps({"object": "list", "data": [{"id": opt("--served-model-name", "m")}]})
ready_at = time.monotonic() + STARTUP
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b""
        if time.monotonic() < ready_at:
            code = 503
        elif self.path == "/health":
            code = 200
        elif self.path == "/v1/models":
            code, body = 200, models.encode()
        else:
            code = 404
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
HTTPServer((host, port), Handler).serve_forever()
"""


def inventory(hosts: TestHosts, path: Path, count: int) -> Path:
    lines = [
        f"ssh: {{user: root, identity_file: {hosts.client_key}, connect_timeout_s: 60}}",
        "nodes:",
    ]
    for h in list(hosts)[:count]:
        lines.append(
            f"  - {{name: {h.name}, host: {h.address}, gpus: {{type: RTX-4090, count: 1}}}}"
        )
    lines += [
        "models:",
        "  - name: llama-3-8b",
        "    profile: llama-3-8b",
        "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}",
        "    max_context: 8192",
        f"    min_replicas: {count}",  # one server per node
        "apply: {health_timeout_s: 120, stop_timeout_s: 5}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def fleetctl(*args: object) -> tuple[float, dict]:
    start = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "fleetctl", *map(str, args)], capture_output=True, text=True
    )
    took = time.monotonic() - start
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    if p.returncode != 0:
        raise SystemExit(f"fleetctl {' '.join(map(str, args[:2]))} failed:\n{p.stdout}\n{p.stderr}")
    return took, doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--parallel", default="1,8,32,100")
    ap.add_argument("--startup", type=float, default=2.0, help="seconds until a server is healthy")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, TestHosts(a.nodes) as hosts:
        for i in range(a.nodes):
            hosts.install(i, "vllm", STAND_IN.replace("STARTUP", repr(a.startup)))
        for par in [int(x) for x in a.parallel.split(",")]:
            count = max(1, a.nodes // 10) if par == 1 else a.nodes
            work = Path(tmp) / f"p{par}"
            work.mkdir()
            inv = inventory(hosts, work / "inventory.yaml", count)
            common = ["--known-hosts", hosts.known_hosts, "--parallel", par, "--json"]
            t_apply, doc = fleetctl("apply", inv, "--yes", *common)
            bad = [o for o in doc["outcomes"] if o["status"] != "ok"]
            assert not bad and len(doc["outcomes"]) == count, (bad[:3], len(doc["outcomes"]))
            t_again, doc = fleetctl("apply", inv, "--yes", *common)
            assert {o["action"] for o in doc["outcomes"]} == {"keep"}
            t_status, _ = fleetctl("status", inv, *common[:-1], "--json")
            t_destroy, _ = fleetctl("destroy", inv, "--yes", *common)
            rows.append(
                {
                    "parallel": par,
                    "nodes": count,
                    "apply_s": t_apply,
                    "reapply_s": t_again,
                    "status_s": t_status,
                    "destroy_s": t_destroy,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(
        f"\n- Command: `python benchmarks/apply_scale.py --nodes {a.nodes} --parallel {a.parallel} --startup {a.startup:g}`"
    )
    print(
        f"- Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"
    )
    print(f"- Date: {datetime.date.today().isoformat()}\n")
    print(
        "| --parallel | nodes | apply, all create (s) | re-apply, no change (s) | status (s) "
        "| destroy (s) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['parallel']} | {r['nodes']} | {r['apply_s']:.1f} | {r['reapply_s']:.1f} | "
            f"{r['status_s']:.1f} | {r['destroy_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
