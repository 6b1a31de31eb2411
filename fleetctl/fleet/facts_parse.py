"""Pure parsers that turn what `nvidia-smi` prints on a node into typed facts.

Kept whole because each parser sits beside the captured output it was written against, and they
share the row and problem types.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

from fleetctl.base.text import plural

# What the probe sends. `compute_cap` is unknown to older drivers (470.x answers
# `Field "compute_cap" is not a valid field to query.`), so the probe retries without it.
QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "memory.used",
    "compute_cap",
    "driver_version",
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
)
QUERY_FIELDS_LEGACY: tuple[str, ...] = tuple(f for f in QUERY_FIELDS if f != "compute_cap")
COMPUTE_APPS_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "process_name", "used_memory")

ErrorKind = Literal[
    "nvml_version_mismatch",
    "nvml_init_failed",
    "driver_not_loaded",
    "no_devices",
    "not_installed",
    "invalid_field",
    "malformed",
    "unrecognized",
]


def _json(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


@dataclass(frozen=True)
class SmiError:
    """A node answered, but with an error instead of facts."""

    kind: ErrorKind
    message: str  # the line nvidia-smi (or the shell) printed
    detail: str | None = None  # NVML library version, or the rejected query field

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(frozen=True)
class SmiGpu:
    index: int
    name: str  # as printed; older drivers cut long names to "NVIDIA GeForce ..."
    bus_id: str | None
    persistence_mode: str | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_percent: int | None
    temperature_c: int | None
    power_draw_w: int | None
    power_cap_w: int | None
    fan_percent: int | None
    perf_state: str | None
    compute_mode: str | None
    ecc_uncorrected: str | None  # "0", "Off", "On" (MIG) or None for N/A
    mig_mode: str | None  # "Enabled" / "Disabled"; None where N/A or not printed

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(frozen=True)
class MigDevice:
    gpu_index: int
    gpu_instance: int
    compute_instance: int
    mig_device: int
    memory_used_mib: int | None
    memory_total_mib: int | None
    sm_count: int | None

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(frozen=True)
class SmiProcess:
    gpu_index: int
    gpu_instance: int | None  # None outside MIG ("N/A") and in tables without GI/CI columns
    compute_instance: int | None
    pid: int
    type: str  # C, G, C+G, M, ...
    process_name: str
    memory_mib: int | None

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(frozen=True)
class SmiReport:
    """The default `nvidia-smi` table."""

    smi_version: str | None
    driver_version: str | None
    cuda_version: str | None  # the newest CUDA the driver supports, not an installed toolkit
    gpus: tuple[SmiGpu, ...]
    mig_devices: tuple[MigDevice, ...]
    processes: tuple[SmiProcess, ...]

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(frozen=True)
class GpuRow:
    """One line of `--query-gpu` CSV; every value nvidia-smi could not give is None."""

    index: int | None
    name: str | None
    uuid: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    compute_cap: str | None
    driver_version: str | None
    ecc_uncorrected_volatile: int | None
    retired_pages_pending: bool | None
    values: tuple[tuple[str, str | None], ...]  # every queried field, raw text

    def to_json(self) -> dict[str, Any]:
        out = _json(self)
        out["values"] = dict(self.values)
        return out


@dataclass(frozen=True)
class ComputeApp:
    gpu_uuid: str
    pid: int
    process_name: str
    used_memory_mib: int | None

    def to_json(self) -> dict[str, Any]:
        return _json(self)


# --- errors ---------------------------------------------------------------------------------

_ERRORS: tuple[tuple[re.Pattern[str], ErrorKind], ...] = (
    (
        re.compile(r"Failed to initialize NVML: Driver/library version mismatch"),
        "nvml_version_mismatch",
    ),
    (re.compile(r"Failed to initialize NVML\b"), "nvml_init_failed"),
    # Pastes carry a straight or a curly apostrophe here, so any character matches it.
    (
        re.compile(r"NVIDIA-SMI has failed because it couldn.t communicate with the NVIDIA driver"),
        "driver_not_loaded",
    ),
    (re.compile(r"No devices were found"), "no_devices"),
    # bash, dash and Python's FileNotFoundError word it differently.
    (
        re.compile(r"nvidia-smi: (?:command )?not found|No such file or directory.*nvidia-smi"),
        "not_installed",
    ),
    (re.compile(r'Field "([^"]+)" is not a valid field to query'), "invalid_field"),
)


def detect_error(text: str) -> SmiError | None:
    """The error nvidia-smi (or the shell running it) printed instead of output, if any."""
    for line in text.splitlines():
        for pattern, kind in _ERRORS:
            m = pattern.search(line)
            if m is None:
                continue
            detail = None
            if kind == "invalid_field":
                detail = m.group(1)
            elif kind == "nvml_version_mismatch":
                lib = re.search(r"NVML library version:\s*(\S+)", text)
                detail = lib.group(1) if lib else None
            return SmiError(kind, line.strip(), detail)
    return None


# --- the default table ----------------------------------------------------------------------

_HEADER = re.compile(
    r"NVIDIA-SMI\s+(?P<smi>\d[\w.]*)"
    # Drivers 610+ call these "KMD Version" and "CUDA UMD Version".
    r"(?:.*?(?:Driver|KMD) Version:\s*(?P<driver>\S+))?"
    r"(?:.*?CUDA (?:UMD )?Version:\s*(?P<cuda>[\d.]+))?"
)
_GPU_LINE1 = re.compile(r"^\s*(\d+)\s+(.*?)\s+(On|Off|N/A|WDDM|TCC|MCDM)\s*$")
_GPU_LINE2 = re.compile(r"^\s*(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*/\s*(\S+)\s*$")
_MEMORY = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")
_PROCESS = re.compile(
    r"^\|\s*(\d+)\s+(\d+|N/A)\s+(\d+|N/A)\s+(\d+)\s+([CGM][CGM+]*)\s+(.*?)\s+(\d+MiB|N/A)\s*\|$"
)
# Drivers before 450 printed no GI/CI columns.
_PROCESS_OLD = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+([CGM][CGM+]*)\s+(.*?)\s+(\d+MiB|N/A)\s*\|$")


def _num(text: str | None) -> int | None:
    """The leading integer of '27C', '72W', '0%', '1MiB'; None for N/A, ERR! and the like."""
    if text is None:
        return None
    m = re.match(r"^\s*(\d+)", text)
    return int(m.group(1)) if m else None


def _na(text: str) -> str | None:
    value = text.strip()
    return None if value in ("", "N/A", "[N/A]") else value


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _cells(line: str) -> list[str]:
    return line.strip().strip("|").split("|")


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """Split the table into its GPU, MIG-devices and processes parts by their headings."""
    out: dict[str, list[str]] = {"gpus": [], "mig": [], "processes": []}
    current: str | None = None
    header_done = {"gpus": False, "mig": False, "processes": False}
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("| GPU  Name") and current is None:
            current = "gpus"
        elif stripped.startswith("| MIG devices:"):
            current = "mig"
        elif stripped.startswith("| Processes:"):
            current = "processes"
        if current is None:
            continue
        if stripped.startswith("|="):
            header_done[current] = True
            continue
        if header_done[current] and stripped.startswith("|"):
            out[current].append(stripped)
        elif header_done[current] and stripped.startswith("+"):
            out[current].append("+")
        elif header_done[current] and not stripped:
            # A blank line ends the GPU part; the MIG and processes parts have headings.
            current = None if current == "gpus" else current
    return out


def _blocks(lines: list[str]) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line == "+":
            blocks.append([])
        else:
            blocks[-1].append(line)
    return [b for b in blocks if b]


def _gpu(block: list[str]) -> SmiGpu | None:
    first = _cells(block[0])
    if len(first) < 3:
        return None
    m = _GPU_LINE1.match(first[0])
    if m is None:
        return None
    index, name, persistence = int(m.group(1)), m.group(2), m.group(3)
    bus_id = first[1].split()[0] if first[1].split() else None
    ecc = _na(first[2])
    fan = temp = power = cap = util = used = total = None
    perf = compute = mig = None
    if len(block) > 1 and len(second := _cells(block[1])) >= 3:
        if (p := _GPU_LINE2.match(second[0])) is not None:
            fan, temp, perf = _num(p.group(1)), _num(p.group(2)), _na(p.group(3))
            power, cap = _num(p.group(4)), _num(p.group(5))
        if (mem := _MEMORY.search(second[1])) is not None:
            used, total = int(mem.group(1)), int(mem.group(2))
        util_text, _, mode = second[2].strip().partition(" ")
        util, compute = _num(util_text), _na(mode)
    if len(block) > 2 and len(third := _cells(block[2])) >= 3:
        mig = _na(third[2])
    return SmiGpu(
        index=index,
        name=name,
        bus_id=bus_id,
        persistence_mode=None if persistence == "N/A" else persistence,
        memory_used_mib=used,
        memory_total_mib=total,
        utilization_percent=util,
        temperature_c=temp,
        power_draw_w=power,
        power_cap_w=cap,
        fan_percent=fan,
        perf_state=perf,
        compute_mode=compute,
        ecc_uncorrected=ecc,
        mig_mode=mig,
    )


def _mig_device(block: list[str]) -> MigDevice | None:
    first = _cells(block[0])
    ids = first[0].split() if first else []
    if len(first) < 3 or len(ids) != 4 or not all(i.isdigit() for i in ids):
        return None
    mem = _MEMORY.search(first[1])
    sm = first[2].split()
    return MigDevice(
        gpu_index=int(ids[0]),
        gpu_instance=int(ids[1]),
        compute_instance=int(ids[2]),
        mig_device=int(ids[3]),
        memory_used_mib=int(mem.group(1)) if mem else None,
        memory_total_mib=int(mem.group(2)) if mem else None,
        sm_count=_num(sm[0]) if sm else None,
    )


def _process(line: str) -> SmiProcess | None:
    if (m := _PROCESS.match(line)) is not None:
        return SmiProcess(
            gpu_index=int(m.group(1)),
            gpu_instance=_num(m.group(2)),
            compute_instance=_num(m.group(3)),
            pid=int(m.group(4)),
            type=m.group(5),
            process_name=m.group(6),
            memory_mib=_num(m.group(7)),
        )
    if (m := _PROCESS_OLD.match(line)) is not None:
        return SmiProcess(
            gpu_index=int(m.group(1)),
            gpu_instance=None,
            compute_instance=None,
            pid=int(m.group(2)),
            type=m.group(3),
            process_name=m.group(4),
            memory_mib=_num(m.group(5)),
        )
    return None


def parse_smi_table(text: str) -> SmiReport | SmiError:
    """Parse the default `nvidia-smi` output; an error message becomes an SmiError.

    Tolerates output cut short (an SSH session dropped mid-table): whatever complete rows
    arrived are returned.
    """
    lines = text.splitlines()
    header = next((m for line in lines if (m := _HEADER.search(line))), None)
    sections = _sections(lines)
    if not any(sections.values()):
        if (error := detect_error(text)) is not None:
            return error
        if header is None:
            return SmiError("unrecognized", _first_line(text))
    gpus = tuple(g for b in _blocks(sections["gpus"]) if (g := _gpu(b)) is not None)
    migs = tuple(d for b in _blocks(sections["mig"]) if (d := _mig_device(b)) is not None)
    procs = tuple(p for line in sections["processes"] if (p := _process(line)) is not None)
    return SmiReport(
        smi_version=header.group("smi") if header else None,
        driver_version=header.group("driver") if header else None,
        cuda_version=header.group("cuda") if header else None,
        gpus=gpus,
        mig_devices=migs,
        processes=procs,
    )


# --- CSV queries ----------------------------------------------------------------------------

_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id"}


def _csv_value(text: str) -> str | None:
    value = text.strip()
    # Older drivers print "[Not Supported]" where newer ones print "[N/A]" (enkore/i3pystatus#776).
    return None if value in ("[N/A]", "[Not Supported]", "N/A", "") else value


def _csv_rows(text: str) -> list[list[str]]:
    return [line.split(",") for line in text.splitlines() if line.strip()]


def _field_name(header_cell: str) -> str:
    """'memory.total [MiB]' -> 'memory.total'."""
    return _ALIASES.get(name := header_cell.split("[")[0].strip(), name)


def _is_header(row: list[str], fields: tuple[str, ...]) -> bool:
    return bool(fields) and _field_name(row[0]) == _ALIASES.get(fields[0], fields[0])


def _pending(value: str | None) -> bool | None:
    return None if value is None else value.strip().lower() == "yes"


def parse_smi_query_csv(text: str, fields: tuple[str, ...] | list[str]) -> list[GpuRow] | SmiError:
    """Parse `nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]`.

    `fields` is what was asked for, in order. A header line, if printed, is checked against it
    and skipped; units ("46068 MiB", "52 %") are stripped from numbers when `nounits` was not
    given. `[N/A]` and `[Not Supported]` become None.
    """
    if (error := detect_error(text)) is not None:
        return error
    wanted = tuple(_ALIASES.get(f, f) for f in fields)
    rows = _csv_rows(text)
    if rows and _is_header(rows[0], wanted):
        header = tuple(_field_name(c) for c in rows[0])
        if header != wanted:
            return SmiError("malformed", ", ".join(header), "header differs from the query")
        rows = rows[1:]
    out: list[GpuRow] = []
    for row in rows:
        if len(row) != len(wanted):
            return SmiError(
                "malformed",
                ",".join(row),
                f"{plural(len(row), 'value')} for {plural(len(wanted), 'field')}",
            )
        values = {f: _csv_value(v) for f, v in zip(wanted, row, strict=True)}
        out.append(
            GpuRow(
                index=_num(values.get("index")),
                name=values.get("name"),
                uuid=values.get("uuid"),
                memory_total_mib=_num(values.get("memory.total")),
                memory_used_mib=_num(values.get("memory.used")),
                compute_cap=values.get("compute_cap"),
                driver_version=values.get("driver_version"),
                ecc_uncorrected_volatile=_num(values.get("ecc.errors.uncorrected.volatile.total")),
                retired_pages_pending=_pending(values.get("retired_pages.pending")),
                values=tuple(values.items()),
            )
        )
    return out


def parse_compute_apps_csv(text: str) -> list[ComputeApp] | SmiError:
    """Parse `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory
    --format=csv,noheader,nounits`; no output means no processes."""
    if (error := detect_error(text)) is not None:
        return error
    out: list[ComputeApp] = []
    for row in _csv_rows(text):
        if _is_header(row, COMPUTE_APPS_FIELDS):
            continue
        if len(row) < 4 or not row[1].strip().isdigit():
            return SmiError("malformed", ",".join(row), "expected uuid, pid, name, memory")
        # nvidia-smi does not quote CSV, so a comma inside a process name splits it: the name
        # is everything between the pid and the last value.
        out.append(
            ComputeApp(
                gpu_uuid=row[0].strip(),
                pid=int(row[1]),
                process_name=",".join(row[2:-1]).strip(),
                used_memory_mib=_num(_csv_value(row[-1])),
            )
        )
    return out


# --- topology -------------------------------------------------------------------------------

_NVLINK = re.compile(r"^NV(\d+|B)$")
_AFFINITY_COLUMNS = ("cpu_affinity", "numa_affinity", "gpu_numa_id")


def parse_topo(text: str) -> dict[str, Any] | SmiError:
    """Parse `nvidia-smi topo -m` into its matrix and an interconnect summary.

    `interconnect` is "nvlink" when every pair of GPUs is joined by NVLink (NV#), "pcie" when
    any pair is not (a tensor-parallel group across all GPUs then crosses PCIe), and None with
    fewer than two GPUs. Columns are split on any whitespace, so the tab-separated original
    and space-aligned copies parse alike.
    """
    lines = text.splitlines()
    header_at = next(
        (
            i
            for i, line in enumerate(lines)
            if (t := line.split()) and t[0] == "GPU0" and (len(t) == 1 or t[1] != "X")
        ),
        None,
    )
    if header_at is None:
        return detect_error(text) or SmiError("unrecognized", _first_line(text))
    tokens = lines[header_at].split()
    devices = tokens[: tokens.index("CPU")] if "CPU" in tokens else tokens
    matrix: dict[str, dict[str, str]] = {}
    affinity: dict[str, dict[str, str | None]] = {}
    nic_legend: dict[str, str] = {}
    for line in lines[header_at + 1 :]:
        row = line.split()
        if not row:
            continue
        if (legend := re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)) is not None:
            nic_legend[legend.group(1)] = legend.group(2)
            continue
        if row[0] not in devices:
            continue
        cells = row[1 : 1 + len(devices)]
        matrix[row[0]] = dict(zip(devices, cells, strict=False))
        if row[0].startswith("GPU"):
            rest = row[1 + len(devices) :]
            affinity[row[0]] = {
                c: _na(rest[i]) if i < len(rest) else None for i, c in enumerate(_AFFINITY_COLUMNS)
            }
    gpus = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    links: dict[str, str] = {}
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            code = matrix.get(a, {}).get(b) or matrix.get(b, {}).get(a)
            if code is not None:
                links[f"{a}-{b}"] = code
    interconnect: str | None = None
    if len(gpus) >= 2 and links:
        nvlink = all(_NVLINK.match(code) for code in links.values())
        interconnect = "nvlink" if nvlink else "pcie"
    return {
        "devices": devices,
        "gpus": gpus,
        "matrix": matrix,
        "affinity": affinity,
        "nic_legend": nic_legend,
        "gpu_links": links,
        "interconnect": interconnect,
    }


def network_gbps(speeds_mbps: str | None) -> float | None:
    """The fastest physical NIC that is up, in Gb/s, from the speeds /sys/class/net/*/speed
    gives (Mb/s; -1 or nothing where the driver does not say, as virtio's often does); None
    when none says."""
    known = [int(s) for s in (speeds_mbps or "").split() if s.lstrip("-").isdigit() and int(s) > 0]
    return max(known) / 1000 if known else None
