"""Probing nodes: what each one runs (GPUs, driver, CUDA, vLLM, OS), gathered over one SSH
connection per node, in parallel, with a named error per node that failed."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleetctl.facts_parse import (
    COMPUTE_APPS_FIELDS,
    QUERY_FIELDS,
    QUERY_FIELDS_LEGACY,
    GpuRow,
    SmiError,
    parse_compute_apps_csv,
    parse_smi_query_csv,
    parse_smi_table,
    parse_topo,
)
from fleetctl.inventory import Inventory, Node
from fleetctl.ssh import NodeError, Result, SshOptions, SshSession, Target, quote

FACTS_FORMAT = 1

# Node facts as KEY=VALUE lines: one round trip, and every value quoted by the shell itself.
NODE_SCRIPT = r"""
echo "hostname=$(hostname)"
echo "os=$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
echo "kernel=$(uname -r)"
echo "cpus=$(nproc 2>/dev/null)"
echo "mem_total_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null)"
echo "disk_free_kib=$(df -Pk "$HOME" 2>/dev/null | awk 'NR==2 {print $4}')"
echo "fleetctl_pids=$(grep -l -s -z '^FLEETCTL_SERVER_TOKEN=' /proc/[0-9]*/environ 2>/dev/null \
  | sed 's,/proc/\([0-9]*\)/environ,\1,' | tr '\n' ' ')"
"""

# One Python start per node (`python3 -`): its version, vLLM's, and the GPUs through NVML when
# the node has nvidia-ml-py (module pynvml); prints one JSON object.
PYTHON_SCRIPT = r"""
import json, platform
out = {"python": platform.python_version(), "vllm": None}
try:
    import importlib.metadata as md
    out["vllm"] = md.version("vllm")
except Exception:
    pass
try:
    import pynvml as n
    n.nvmlInit()
    def s(x): return x.decode() if isinstance(x, bytes) else x
    nvml = {"driver_version": s(n.nvmlSystemGetDriverVersion()), "gpus": []}
    v = n.nvmlSystemGetCudaDriverVersion_v2()
    nvml["cuda_version"] = f"{v // 1000}.{v % 1000 // 10}"
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        g = {"index": i, "name": s(n.nvmlDeviceGetName(h)), "uuid": s(n.nvmlDeviceGetUUID(h)),
             "memory_total_mib": mem.total // 2**20, "memory_used_mib": mem.used // 2**20}
        try:
            major, minor = n.nvmlDeviceGetCudaComputeCapability(h)
            g["compute_cap"] = f"{major}.{minor}"
        except n.NVMLError:
            g["compute_cap"] = None
        try:
            g["ecc_uncorrected_volatile"] = n.nvmlDeviceGetTotalEccErrors(h, 1, 0)
        except n.NVMLError:
            g["ecc_uncorrected_volatile"] = None
        g["processes"] = [
            {"pid": p.pid, "used_memory_mib": (p.usedGpuMemory or 0) // 2**20}
            for p in n.nvmlDeviceGetComputeRunningProcesses(h)
        ]
        nvml["gpus"].append(g)
    out["nvml"] = nvml
except Exception as e:  # no bindings, or no driver: nvidia-smi tells the story
    out["nvml_error"] = type(e).__name__
print(json.dumps(out))
"""


def target(inv: Inventory, n: Node) -> Target:
    """How to reach node `n`: its own user and port, else the inventory's SSH defaults."""
    ssh = inv.spec.ssh
    return Target(n.name, n.host, n.port, n.user or ssh.user, ssh.identity_file, ssh.proxy_jump)


def probe_node(session: SshSession) -> dict[str, Any]:
    """Facts of one node over an open session; NodeError on failure."""
    facts: dict[str, Any] = {}
    for line in session.run(NODE_SCRIPT).stdout.splitlines():
        key, _, value = line.partition("=")
        facts[key] = value or None
    for key in ("cpus", "mem_total_kib", "disk_free_kib"):
        facts[key] = int(facts[key]) if (facts.get(key) or "").isdigit() else None
    # Processes of servers `fleetctl apply` started (they carry its token, children included):
    # `health` tells them from foreign processes on the GPUs by pid, not by name.
    facts["fleetctl_pids"] = sorted(int(p) for p in (facts.get("fleetctl_pids") or "").split())
    py = session.run("python3 -", stdin=PYTHON_SCRIPT)
    info: dict[str, Any] = {}
    if py.ok and py.stdout.strip().startswith("{"):
        info = json.loads(py.stdout)
    facts["python"], facts["vllm"] = info.get("python"), info.get("vllm")
    if "nvml" in info:
        facts.update({"gpu_source": "nvml", **info["nvml"]})
    else:
        facts.update(_smi_facts(session))
    topo = session.run("nvidia-smi topo -m")
    parsed = parse_topo(topo.stdout + topo.stderr) if topo.ok else None
    facts["interconnect"] = parsed.get("interconnect") if isinstance(parsed, dict) else None
    return facts


def _smi_facts(session: SshSession) -> dict[str, Any]:
    """GPUs from nvidia-smi's CSV query; driver errors become the node's `gpu_error`."""
    fields: tuple[str, ...] = QUERY_FIELDS
    res = session.run(
        "nvidia-smi " + quote(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits")
    )
    rows = parse_smi_query_csv(res.stdout + res.stderr, fields)
    if isinstance(rows, SmiError) and rows.kind == "invalid_field":
        fields = QUERY_FIELDS_LEGACY
        res = session.run(
            "nvidia-smi "
            + quote(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits")
        )
        rows = parse_smi_query_csv(res.stdout + res.stderr, fields)
    if isinstance(rows, SmiError):
        if rows.kind == "no_devices":
            return {"gpu_source": "nvidia-smi", "gpus": []}
        return {
            "gpu_source": "nvidia-smi",
            "gpus": [],
            "gpu_error": {"kind": rows.kind, "message": rows.message},
        }
    table = parse_smi_table(session.run("nvidia-smi").stdout)
    apps_res = session.run(
        "nvidia-smi "
        + quote(
            f"--query-compute-apps={','.join(COMPUTE_APPS_FIELDS)}", "--format=csv,noheader,nounits"
        )
    )
    apps = parse_compute_apps_csv(apps_res.stdout + apps_res.stderr)
    by_uuid: dict[str, list[dict[str, Any]]] = {}
    if not isinstance(apps, SmiError):
        for a in apps:
            by_uuid.setdefault(a.gpu_uuid, []).append(
                {"pid": a.pid, "process_name": a.process_name, "used_memory_mib": a.used_memory_mib}
            )
    gpus = [
        {
            "index": r.index,
            "name": r.name,
            "uuid": r.uuid,
            "memory_total_mib": r.memory_total_mib,
            "memory_used_mib": r.memory_used_mib,
            "compute_cap": r.compute_cap,
            "ecc_uncorrected_volatile": r.ecc_uncorrected_volatile,
            "retired_pages_pending": r.retired_pages_pending,
            "processes": by_uuid.get(r.uuid or "", []),
        }
        for r in rows
    ]
    return {
        "gpu_source": "nvidia-smi",
        "driver_version": rows[0].driver_version if rows else None,
        "cuda_version": None if isinstance(table, SmiError) else table.cuda_version,
        "gpus": gpus,
    }


def _query(session: SshSession, fields: tuple[str, ...]) -> list[GpuRow] | SmiError:
    cmd = quote("nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits")
    res = session.run(cmd)
    return parse_smi_query_csv(res.stdout + res.stderr, fields)


def probe_fleet(
    inv: Inventory,
    options: SshOptions,
    parallel: int = 32,
    nodes: Sequence[Node] | None = None,
    on_done: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Facts for every node, probed `parallel` at a time; failed nodes carry `error`."""
    todo = list(nodes if nodes is not None else inv.nodes)

    def one(n: Node) -> tuple[str, dict[str, Any]]:
        started = dt.datetime.now(dt.UTC)
        entry: dict[str, Any] = {"host": n.host, "probed_at": started.isoformat(timespec="seconds")}
        try:
            with SshSession(target(inv, n), options) as session:
                entry.update(probe_node(session))
        except NodeError as e:
            entry["error"] = e.to_json()
        if on_done:
            on_done(n.name)
        return n.name, entry

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(todo) or 1))) as pool:
        results = dict(pool.map(one, todo))
    return {
        "format": FACTS_FORMAT,
        "probed_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "inventory": str(inv.path),
        "nodes": results,
    }


def local_facts() -> dict[str, Any]:
    """This machine's facts, through NVML directly (`fleetctl probe --local`)."""
    import subprocess

    class Local:
        def run(
            self, command: str, timeout_s: float | None = None, stdin: str | None = None
        ) -> Result:
            p = subprocess.run(
                ["sh", "-c", command],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout_s or 30,
            )
            return Result(p.stdout, p.stderr, p.returncode)

    return probe_node(Local())  # type: ignore[arg-type]
