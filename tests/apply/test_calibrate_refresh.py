"""`health` and `apply` refresh the calibration from the running servers on their way out."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fleetctl.apply.calibrate import QUICK_INTERVAL_S, QUICK_WINDOW_S, refresh, refresh_running
from fleetctl.daemon.backends import load_backends
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import Key
from fleetctl.planner import plan_fleet
from tests.apply.test_apply import fleet, hosts  # noqa: F401 (fixtures: SSH hosts running emulators)
from tests.model.test_calibration import Load
from tests.procs import Emulator, free_port

# Nodes at 127.0.0.x where nothing listens on SSH's port: health's probe fails fast and the
# servers' checks and the refresh still run. The step budget is the one the emulator runs
# (vLLM's default): it sizes the KV cache the model and the emulator must agree on.
INVENTORY = """\
planner: {max_num_batched_tokens: 2048}
nodes:
  - name: rtx-[1:2]
    host: 127.0.0.[1:2]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
"""
KEY = Key("RTX-4090", "llama-3-8b", "bf16", 1, "0.32.0", 8192)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    emu = Emulator(tmp_path_factory.mktemp("refresh"))
    try:
        emu.wait_healthy()
        yield emu
    finally:
        emu.stop()


def state_at(tmp_path, catalog, emulator):
    """An inventory and a state: one server on the emulator, one on a port nothing answers."""
    inv_path = tmp_path / "fleet.yaml"
    inv_path.write_text(INVENTORY)
    inv = load_inventory(inv_path, catalog)
    d = plan_fleet(inv).deployments[0]
    live = dataclasses.replace(d, node="rtx-1", host="127.0.0.1", port=emulator.port)
    dead = dataclasses.replace(d, node="rtx-2", host="127.0.0.1", port=free_port())
    sdir = StateDir(tmp_path / "state")
    sdir.root.mkdir()
    sdir.save_state(State(1, [live, dead]))
    return inv_path, inv, sdir


def test_health_refreshes_the_calibration_unless_told_not_to(emulator, tmp_path, catalog, cli):
    inv_path, _, sdir = state_at(tmp_path, catalog, emulator)
    args = ("health", inv_path, "--state-dir", sdir.root, "--timeout", "5")
    r = cli(*args, "--json", "--no-calibration")
    assert json.loads(r.out)["calibration"] is None
    assert not sdir.calibration_path.exists()
    r = cli(*args, "--json")
    # Unhealthy (no SSH, a dead server), yet the live server's figures are kept; the dead one
    # is a note.
    assert r.code == 1, r.err
    doc = json.loads(r.out)["calibration"]
    assert doc["file"] == str(sdir.calibration_path)
    assert doc["refreshed"] == 1 and doc["entries"] == 1
    (note,) = doc["notes"]
    assert note.startswith("rtx-2 (http://127.0.0.1:") and "connection refused" in note
    (entry,) = sdir.load_calibration().entries
    assert entry.key == KEY and entry.servers == (emulator.base,)
    assert entry.kv_tokens is not None and entry.kv_tokens.value == entry.kv_tokens.model
    r = cli(*args)
    assert "calibration: refreshed 1 server (calibration.json)" in r.out
    assert "calibration: note: rtx-2 (http://127.0.0.1:" in r.out


def test_apply_s_refresh_reads_the_states_servers(emulator, tmp_path, catalog):
    """What `apply` runs after a successful apply (its SSH part is tested in test_apply)."""
    _, inv, sdir = state_at(tmp_path, catalog, emulator)
    done = refresh_running(inv, catalog, sdir)
    assert done.measured == 1 and len(done.errors) == 1
    # Idle servers give no samples, but their KV capacity is read.
    (read,) = [r for r in done.readings if r.key is not None]
    assert read.kv_tokens is not None and done.fresh[0].kv_tokens is not None
    assert sdir.load_calibration() == done.calibration
    # A refresh under load adds its samples to the entry's.
    live = [b for b in load_backends(inv, catalog, None, sdir) if b.node == "rtx-1"]
    with Load(emulator.port, 4):
        again = refresh(sdir, live, QUICK_WINDOW_S, QUICK_INTERVAL_S)
    assert again.errors == []
    (entry,) = again.calibration.entries
    (read,) = again.readings
    assert 0 < len(read.samples) <= round(QUICK_WINDOW_S / QUICK_INTERVAL_S)
    assert entry.samples == done.fresh[0].samples + read.samples
    # No servers recorded: nothing read, nothing written.
    empty = StateDir(tmp_path / "empty")
    empty.root.mkdir()
    assert refresh_running(inv, catalog, empty).lines() == [
        "calibration: refreshed 0 servers (calibration.json)"
    ]
    assert not empty.calibration_path.exists()


def test_apply_refreshes_the_calibration_from_the_servers_it_started(cli, fleet):  # noqa: F811
    """Over real SSH to test hosts whose `vllm` runs the emulator (test_apply's fleet). The
    refresh is best-effort: a server it cannot read yet is a note, never apply's failure."""
    calibration = fleet.tmp / ".fleetctl" / "calibration.json"
    try:
        r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json"))
        assert r.code == 0, r.out + r.err
        doc = json.loads(r.out)["calibration"]
        assert doc["file"] == str(calibration) and doc["entries"] >= 1, doc
        # Every server is read. (Under the whole suite's load one or two came back "without
        # vLLM series" until fleetctl.fleet.http read pages to their end: tests/fleet/test_http.py.)
        assert (doc["refreshed"], doc["notes"]) == (4, []), doc
        gpus = {e.key.gpu for e in StateDir(calibration.parent).load_calibration().entries}
        assert gpus and gpus <= {"A100-SXM4-80GB", "RTX-4090"}, gpus
        # Nothing to change: the refreshed KV is the planned one, so every server is kept.
        r = cli("apply", *fleet.args(fleet.inv, "--yes"))
        assert r.code == 0, r.out + r.err
        assert "calibration: refreshed 4 servers (calibration.json)" in r.out, r.out
        before = calibration.stat().st_mtime_ns
        r = cli("apply", *fleet.args(fleet.inv, "--yes", "--json", "--no-calibration"))
        assert r.code == 0 and json.loads(r.out)["calibration"] is None
        assert calibration.stat().st_mtime_ns == before
    finally:
        assert cli("destroy", *fleet.args(fleet.inv, "--yes", "--json")).code == 0
