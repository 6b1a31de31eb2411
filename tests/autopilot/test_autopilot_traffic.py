"""The live autopilot's reading of route-serve's request log (fleetctl/autopilot/traffic.py):
each interval's new requests per model, their verdicts by the recorded SLO, the recent ones
for the gate, whole lines only, and files that rotate or are replaced."""

from __future__ import annotations

import json
from pathlib import Path

from fleetctl.autopilot.traffic import LogTail, verdict
from fleetctl.fleet.slo import Slo

SLO = {"m": Slo(ttft_s=1.0, tpot_s=0.05)}


def _row(
    at_s: float,
    model: str = "m",
    ttft: float = 0.2,
    e2e: float = 1.0,
    out: int = 21,
    status: int = 200,
) -> str:
    row = {
        "timestamp": int(at_s * 1000),
        "input_length": 100,
        "output_length": out,
        "hash_ids": [],
        "model": model,
        "max_tokens": 64,
        "ttft_s": ttft,
        "e2e_s": e2e,
        "status": status,
    }
    return json.dumps(row) + "\n"


def test_a_verdict_reads_ttft_and_tpot_from_the_row():
    slo = SLO["m"]
    assert verdict(json.loads(_row(0)), slo) is True  # TPOT (1.0 - 0.2) / 20 = 40 ms
    assert verdict(json.loads(_row(0, e2e=1.4)), slo) is False  # 60 ms a token
    assert verdict(json.loads(_row(0, ttft=1.5, e2e=2.0)), slo) is False
    assert verdict(json.loads(_row(0, status=502)), slo) is False
    assert verdict(json.loads(_row(0, status=499)), slo) is None  # the client left
    assert verdict(json.loads(_row(0)), None) is True


def test_each_interval_counts_the_new_whole_lines(tmp_path: Path):
    log = tmp_path / "requests-2026-12-07.jsonl"
    now = 1000.0
    # Before the first interval's window, in it, another model, and half a line.
    log.write_text(_row(now - 90) + _row(now - 30) + _row(now - 20, "n", e2e=5.0) + '{"times')
    tail = LogTail(tmp_path, keep_s=300)
    first = tail.interval(now, 60, SLO, first=True)
    assert first.counts == {"m": 1.0, "n": 1.0}
    assert first.met == {"m": (1, 1), "n": (1, 1)}  # no SLO for n: served is met
    assert sorted(len(v) for v in first.recent.values()) == [1, 2]  # the window keeps 5 min
    assert first.bad_lines == 0
    with log.open("a") as f:  # the half line ends, and one more comes
        f.write('tamp": 1}\n' + _row(now + 10, e2e=3.0))
    second = tail.interval(now + 60, 60, SLO, first=False)
    assert second.counts == {"m": 1.0} and second.met == {"m": (0, 1)}
    assert second.bad_lines == 1  # the finished half line is not a request row
    arrivals = [w.arrival for w in second.recent["m"]]
    assert arrivals == sorted(arrivals) and min(arrivals) >= 0


def test_a_replaced_file_is_read_again_and_a_rotated_one_forgotten(tmp_path: Path):
    one = tmp_path / "requests-2026-12-07.jsonl"
    one.write_text(_row(100) * 3)
    tail = LogTail(tmp_path, keep_s=600)
    assert tail.interval(200, 300, SLO, first=True).counts == {"m": 3.0}
    one.write_text(_row(250))  # shorter: replaced
    assert tail.interval(300, 60, SLO, first=False).counts == {"m": 1.0}
    one.unlink()
    two = tmp_path / "requests-2026-12-08.jsonl"
    two.write_text(_row(350) * 2)
    assert tail.interval(400, 60, SLO, first=False).counts == {"m": 2.0}
    assert list(tail.offsets) == [two]
