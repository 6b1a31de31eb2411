"""Progress: a bar on a terminal (a real pty here), not one byte when the stream is not one."""

from __future__ import annotations

import io
import os
import select

import pytest

import fleetctl.base.progress
from fleetctl.base.progress import progress


def test_quiet_when_not_a_terminal(monkeypatch):
    monkeypatch.setattr(fleetctl.base.progress, "SHOW_AFTER_S", 0.0)
    stream = io.StringIO()
    with progress("simulating", 5, stream=stream) as bar:
        for k in range(6):
            bar.update(k, f"simulating step {k}")
    assert stream.getvalue() == ""


def _read_all(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 5.0)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed: everything written has been read
            break
        if not chunk:
            break
        out += chunk
    return out


@pytest.mark.parametrize("enabled", [True, False])
def test_a_bar_on_a_terminal_unless_disabled(monkeypatch, enabled):
    monkeypatch.setattr(fleetctl.base.progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    master, slave = os.openpty()
    with os.fdopen(slave, "w", encoding="utf-8") as stream:
        with progress("reading trace.csv", 100, enabled=enabled, stream=stream) as bar:
            bar.update(40)
            bar.update(70, "reading trace.csv again")
        stream.flush()
    shown = _read_all(master).decode("utf-8", "replace")
    os.close(master)
    if enabled:
        assert "reading trace.csv" in shown
    else:
        assert shown == ""


def test_short_work_shows_nothing(monkeypatch):
    """Under SHOW_AFTER_S no bar starts, even on a terminal: a flash of one is noise."""
    monkeypatch.setattr(fleetctl.base.progress, "SHOW_AFTER_S", 3600.0)
    master, slave = os.openpty()
    with (
        os.fdopen(slave, "w", encoding="utf-8") as stream,
        progress("quick", 10, stream=stream) as bar,
    ):
        bar.update(10)
    shown = _read_all(master)
    os.close(master)
    assert shown == b""


def test_the_bar_goes_to_stderr_by_default_never_stdout(monkeypatch):
    """Without a `stream`, the bar draws on sys.stderr: stdout stays for the command's output."""
    monkeypatch.setattr(fleetctl.base.progress, "SHOW_AFTER_S", 0.0)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    err_master, err_slave = os.openpty()
    out_master, out_slave = os.openpty()
    with (
        os.fdopen(err_slave, "w", encoding="utf-8") as err,
        os.fdopen(out_slave, "w", encoding="utf-8") as out,
    ):
        monkeypatch.setattr("sys.stderr", err)
        monkeypatch.setattr("sys.stdout", out)
        with progress("reading trace.csv", 100) as bar:
            bar.update(40)
        err.flush()
        out.flush()
        monkeypatch.undo()
    on_err = _read_all(err_master).decode("utf-8", "replace")
    on_out = _read_all(out_master)
    os.close(err_master)
    os.close(out_master)
    assert "reading trace.csv" in on_err
    assert on_out == b""
