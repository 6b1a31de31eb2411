"""route-serve's reading of the autopilot's audit log (fleetctl/daemon/autopilot_log.py): whole
lines only, from where it stopped, afresh when the file was replaced."""

from __future__ import annotations

import json

from fleetctl.daemon.autopilot_log import AutopilotLog


def _line(outcome: str, kinds: tuple[str, ...] = (), at: float = 100.0) -> str:
    done = [{"kind": k, "result": "done"} for k in kinds]
    record = {
        "at_s": at,
        "outcome": outcome,
        "forecast": {"m": {"mean": 12.5, "high": 20.0, "method": "last interval"}},
        "carried_out": [*done, {"kind": "start", "result": "skipped"}],
    }
    return json.dumps(record) + "\n"


def _value(log: AutopilotLog, name: str, label: str = "") -> float:
    text = "\n".join(log.render())
    for line in text.splitlines():
        if line.startswith(f"{name}{label} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{label} in\n{text}")


def test_decisions_actions_forecast_and_time_from_whole_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AutopilotLog(path)
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="moved"}') == 0
    path.write_text(_line("moved", ("sleep", "wake")) + _line("idle", at=160.0) + '{"outc')
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="moved"}') == 1
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="idle"}') == 1
    assert _value(log, "fleetctl_autopilot_actions_total", '{kind="sleep"}') == 1
    assert _value(log, "fleetctl_autopilot_actions_total", '{kind="start"}') == 0  # skipped
    assert _value(log, "fleetctl_autopilot_forecast_requests", '{model="m"}') == 12.5
    assert _value(log, "fleetctl_autopilot_last_decision_timestamp_seconds") == 160.0
    # The half-written line counts once it is whole, and not before.
    with path.open("a") as f:
        f.write('ome": "gated"}\n')
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="gated"}') == 1
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="moved"}') == 1


def test_a_replaced_log_is_counted_afresh(tmp_path):
    path = tmp_path / "audit.jsonl"
    path.write_text(_line("moved", ("sleep",)) * 3)
    log = AutopilotLog(path)
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="moved"}') == 3
    path.write_text(_line("held"))
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="moved"}') == 0
    assert _value(log, "fleetctl_autopilot_decisions_total", '{outcome="held"}') == 1
