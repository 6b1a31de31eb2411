"""Probing nodes: what each one runs (GPUs, driver, CUDA, vLLM, OS), gathered over one SSH
connection per node, in parallel, with a named error per node that failed."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fleetctl.fleet.facts import Facts, GpuFacts, GpuProcess, NodeFacts, Problem
from fleetctl.fleet.facts_parse import (
    COMPUTE_APPS_FIELDS,
    QUERY_FIELDS,
    QUERY_FIELDS_LEGACY,
    GpuRow,
    SmiError,
    network_gbps,
    parse_compute_apps_csv,
    parse_smi_query_csv,
    parse_smi_table,
    parse_topo,
)
from fleetctl.fleet.inventory import Inventory, Node
from fleetctl.fleet.ssh import NodeError, Result, SshOptions, SshSession, Target, quote

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
echo "net_speeds_mbps=$(for d in /sys/class/net/*; do [ -e "$d/device" ] || continue; \
  [ "$(cat "$d/operstate" 2>/dev/null)" = up ] && printf '%s ' "$(cat "$d/speed" 2>/dev/null)"; \
  done)"
echo "rdma_devices=$(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
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


def probe_node(session: SshSession) -> NodeFacts:
    """Facts of one node over an open session; NodeError on failure."""
    kv: dict[str, str | None] = {}
    for line in session.run(NODE_SCRIPT).stdout.splitlines():
        key, _, value = line.partition("=")
        kv[key] = value or None
    py = session.run("python3 -", stdin=PYTHON_SCRIPT)
    info: dict[str, Any] = {}
    if py.ok and py.stdout.strip().startswith("{"):
        info = json.loads(py.stdout)
    gpus = _nvml_gpus(info["nvml"]) if "nvml" in info else _smi_gpus(session)
    topo = session.run("nvidia-smi topo -m")
    parsed = parse_topo(topo.stdout + topo.stderr) if topo.ok else None
    return NodeFacts(
        hostname=kv.get("hostname"),
        os=kv.get("os"),
        kernel=kv.get("kernel"),
        cpus=_int(kv.get("cpus")),
        mem_total_kib=_int(kv.get("mem_total_kib")),
        disk_free_kib=_int(kv.get("disk_free_kib")),
        # Processes of servers `fleetctl apply` started (they carry its token, children
        # included): `health` tells them from foreign processes on the GPUs by pid, not name.
        fleetctl_pids=tuple(sorted(int(p) for p in (kv.get("fleetctl_pids") or "").split())),
        python=info.get("python"),
        vllm=info.get("vllm"),
        gpu_source=gpus.source,
        driver_version=gpus.driver_version,
        cuda_version=gpus.cuda_version,
        gpus=gpus.gpus,
        gpu_error=gpus.error,
        interconnect=parsed.get("interconnect") if isinstance(parsed, dict) else None,
        network_gbps=network_gbps(kv.get("net_speeds_mbps")),
        rdma=bool((kv.get("rdma_devices") or "").split()) if "rdma_devices" in kv else None,
    )


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


@dataclass(frozen=True)
class _Gpus:
    """A node's GPUs and driver, from whichever source answered."""

    source: str
    gpus: tuple[GpuFacts, ...] = ()
    driver_version: str | None = None
    cuda_version: str | None = None
    error: Problem | None = None


def _nvml_gpus(nvml: dict[str, Any]) -> _Gpus:
    """The probe script's NVML JSON (it runs on the node, so it is read defensively)."""
    gpus = tuple(
        GpuFacts(
            index=g.get("index"),
            name=g.get("name"),
            uuid=g.get("uuid"),
            memory_total_mib=g.get("memory_total_mib"),
            memory_used_mib=g.get("memory_used_mib"),
            compute_cap=g.get("compute_cap"),
            ecc_uncorrected_volatile=g.get("ecc_uncorrected_volatile"),
            processes=tuple(
                GpuProcess(p.get("pid"), p.get("used_memory_mib")) for p in g.get("processes", [])
            ),
        )
        for g in nvml.get("gpus", [])
    )
    return _Gpus("nvml", gpus, nvml.get("driver_version"), nvml.get("cuda_version"))


def _smi_gpus(session: SshSession) -> _Gpus:
    """GPUs from nvidia-smi's CSV query; driver errors become the node's `gpu_error`."""
    fields: tuple[str, ...] = QUERY_FIELDS
    rows = _query(session, fields)
    if isinstance(rows, SmiError) and rows.kind == "invalid_field":
        rows = _query(session, QUERY_FIELDS_LEGACY)
    if isinstance(rows, SmiError):
        if rows.kind == "no_devices":
            return _Gpus("nvidia-smi")
        return _Gpus("nvidia-smi", error=Problem(rows.kind, rows.message))
    table = parse_smi_table(session.run("nvidia-smi").stdout)
    apps_res = session.run(
        "nvidia-smi "
        + quote(
            f"--query-compute-apps={','.join(COMPUTE_APPS_FIELDS)}", "--format=csv,noheader,nounits"
        )
    )
    apps = parse_compute_apps_csv(apps_res.stdout + apps_res.stderr)
    by_uuid: dict[str, list[GpuProcess]] = {}
    if not isinstance(apps, SmiError):
        for a in apps:
            by_uuid.setdefault(a.gpu_uuid, []).append(
                GpuProcess(a.pid, a.used_memory_mib, a.process_name)
            )
    gpus = tuple(
        GpuFacts(
            index=r.index,
            name=r.name,
            uuid=r.uuid,
            memory_total_mib=r.memory_total_mib,
            memory_used_mib=r.memory_used_mib,
            compute_cap=r.compute_cap,
            ecc_uncorrected_volatile=r.ecc_uncorrected_volatile,
            retired_pages_pending=r.retired_pages_pending,
            processes=tuple(by_uuid.get(r.uuid or "", [])),
        )
        for r in rows
    )
    return _Gpus(
        "nvidia-smi",
        gpus,
        rows[0].driver_version if rows else None,
        None if isinstance(table, SmiError) else table.cuda_version,
    )


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
) -> Facts:
    """Facts for every node, probed `parallel` at a time; failed nodes carry `error`."""
    todo = list(nodes if nodes is not None else inv.nodes)

    def one(n: Node) -> tuple[str, NodeFacts]:
        started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        try:
            with SshSession(target(inv, n), options) as session:
                found = probe_node(session)
        except NodeError as e:
            found = NodeFacts(error=Problem(e.kind, e.detail, e.line(), e.where))
        if on_done:
            on_done(n.name)
        return n.name, dataclasses.replace(found, host=n.host, probed_at=started)

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(todo) or 1))) as pool:
        results = dict(pool.map(one, todo))
    return Facts(
        nodes=results,
        probed_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        inventory=str(inv.path),
    )


def local_facts() -> NodeFacts:
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
