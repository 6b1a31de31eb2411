"""The tutorial (docs/tutorial.md) run as written: every shell block in order, in an empty
folder, and each output block checked against what its commands printed (harness/tutorial.py
says how the page is read). So a flag renamed, a message reworded or a step that stopped
working fails here.

`fleetctl traces get` downloads from a server on 127.0.0.1 (the Azure slice in tests/data,
harness/tutorial.py's `trace_mirror`), never the network. The seconds to the first routed request are printed, not asserted: timing
is measured (benchmarks/first_hour.py), not tested.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import tutorial
from harness.tutorial import holds


def test_expected_lines_match_numbers_and_ellipses_only() -> None:
    saved = "Saved 2 entries to .../calibration.json."
    assert holds("Saved 12 entries to /tmp/x/.fleetctl/calibration.json.", saved)
    assert not holds("Saved 2 entries in /tmp/calibration.json.", saved)
    assert holds("- KV budget 6.3  GB =\n", "KV budget 61.2 GB")
    assert not holds("KV budget 61.2 GiB", "KV budget 61.2 GB")


def test_the_page_has_its_steps() -> None:
    found = tutorial.steps(tutorial.PAGE.read_text())
    assert len(found) >= 8, "the tutorial lost its steps"
    assert any(s.expect for s in found)


def test_the_page_names_its_one_network_step() -> None:
    """The page promised "no network" while step 8 downloaded a trace: the introduction names
    each step that downloads, and that step says how to do without (`--from FILE`)."""
    page = tutorial.PAGE.read_text()
    intro = page.split("\n## 1.")[0]
    sections = re.split(r"^## (?=\d+\. )", page, flags=re.M)[1:]
    downloading = [
        sec
        for sec in sections
        if re.search(r"traces get \S+$", sec, re.M)  # not --from
    ]
    assert downloading, "the page no longer downloads: drop this test's premise"
    for sec in downloading:
        number = sec.split(".")[0]
        assert f"step {number}" in intro and "network" in intro, intro
        prose = re.sub(r"^```.*?^```", "", sec, flags=re.S | re.M)
        assert "--from FILE" in prose, sec


def test_every_server_the_page_starts_logs_to_a_file() -> None:
    """The emulators' and the router's access logs (several lines a second each) would bury
    the page's own output in the reader's terminal: each goes to a file."""
    started = [
        cmd
        for step in tutorial.steps(tutorial.PAGE.read_text())
        for cmd in tutorial.commands(step.script)
        if cmd.rstrip().endswith("&") and re.search(r"fleetctl (emulate|route-serve)", cmd)
    ]
    assert len(started) == 3, started
    for cmd in started:
        assert re.search(r"> ?\S+\.log 2>&1 &$", cmd.rstrip()), cmd


@pytest.fixture
def trace_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    with tutorial.trace_mirror(tmp_path / "mirror") as env:
        yield env


def test_the_tutorial_runs_as_written(tmp_path: Path, trace_server: dict[str, str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = str(Path(sys.executable).parent)  # this environment's fleetctl first
    env = {**trace_server, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    took = tutorial.run(work, tmp_path, env)
    print(
        f"tutorial: first routed request after {took['first_routed_s']:.1f} s, "
        f"all of it {took['total_s']:.1f} s (the install excluded)"
    )
