"""The state lock: one apply or destroy at a time per state folder, naming the holder.

An flock on `.fleetctl/state.lock` does the excluding (the kernel drops it when its process
dies, however it dies); the file's text says who holds it. Finding the text of a holder that
no longer holds the flock means that holder died: the lock was stale, and is taken over.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import getpass
import json
import os
import socket
import sys
from types import TracebackType

from fleetctl.base.errors import OperationError
from fleetctl.fleet.statedir import StateDir


class StateLock:
    def __init__(self, state_dir: StateDir, purpose: str):
        self.path = state_dir.lock_path
        self.purpose = purpose
        self.stale: dict[str, object] | None = None  # the dead holder this lock replaced
        self._fd: int | None = None

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            who = _describe(holder) if holder else "another process"
            raise OperationError(
                f"{self.path}: {who} holds the state lock; wait for it to finish "
                "(fleetctl never runs two applies on one state at once)"
            ) from None
        previous = _read(fd)
        if previous:
            self.stale = previous
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me(self.purpose)).encode(), 0)
        self._fd = fd
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # an empty file means: released cleanly
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def stale_note(self) -> str | None:
        if not self.stale:
            return None
        return f"took over a stale state lock: {_describe(self.stale)} died without releasing it"


def _me(purpose: str) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "user": getpass.getuser(),
        "command": purpose,
        "argv": " ".join(sys.argv[:3]),
        "since": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def _read(fd: int) -> dict[str, object] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        doc = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _describe(h: dict[str, object]) -> str:
    return (
        f"`fleetctl {h.get('command', '?')}` (pid {h.get('pid', '?')} on {h.get('host', '?')}, "
        f"user {h.get('user', '?')}, since {h.get('since', '?')})"
    )
