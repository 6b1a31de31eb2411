"""How `fleetctl probe` time grows with the number of nodes (real SSH to netns test hosts).

Run (as root, with openssh-server installed): python benchmarks/probe_scale.py
Each host replays a recorded RTX 4090 `nvidia-smi`; the probe runs its real commands.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.probe import probe_fleet
from fleetctl.fleet.ssh import SshOptions
from fleetctl.model.catalog import load_catalog
from harness.fake_smi import RTX_QUERY, fake_smi
from harness.sshhosts import TestHosts


def run(n: int, parallel: int, repeat: int = 2) -> tuple[float, float, float]:
    with (
        TestHosts(n, names=[f"rtx-{i + 1}" for i in range(n)]) as hosts,
        tempfile.TemporaryDirectory() as tmp,
    ):
        script = fake_smi(
            RTX_QUERY.format(driver="580.65.06"),
            "smi-rtx4090-x1-driver580.txt",
            "topo-rtx4090-x8-sys-tabs.txt",
        )
        for i in range(n):
            hosts.install(i, "nvidia-smi", script)
        lines = [f"ssh: {{user: root, identity_file: {hosts.client_key}}}", "nodes:"]
        for h in hosts:
            lines += [
                f"  - name: {h.name}",
                f"    host: {h.address}",
                "    gpus: {type: RTX-4090, count: 1}",
            ]
        inv_path = Path(tmp) / "inv.yaml"
        inv_path.write_text("\n".join(lines) + "\n")
        inv = load_inventory(inv_path, load_catalog())
        options = SshOptions(known_hosts=hosts.known_hosts)
        best = cpu = float("inf")
        for _ in range(repeat):
            t, c = time.perf_counter(), time.process_time()
            facts = probe_fleet(inv, options, parallel)
            best = min(best, time.perf_counter() - t)
            cpu = min(cpu, time.process_time() - c)  # the prober's own CPU (all its threads)
            failed = {n: f["error"]["kind"] for n, f in facts["nodes"].items() if "error" in f}
            assert not failed, failed
        return best, best / n, cpu


def main() -> None:
    print("| hosts | parallel | seconds | seconds per host | x one host | prober CPU s |")
    print("|---|---|---|---|---|---|")
    one, _, cpu1 = run(1, 1)
    print(f"| 1 | 1 | {one:.2f} | {one:.2f} | 1.0 | {cpu1:.2f} |")
    for n, parallel in ((8, 32), (16, 32), (64, 16), (64, 32)):
        total, per, cpu = run(n, parallel)
        print(f"| {n} | {parallel} | {total:.2f} | {per:.3f} | {total / one:.1f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
