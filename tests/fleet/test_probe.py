"""`fleetctl probe` and `fleetctl health` over real SSH to test hosts that replay real outputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.fake_smi import NVIDIA, RTX_QUERY, fake_smi
from harness.sshhosts import TestHosts, require

A100_QUERY = (NVIDIA / "constructed-query-probe-fields-a100-x8-driver535.csv").read_text()
NAMES = [f"a100-{i}" for i in range(1, 5)] + [f"rtx-{i}" for i in range(1, 9)]


@pytest.fixture(scope="module")
def hosts():
    require()
    with TestHosts(len(NAMES), names=NAMES) as hs:
        for i, name in enumerate(NAMES):
            if name.startswith("a100"):
                hs.install(
                    i,
                    "nvidia-smi",
                    fake_smi(
                        A100_QUERY,
                        "smi-a800-sxm4-80gb-driver535-excerpt.txt",
                        "topo-a100-x8-nv12-nic17.txt",
                    ),
                )
            else:
                # rtx-3's driver drifted from its class.
                driver = "570.124.06" if name == "rtx-3" else "580.65.06"
                hs.install(
                    i,
                    "nvidia-smi",
                    fake_smi(
                        RTX_QUERY.format(driver=driver),
                        "smi-rtx4090-x1-driver580.txt",
                        "topo-rtx4090-x8-sys-tabs.txt",
                    ),
                )
        yield hs


HOST_FILES = ("host_ed25519", "host_ed25519.pub", "bin/nvidia-smi")


@pytest.fixture
def breakable(hosts):
    """The shared hosts, for a test that breaks some (stops sshd, changes a host key, replaces
    nvidia-smi): afterwards, whatever happened, each host it touched gets its files back and a
    fresh sshd (which also ends what a hanging nvidia-smi left running), so no other test
    depends on running before or after it."""
    saved = [{f: (h.dir / f).read_bytes() for f in HOST_FILES} for h in hosts]
    yield hosts
    for i, h in enumerate(hosts):
        changed = [f for f, data in saved[i].items() if (h.dir / f).read_bytes() != data]
        if not changed and h.proc is not None and h.proc.poll() is None:
            continue
        hosts.stop(i)
        for f in changed:
            (h.dir / f).write_bytes(saved[i][f])
        hosts._write_config(h)  # host_key back to the one known_hosts holds
        hosts.start(i)


def inventory(
    tmp: Path, hosts: TestHosts, key: Path | None = None, only: int | None = None
) -> Path:
    lines = [
        f"ssh: {{user: root, identity_file: {key or hosts.client_key}, connect_timeout_s: 30}}",  # generous: CI shares 2 cores
        "nodes:",
    ]
    for h in hosts if only is None else [hosts[only]]:
        gpus = (
            "{type: A100-SXM4-80GB, count: 8}"
            if h.name.startswith("a100")
            else "{type: RTX-4090, count: 1}"
        )
        lines += [f"  - name: {h.name}", f"    host: {h.address}", f"    gpus: {gpus}"]
    path = tmp / "inventory.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_probe_reads_every_node_over_ssh(cli, hosts, tmp_path):
    inv = inventory(tmp_path, hosts)
    r = cli("probe", inv, "--known-hosts", hosts.known_hosts, "--json")
    assert r.code == 0, r.err
    facts = json.loads(r.out)
    assert json.loads((tmp_path / ".fleetctl" / "facts.json").read_text()) == facts
    nodes = facts["nodes"]
    assert set(nodes) == set(NAMES)
    a100 = nodes["a100-1"]
    assert a100["hostname"] == "a100-1"  # each test host has its own UTS namespace
    assert len(a100["gpus"]) == 8 and a100["gpus"][0]["name"] == "NVIDIA A100-SXM4-80GB"
    assert a100["driver_version"] == "535.104.05" and a100["interconnect"] == "nvlink"
    assert a100["gpus"][3]["ecc_uncorrected_volatile"] == 2
    rtx = nodes["rtx-1"]
    assert rtx["gpus"][0]["memory_total_mib"] == 24564 and rtx["cuda_version"] == "13.0"
    assert rtx["interconnect"] == "pcie"
    assert nodes["rtx-3"]["driver_version"] == "570.124.06"
    # The planner now uses the probed GPUs: an inventory that declares two A100s a node plans
    # on the eight probed, and says so.
    text = inv.read_text().replace(
        "{type: A100-SXM4-80GB, count: 8}", "{type: A100-SXM4-80GB, count: 2}"
    )
    text += (
        "models:\n  - name: llama-3-8b\n    profile: llama-3-8b\n"
        "    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}\n"
        "    max_context: 8192\n"
    )
    inv.write_text(text)
    r = cli("plan", inv, "--json")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    gpus = {}
    for d in plan["deployments"]:
        for g in d["gpu_indices"]:
            assert (d["node"], g) not in gpus
            gpus[(d["node"], g)] = d["gpu_type"]
    assert {g for (n, g) in gpus if n == "a100-1"} == set(range(8))
    assert {t for (n, _), t in gpus.items() if n.startswith("a100")} == {"A100-SXM4-80GB"}
    assert {g for (n, g) in gpus if n == "rtx-3"} == {0}
    assert len(gpus) == 4 * 8 + 8
    assert any(
        "a100-1: inventory declares 2x A100-SXM4-80GB, probed 8x A100-SXM4-80GB" in w
        for w in plan["warnings"]
    ), plan["warnings"]


def test_health_flags_the_skewed_node_and_ecc(cli, hosts, tmp_path):
    inv = inventory(tmp_path, hosts)
    r = cli("health", inv, "--known-hosts", hosts.known_hosts, "--json")
    assert r.code == 1  # unhealthy
    report = json.loads(r.out)
    bad = {(c["check"], c["node"]) for c in report["checks"] if c["status"] == "fail"}
    unreachable = [
        c for c in report["checks"] if c["check"] == "reachable" and c["status"] == "fail"
    ]
    assert not unreachable, unreachable
    assert ("skew:driver_version", "rtx-3") in bad
    assert ("ecc", "a100-1") in bad
    assert not any(n == "rtx-1" for _, n in bad)
    equivalent = json.loads((tmp_path / ".fleetctl" / "health.json").read_text())["equivalent"]
    assert equivalent["rtx-3"] is False and equivalent["rtx-1"] is True
    # The router gives the skewed node a class of its own.
    from fleetctl.daemon.backends import class_tags
    from fleetctl.fleet.statedir import StateDir

    assert class_tags(StateDir(tmp_path / ".fleetctl"), ["rtx-1", "rtx-3"]) == [
        "",
        "nonequivalent:rtx-3",
    ]


def test_faults_are_named_per_node_and_the_rest_go_on(cli, breakable, tmp_path):
    hosts = breakable  # what this test breaks is mended by the fixture, pass or fail
    inv = inventory(tmp_path, hosts)
    hosts.stop(NAMES.index("rtx-8"))
    hosts.rekey(NAMES.index("rtx-7"))
    hosts.install(NAMES.index("rtx-6"), "nvidia-smi", "#!/bin/sh\nsleep 60\n")
    hosts.install(NAMES.index("rtx-5"), "nvidia-smi", "#!/bin/sh\necho 'garbage ~~~ not a table'\n")
    r = cli("probe", inv, "--known-hosts", hosts.known_hosts, "--timeout", "8", "--json")
    assert r.code == 1
    nodes = json.loads(r.out)["nodes"]
    assert nodes["rtx-8"]["error"]["kind"] == "unreachable"
    assert nodes["rtx-7"]["error"]["kind"] == "host-key-changed"
    assert nodes["rtx-6"]["error"]["kind"] == "timeout"
    # Each is one line naming the node and its address, what happened and what to do.
    rtx8, rtx7 = hosts[NAMES.index("rtx-8")], hosts[NAMES.index("rtx-7")]
    assert nodes["rtx-8"]["error"]["line"] == (
        f"rtx-8 ({rtx8.address}:22): connection refused: is sshd running there, on port 22?"
    )
    changed = nodes["rtx-7"]["error"]["line"]
    assert changed.startswith(f"rtx-7 ({rtx7.address}:22): host key CHANGED")
    assert "man-in-the-middle" in changed and f"ssh-keygen -R {rtx7.address}" in changed
    assert nodes["rtx-5"].get("gpu_error") and not nodes["rtx-5"]["gpus"]
    # The rest go on: the healthy nodes carry no error and their GPUs.
    for n in NAMES[:8]:
        assert "error" not in nodes[n] and nodes[n]["gpus"], (n, nodes[n])
    # A host missing from known_hosts is refused, or recorded with --accept-new-host-keys.
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    one = inventory(tmp_path, hosts, only=0)
    r = cli("probe", one, "--known-hosts", empty, "--json")
    unknown = json.loads(r.out)["nodes"]["a100-1"]["error"]
    assert unknown["kind"] == "host-key-unknown"
    assert "--accept-new-host-keys" in unknown["line"] and str(empty) in unknown["line"]
    r = cli("probe", one, "--known-hosts", empty, "--accept-new-host-keys", "--json")
    assert "error" not in json.loads(r.out)["nodes"]["a100-1"]
    assert hosts[0].address in empty.read_text()
    # A wrong key fails authentication.
    other = tmp_path / "other_key"
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)]
    subprocess.run(keygen, check=True, capture_output=True)
    r = cli(
        "probe", inventory(tmp_path, hosts, other), "--known-hosts", hosts.known_hosts, "--json"
    )
    auth = json.loads(r.out)["nodes"]["a100-1"]["error"]
    assert auth["kind"] == "auth-failed"
    assert f"as root failed (tried key {other}" in auth["line"]
    assert "identity_file" in auth["line"]
    # The table says the same, one line per node, and no paramiko noise reaches it.
    r = cli("probe", inventory(tmp_path, hosts, other), "--known-hosts", hosts.known_hosts)
    assert r.code == 1
    lines = [ln for ln in r.out.splitlines() if ln.startswith("a100-1 (")]
    assert len(lines) == 1 and "authentication as root failed" in lines[0]
    assert "Traceback" not in r.out + r.err and "paramiko" not in r.out + r.err


def test_proxy_jump(cli, hosts, tmp_path):
    """A node reached through a jump host (the test hosts share a bridge)."""
    jump = hosts[NAMES.index("a100-1")].address
    inv = inventory(tmp_path, hosts, only=NAMES.index("rtx-1"))
    inv.write_text(
        inv.read_text().replace(
            "connect_timeout_s: 30}", f"connect_timeout_s: 30, proxy_jump: root@{jump}}}"
        )
    )
    r = cli("probe", inv, "--known-hosts", hosts.known_hosts, "--json")
    assert r.code == 0, r.out
    assert json.loads(r.out)["nodes"]["rtx-1"]["hostname"] == "rtx-1"
    # A jump host that refuses: the line names the hop, not only the node.
    inv.write_text(inv.read_text().replace(f"root@{jump}", f"root@{jump}:2222"))
    r = cli("probe", inv, "--known-hosts", hosts.known_hosts, "--json")
    assert r.code == 1
    line = json.loads(r.out)["nodes"]["rtx-1"]["error"]["line"]
    rtx1 = hosts[NAMES.index("rtx-1")].address
    assert line == (
        f"rtx-1 ({rtx1}:22): via jump host root@{jump}:2222: connection refused: "
        "is sshd running there, on port 2222?"
    )
