"""The nvidia-smi parsers against captured output (tests/data/nvidia, sources in its README)."""

from __future__ import annotations

import json

import pytest

from fleetctl.fleet.facts_parse import (
    COMPUTE_APPS_FIELDS,
    QUERY_FIELDS,
    QUERY_FIELDS_LEGACY,
    ComputeApp,
    GpuRow,
    SmiError,
    SmiReport,
    detect_error,
    parse_compute_apps_csv,
    parse_smi_query_csv,
    parse_smi_table,
    parse_topo,
)
from tests.conftest import TESTS

DATA = TESTS / "data" / "nvidia"


def fixture(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def report(name: str) -> SmiReport:
    parsed = parse_smi_table(fixture(name))
    assert isinstance(parsed, SmiReport), parsed
    return parsed


def rows(name: str, fields: tuple[str, ...] | list[str]) -> list[GpuRow]:
    parsed = parse_smi_query_csv(fixture(name), fields)
    assert isinstance(parsed, list), parsed
    return parsed


# --- the default table ----------------------------------------------------------------------

# file, driver, CUDA, GPUs, first GPU's name as printed, its memory total (MiB), MIG mode
TABLES = [
    ("smi-h100-80gb-hbm3-x8-driver550.txt", "550.90.07", "12.4", 8, "NVIDIA H100 80GB HBM3", 81559, "Disabled"),
    ("smi-a10-x1-driver550.txt", "550.127.05", "12.4", 1, "NVIDIA A10", 23028, None),
    ("smi-rtx4090-x1-driver580.txt", "580.65.06", "13.0", 1, "NVIDIA GeForce RTX 4090", 24564, None),
    ("smi-a100-sxm4-40gb-x1-driver450.txt", "450.80.02", "11.0", 1, "A100-SXM4-40GB", 40537, "Disabled"),
    ("smi-geforce-truncated-name-err-fan-driver525.txt", "525.125.06", "12.0", 1, "NVIDIA GeForce ...", 23028, None),
    ("smi-a100-sxm4-80gb-mig-enabled-driver545-excerpt.txt", "545.23.08", "12.3", 1, "NVIDIA A100-SXM4-80GB", 81920, "Enabled"),
    ("smi-a100-sxm-80gb-mig-enabled-x2-driver495-excerpt.txt", "495.29.05", "11.5", 2, "NVIDIA A100-SXM...", 81251, "Enabled"),
    ("smi-a10g-x1-driver535-excerpt.txt", "535.247.01", "12.2", 1, "NVIDIA A10G", 23028, None),
    ("smi-l4-x1-driver570-excerpt.txt", "570.133.20", "12.8", 1, "NVIDIA L4", 23034, None),
    ("smi-l40s-x1-driver550-excerpt.txt", "550.90.07", "12.4", 1, "NVIDIA L40S", 46068, None),
    ("smi-rtx3090-driver595-excerpt.txt", "595.84", "13.2", 1, "NVIDIA GeForce RTX 3090", 24576, None),
    ("smi-a800-sxm4-80gb-driver535-excerpt.txt", "535.86.10", "12.2", 1, "NVIDIA A800-SXM4-80GB", 81920, "Disabled"),
    ("smi-a100-sxm4-40gb-x2-driver580-excerpt.txt", "580.126.09", "13.0", 2, "NVIDIA A100-SXM4-40GB", 40960, "Disabled"),
    ("smi-b200-x2-driver610-kmd-header-excerpt.txt", "610.43.02", "13.3", 2, "NVIDIA B200", 183359, "Disabled"),
    ("smi-titan-xp-driver384-old-format-excerpt.txt", "384.66", None, 1, "TITAN Xp", 12174, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "driver", "cuda", "count", "gpu", "total", "mig"), TABLES)
def test_table_header_and_gpus(name, driver, cuda, count, gpu, total, mig):
    r = report(name)
    assert (r.driver_version, r.cuda_version) == (driver, cuda)
    assert [g.index for g in r.gpus] == list(range(count))
    assert {g.name for g in r.gpus} == {gpu}
    assert {g.memory_total_mib for g in r.gpus} == {total}
    assert r.gpus[0].mig_mode == mig
    json.dumps(r.to_json())  # the facts file stores it as JSON


def test_h100_node_row_by_row():
    r = report("smi-h100-80gb-hbm3-x8-driver550.txt")
    assert r.smi_version == "550.90.07"
    assert [g.bus_id for g in r.gpus][:2] == ["00000000:19:00.0", "00000000:3B:00.0"]
    last = r.gpus[7]
    assert (last.index, last.bus_id, last.temperature_c) == (7, "00000000:DB:00.0", 23)
    assert (last.power_draw_w, last.power_cap_w, last.memory_used_mib) == (72, 700, 1)
    assert (last.persistence_mode, last.perf_state, last.compute_mode) == ("On", "P0", "Default")
    assert (last.fan_percent, last.utilization_percent, last.ecc_uncorrected) == (None, 0, "0")
    assert r.processes == () and r.mig_devices == ()  # "No running processes found"


def test_na_and_err_cells_become_none():
    geforce = report("smi-geforce-truncated-name-err-fan-driver525.txt").gpus[0]
    assert geforce.fan_percent is None  # printed "ERR!"
    assert (geforce.temperature_c, geforce.perf_state, geforce.compute_mode) == (
        38,
        "P5",
        "E. Process",
    )
    rtx = report("smi-rtx3090-driver595-excerpt.txt").gpus[0]
    assert (rtx.ecc_uncorrected, rtx.mig_mode, rtx.fan_percent) == (None, None, 0)
    mig = report("smi-a100-sxm4-80gb-mig-enabled-driver545-excerpt.txt").gpus[0]
    assert mig.utilization_percent is None  # MIG-enabled GPUs print N/A utilization
    assert mig.ecc_uncorrected == "On"


def test_processes_with_and_without_gi_ci_columns():
    xorg, shell = report("smi-rtx4090-x1-driver580.txt").processes
    assert (xorg.gpu_index, xorg.pid, xorg.type, xorg.process_name, xorg.memory_mib) == (
        0,
        3230642,
        "G",
        "/usr/lib/xorg/Xorg",
        167,
    )
    assert (xorg.gpu_instance, xorg.compute_instance) == (None, None)
    assert (shell.process_name, shell.memory_mib) == ("/usr/bin/gnome-shell", 12)
    (old,) = report("smi-titan-xp-driver384-old-format-excerpt.txt").processes
    assert (old.gpu_index, old.pid, old.type, old.process_name, old.memory_mib) == (
        0,
        1568,
        "G",
        "/usr/lib/xorg/Xorg",
        1850,
    )


# file, then per MIG device: gpu, GI, CI, MIG dev, used MiB, total MiB, SMs
MIGS = [
    ("smi-a100-mig-3g20gb-x2-mig-section.txt", [(0, 1, 0, 0, 11, 20224, 42), (0, 2, 0, 1, 11, 20096, 42)]),
    ("smi-a100-sxm4-80gb-mig-devices-bar1-excerpt.txt", [(1, 3, 0, 0, 14366, 19968, 28), (1, 5, 0, 1, 9826, 19968, 28), (1, 6, 0, 2, 13, 19968, 28)]),
]  # fmt: skip
MIG_PROCESSES = "smi-a100-sxm4-80gb-mig-processes-excerpt.txt"


def test_processes_on_mig_instances():
    procs = report(MIG_PROCESSES).processes
    assert len(procs) == 10
    assert (procs[0].gpu_index, procs[0].gpu_instance, procs[0].process_name) == (
        0,
        None,
        "tritonserver",
    )
    on_mig = procs[1]
    assert (on_mig.gpu_index, on_mig.gpu_instance, on_mig.compute_instance) == (1, 3, 0)
    assert (on_mig.pid, on_mig.type, on_mig.memory_mib) == (34965, "C", 14195)
    assert sum(p.memory_mib or 0 for p in procs if p.gpu_index == 3) == 13313 + 9833 + 10321


@pytest.mark.parametrize(("name", "devices"), MIGS)
def test_mig_devices(name, devices):
    r = report(name)
    assert r.gpus == () and r.driver_version is None  # these captures hold only the MIG part
    got = [
        (
            d.gpu_index,
            d.gpu_instance,
            d.compute_instance,
            d.mig_device,
            d.memory_used_mib,
            d.memory_total_mib,
            d.sm_count,
        )
        for d in r.mig_devices
    ]
    assert got == devices


# --- errors instead of output ---------------------------------------------------------------

ERRORS = [
    ("err-nvml-mismatch-with-library-version.txt", "nvml_version_mismatch", "570.124"),
    ("err-nvml-mismatch.txt", "nvml_version_mismatch", None),
    ("err-no-devices-found.txt", "no_devices", None),
    ("err-command-not-found.txt", "not_installed", None),
    ("err-driver-not-loaded.txt", "driver_not_loaded", None),
]


@pytest.mark.parametrize(("name", "kind", "detail"), ERRORS)
def test_errors_are_typed_not_raised(name, kind, detail):
    text = fixture(name)
    for parsed in (
        parse_smi_table(text),
        parse_smi_query_csv(text, QUERY_FIELDS),
        parse_compute_apps_csv(text),
        parse_topo(text),
    ):
        assert isinstance(parsed, SmiError)
        assert (parsed.kind, parsed.detail) == (kind, detail)
        assert parsed.message == text.strip().splitlines()[0]
        assert parsed.to_json()["kind"] == kind


def test_unrecognized_text_is_an_error_too():
    for text in ("", "Segmentation fault (core dumped)\n"):
        parsed = parse_smi_table(text)
        assert isinstance(parsed, SmiError) and parsed.kind == "unrecognized"
    assert detect_error(fixture("smi-h100-80gb-hbm3-x8-driver550.txt")) is None


# --- --query-gpu CSV ------------------------------------------------------------------------


def test_probe_fields_are_the_documented_query():
    assert ",".join(QUERY_FIELDS) == (
        "index,name,uuid,memory.total,memory.used,compute_cap,driver_version,"
        "ecc.errors.uncorrected.volatile.total,retired_pages.pending"
    )
    assert "compute_cap" not in QUERY_FIELDS_LEGACY and len(QUERY_FIELDS_LEGACY) == 8


def test_old_driver_rejects_compute_cap():
    parsed = parse_smi_query_csv(fixture("query-err-compute-cap-not-valid.txt"), QUERY_FIELDS)
    assert isinstance(parsed, SmiError)
    assert (parsed.kind, parsed.detail) == ("invalid_field", "compute_cap")


def test_probe_query_a100_node():
    got = rows("constructed-query-probe-fields-a100-x8-driver535.csv", QUERY_FIELDS)
    assert [g.index for g in got] == list(range(8))
    assert {(g.name, g.memory_total_mib, g.compute_cap, g.driver_version) for g in got} == {
        ("NVIDIA A100-SXM4-80GB", 81920, "8.0", "535.104.05")
    }
    bad = [g for g in got if g.retired_pages_pending or g.ecc_uncorrected_volatile]
    assert [(g.index, g.ecc_uncorrected_volatile, g.retired_pages_pending) for g in bad] == [
        (3, 2, True)
    ]
    assert got[0].retired_pages_pending is False
    assert got[0].to_json()["values"]["uuid"] == "GPU-00000000-0000-4000-8000-000000000000"


def test_probe_query_na_and_not_supported_are_none():
    h100 = rows("constructed-query-probe-fields-h100-x2-driver550.csv", QUERY_FIELDS)
    assert [(g.compute_cap, g.ecc_uncorrected_volatile, g.retired_pages_pending) for g in h100] == [
        ("9.0", 0, None),
        ("9.0", 0, None),
    ]
    legacy = rows("constructed-query-legacy-fields-rtx3090-driver470.csv", QUERY_FIELDS_LEGACY)
    assert [(g.name, g.memory_total_mib, g.compute_cap) for g in legacy] == [
        ("NVIDIA GeForce RTX 3090", 24268, None),
        ("NVIDIA GeForce RTX 3090", 24268, None),
    ]
    assert {(g.ecc_uncorrected_volatile, g.retired_pages_pending) for g in legacy} == {(None, None)}


@pytest.mark.parametrize(
    ("name", "fan"),
    [("query-noheader-nounits-na.csv", None), ("query-noheader-nounits-not-supported.csv", None)],
)
def test_real_na_and_not_supported_values(name, fan):
    fields = "memory.total,memory.free,memory.used,temperature.gpu,fan.speed,utilization.gpu,utilization.memory"
    (row,) = rows(name, fields.split(","))
    values = dict(row.values)
    assert (row.memory_total_mib, row.memory_used_mib, values["temperature.gpu"]) == (2004, 0, "44")
    assert values["fan.speed"] is fan


def test_not_supported_with_units():
    fields = (
        "gpu_name,utilization.gpu,utilization.memory,temperature.gpu,power.draw,power.limit,"
        "fan.speed,pstate,clocks.current.graphics,clocks.current.memory,power.max_limit,power.default_limit"
    )
    (row,) = rows("query-gtx770-noheader-units-not-supported.csv", fields.split(","))
    values = dict(row.values)
    assert row.name == "GeForce GTX 770"
    assert (values["utilization.gpu"], values["power.draw"], values["fan.speed"]) == (
        None,
        None,
        "52 %",
    )


def test_header_and_units_are_handled():
    l40s = rows(
        "query-l40s-x2-header-units.csv",
        ["name", "driver_version", "memory.total", "pci.bus_id", "pci.device_id"],
    )
    assert [(g.name, g.driver_version, g.memory_total_mib) for g in l40s] == [
        ("NVIDIA L40S", "595.71.05", 46068),
        ("NVIDIA L40S", "595.71.05", 46068),
    ]
    assert [dict(g.values)["pci.bus_id"] for g in l40s] == ["00000000:01:00.0", "00000000:91:00.0"]
    fields = (
        "name,uuid,fan.speed,pstate,memory.reserved,memory.used,memory.free,utilization.gpu,"
        "utilization.memory,temperature.gpu,power.draw,clocks.current.graphics,clocks.current.sm,"
        "clocks.current.memory,clocks.current.video"
    )
    (p100,) = rows("query-tesla-p100-header-units.csv", fields.split(","))
    assert (p100.name, p100.uuid, p100.memory_used_mib) == (
        "Tesla P100-PCIE-16GB",
        "GPU-ef1b2c9b-38d8-2090-2bd1-f567a3eb42a6",
        0,
    )
    assert dict(p100.values)["fan.speed"] is None
    a10 = rows(
        "query-a10-timestamp-header-units.csv",
        [
            "timestamp",
            "pstate",
            "temperature.gpu",
            "utilization.gpu",
            "utilization.memory",
            "memory.total",
            "memory.free",
            "memory.used",
        ],
    )
    assert [g.memory_used_mib for g in a10] == [21, 7, 7, 7, 21]
    assert {g.memory_total_mib for g in a10} == {23028}
    (cap,) = rows("query-compute-cap-header.csv", ["compute_cap"])
    assert cap.compute_cap == "8.9"
    (nvl,) = rows("query-h100-nvl-noheader.csv", ["name", "pci.device_id"])
    assert nvl.name == "NVIDIA H100 NVL"


def test_query_mismatch_is_malformed_not_a_crash():
    parsed = parse_smi_query_csv(fixture("query-h100-nvl-noheader.csv"), QUERY_FIELDS)
    assert isinstance(parsed, SmiError) and parsed.kind == "malformed"
    parsed = parse_smi_query_csv(
        fixture("query-l40s-x2-header-units.csv"), ["name", "memory.total"]
    )
    assert isinstance(parsed, SmiError) and parsed.kind == "malformed"


# --- --query-compute-apps CSV ---------------------------------------------------------------


def test_compute_apps():
    apps = parse_compute_apps_csv(fixture("constructed-compute-apps.csv"))
    assert isinstance(apps, list)
    assert apps[0] == ComputeApp(
        "GPU-00000000-0000-4000-8000-000000000000", 55111, "tritonserver", 20481
    )
    assert [(a.pid, a.used_memory_mib) for a in apps] == [
        (55111, 20481),
        (34965, 14195),
        (58302, 149),
        (26294, None),
    ]
    assert apps[3].process_name == r"C:\Program Files\app, v2\app.exe"  # an unquoted comma
    assert parse_compute_apps_csv("") == []  # no compute processes prints nothing
    assert COMPUTE_APPS_FIELDS == ("gpu_uuid", "pid", "process_name", "used_memory")


# --- topo -m --------------------------------------------------------------------------------

# file, GPUs, interconnect, GPU0-GPU1 link, GPU0 CPU affinity, NICs in the legend, GPU pairs read
TOPOS = [
    ("topo-a100-x8-nv12-nic17.txt", 8, "nvlink", "NV12", "0-103", 17, 28),
    ("topo-nv18-x8-nic9-excerpt.txt", 8, "nvlink", "NV18", "0-23,96-119", 0, 27),
    ("topo-a10-x4-sys-nic2.txt", 4, "pcie", "SYS", "0-127", 2, 6),
    ("topo-gtx1080ti-x2-phb.txt", 2, "pcie", "PHB", "0-11", 0, 1),
    ("topo-rtx4090-x8-sys-tabs.txt", 8, "pcie", "SYS", "0-55,112-167", 0, 28),
]


@pytest.mark.parametrize(("name", "count", "interconnect", "link", "cpus", "nics", "pairs"), TOPOS)
def test_topo(name, count, interconnect, link, cpus, nics, pairs):
    topo = parse_topo(fixture(name))
    assert isinstance(topo, dict), topo
    assert topo["gpus"] == [f"GPU{i}" for i in range(count)]
    assert topo["interconnect"] == interconnect
    assert topo["matrix"]["GPU0"]["GPU1"] == link
    assert topo["matrix"]["GPU0"]["GPU0"] == "X"
    assert topo["affinity"]["GPU0"]["cpu_affinity"] == cpus
    assert len(topo["nic_legend"]) == nics
    assert len(topo["gpu_links"]) == pairs
    json.dumps(topo)


def test_topo_details():
    a100 = parse_topo(fixture("topo-a100-x8-nv12-nic17.txt"))
    assert isinstance(a100, dict)
    assert a100["devices"][-1] == "NIC16" and a100["nic_legend"]["NIC16"] == "mlx5_bond_0"
    assert a100["matrix"]["GPU0"]["NIC0"] == "PXB" and a100["matrix"]["NIC16"]["NIC16"] == "X"
    assert a100["affinity"]["GPU7"] == {
        "cpu_affinity": "0-103",
        "numa_affinity": "0",
        "gpu_numa_id": None,
    }
    rtx = parse_topo(fixture("topo-rtx4090-x8-sys-tabs.txt"))
    assert isinstance(rtx, dict)
    assert rtx["matrix"]["GPU6"]["NIC0"] == "PHB"
    assert rtx["affinity"]["GPU4"]["numa_affinity"] == "1"
    nv18 = parse_topo(fixture("topo-nv18-x8-nic9-excerpt.txt"))
    assert isinstance(nv18, dict)
    assert set(nv18["matrix"]) == {f"GPU{i}" for i in range(6)}  # the capture stops after GPU5
    assert nv18["gpu_links"]["GPU5-GPU7"] == "NV18"  # read from the rows that did arrive
    assert "GPU6-GPU7" not in nv18["gpu_links"]  # only rows GPU6 and GPU7 hold that pair
    assert nv18["affinity"]["GPU3"]["numa_affinity"] == "1"


def test_topo_single_gpu_has_no_interconnect():
    one = parse_topo(
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n"
    )
    assert isinstance(one, dict)
    assert (one["gpus"], one["interconnect"], one["gpu_links"]) == (["GPU0"], None, {})


# --- every fixture is used and documented ----------------------------------------------------

PARSED_BY = {"smi": parse_smi_table, "err": parse_smi_table, "topo": parse_topo}


@pytest.mark.parametrize(
    "path", sorted(p for p in DATA.iterdir() if p.name != "README.md"), ids=lambda p: p.name
)
def test_every_fixture_is_documented_and_parses(path):
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    assert f"`{path.name}`" in readme
    text = path.read_text(encoding="utf-8")
    kind = path.name.split("-")[0]
    if kind in PARSED_BY:
        parsed = PARSED_BY[kind](text)
        assert isinstance(parsed, SmiError) == (kind == "err")
    else:  # query-* and constructed-*: parsed with their own fields in the tests above
        assert path.name.startswith(("query-", "constructed-"))
        assert detect_error(text) is None or "err" in path.name
    used = {c[0] for c in TABLES + ERRORS + TOPOS + MIGS} | {MIG_PROCESSES}
    assert kind not in PARSED_BY or path.name in used
