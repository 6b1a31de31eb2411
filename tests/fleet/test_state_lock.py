"""Writers of the state folder take turns: each reads, merges and writes a file under the
folder's write lock, so two `calibrate` runs at once keep both their entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.daemon.test_route_serve import INVENTORY, _wait_for
from tests.model.test_calibration import Load
from tests.procs import NAME, Emulator


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("state-lock")
    emus = [Emulator(tmp), Emulator(tmp, gpu="A100-SXM4-80GB")]
    try:
        for e in emus:
            e.wait_healthy()
        yield emus
    finally:
        for e in emus:
            e.stop()


def test_two_calibrate_runs_at_once_keep_both_entries(two_classes, tmp_path):
    from fleetctl.fleet.statedir import StateDir

    rtx, a100 = two_classes
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    sdir = StateDir(tmp_path / "state")
    runs = []
    with Load(rtx.port, 4), Load(a100.port, 4):
        # This test holds the write lock as a writer would: both runs measure, then wait for
        # it, and each must read the file only once it has the lock, or the second to write
        # would write over the first's entry.
        with sdir.write_lock():
            for emu, node, gpu in ((rtx, "rtx-1", "RTX-4090"), (a100, "a100-1", "A100-SXM4-80GB")):
                backends = tmp_path / f"{node}.yaml"
                entry = {"url": emu.base, "node": node, "gpu_type": gpu, "model": NAME}
                backends.write_text(json.dumps({"backends": [entry]}))
                err = tmp_path / f"{node}.err"
                cmd = [sys.executable, "-m", "fleetctl", "calibrate", str(inv), "--json"]
                cmd += ["--backends", str(backends), "--state-dir", str(sdir.root)]
                cmd += ["--window", "2", "--interval", "0.25"]
                with err.open("w") as e:
                    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=e, cwd=REPO)
                runs.append((proc, err))
            me = f"{sdir.write_lock_path}: waiting for pid {os.getpid()}"
            for proc, err in runs:
                _wait_for(
                    lambda p=proc, f=err: me in f.read_text() or p.poll() is not None,
                    "calibrate to wait for the write lock",
                )
            assert all(me in err.read_text() for _, err in runs), [
                err.read_text() for _, err in runs
            ]
        outs = [proc.communicate(timeout=60)[0] for proc, _ in runs]
    for (proc, err), out in zip(runs, outs, strict=True):
        assert proc.returncode == 0, err.read_text()
        assert len(json.loads(out)["entries"]) == 1
    saved = sdir.load_calibration()
    assert sorted(e.key.gpu for e in saved.entries) == ["A100-SXM4-80GB", "RTX-4090"]
