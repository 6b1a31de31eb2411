"""`.fleetctl/`, the one owner of what fleetctl keeps about a fleet: every path and format in it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from fleetctl.base import documents
from fleetctl.base.documents import DocumentError
from fleetctl.base.errors import Location, OperationError, UserError
from fleetctl.base.resources import bundled
from fleetctl.fleet.facts import Facts
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.state import State
from fleetctl.model.calibration import Calibration, CalibrationError

STATE_DIR_NAME = ".fleetctl"
HEALTH_FORMAT = 1
# How long a writer waits for another's read-modify-write of a file here: each holds the
# write lock for one read, merge and atomic write (milliseconds); longer is a stuck process.
WRITE_LOCK_WAIT_S = 60.0
T = TypeVar("T")


@dataclass(frozen=True)
class HealthRecord:
    """What the last `fleetctl health` concluded that others act on: the router treats a node
    whose driver, CUDA or vLLM differs from its class as a class of its own."""

    checked_at: str | None = None
    equivalent: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class StateDir:
    root: Path

    @classmethod
    def of(cls, inv: Inventory, override: Path | None = None) -> StateDir:
        """`override` (--state-dir), else `.fleetctl` beside the inventory; a bundled example's
        beside the user, in the current folder, never inside the installed package."""
        if override is not None:
            return cls(override)
        folder = inv.path.resolve().parent
        if folder == bundled("inventory").resolve():
            return cls(Path.cwd() / STATE_DIR_NAME)
        return cls(folder / STATE_DIR_NAME)

    # --- paths: nothing outside this class names a file in the folder -----------------------

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def facts_path(self) -> Path:
        return self.root / "facts.json"

    @property
    def health_path(self) -> Path:
        return self.root / "health.json"

    @property
    def calibration_path(self) -> Path:
        return self.root / "calibration.json"

    @property
    def lock_path(self) -> Path:
        """apply's and destroy's lock, held for the whole run (fleetctl/apply/lock.py)."""
        return self.root / "state.lock"

    @property
    def write_lock_path(self) -> Path:
        """The lock every writer of a file here holds around its read-modify-write."""
        return self.root / "write.lock"

    @property
    def requests_path(self) -> Path:
        """route-serve's request log: a folder (fleetctl/daemon/request_log.py)."""
        return self.root / "requests"

    @property
    def autopilot_log_path(self) -> Path:
        """The autopilot's audit log: one JSON line per decision (fleetctl/autopilot/live.py)."""
        return self.root / "autopilot.jsonl"

    # --- state: what apply recorded ---------------------------------------------------------

    def load_state(self) -> State:
        """The recorded state, or an empty one when nothing was applied yet."""
        return _load_document(
            self.state_path,
            "the state file",
            State,
            lambda text: State.from_json(documents.read(text)),
            "restore it, or move it aside: `fleetctl apply` then adopts the servers that run",
        )

    def save_state(self, state: State) -> None:
        with self.write_lock():
            write_atomic(self.state_path, json.dumps(state.to_json(), indent=2) + "\n")

    # --- facts: what probe found ------------------------------------------------------------

    def load_facts(self, path: Path | None = None) -> Facts | None:
        """Facts from `path` (--facts: must exist), else the saved ones, else None."""
        where = path or self.facts_path
        try:
            raw = documents.read(documents.read_file(where, named=path is not None))
        except FileNotFoundError:
            if path is None:
                return None
            raise UserError(
                "no such facts file", Location(str(where)), "run `fleetctl probe` first"
            ) from None
        except (OSError, DocumentError) as e:
            raise UserError(
                f"cannot read facts: {e}", Location(str(where)), "re-run `fleetctl probe`"
            ) from None
        try:
            return Facts.from_json(raw)
        except DocumentError as e:
            raise UserError(
                f"the facts file is not usable: {e}",
                Location(str(where)),
                "re-run `fleetctl probe` to write it again",
            ) from None

    def previous_facts(self) -> Facts | None:
        """The saved facts to compare a new probe with; a damaged file compares with nothing."""
        try:
            return self.load_facts()
        except UserError:
            return None

    def save_facts(self, facts: Facts) -> None:
        with self.write_lock():
            write_atomic(self.facts_path, json.dumps(facts.to_json(), indent=2) + "\n")

    # --- health: what the last check concluded ----------------------------------------------

    def load_health(self) -> HealthRecord:
        """The last health record; none yet means every node is equivalent. A damaged one, or
        one of a format this release does not read, is refused: read as "none", it would
        silently merge the nodes it found different back into their class."""
        return _load_document(
            self.health_path,
            "the health record",
            HealthRecord,
            lambda text: documents.load(text, HealthRecord, reads=(HEALTH_FORMAT,)),
            "run `fleetctl health` to write it again",
        )

    def save_health(self, record: HealthRecord) -> None:
        with self.write_lock():
            text = json.dumps(documents.dump(record, HEALTH_FORMAT), indent=2) + "\n"
            write_atomic(self.health_path, text)

    # --- calibration: what the live servers measured ----------------------------------------

    def load_calibration(self) -> Calibration:
        """The saved calibration, or an empty one when none was made yet."""
        where = self.calibration_path
        try:
            raw = documents.read(documents.read_file(where))
        except FileNotFoundError:
            return Calibration()
        except (OSError, DocumentError) as e:
            raise UserError(
                f"cannot read the calibration: {e}",
                Location(str(where)),
                "run `fleetctl calibrate` again, or pass --no-calibration",
            ) from None
        try:
            return Calibration.from_json(raw)
        except CalibrationError as e:
            raise UserError(
                f"the calibration file is not usable: {e}",
                Location(str(where)),
                "run `fleetctl calibrate` again to write it, or pass --no-calibration",
            ) from None

    def update_calibration(self, change: Callable[[Calibration], Calibration]) -> Calibration:
        """Read the calibration, apply `change` and save what it returns (when it changed
        anything), all under the write lock: two writers measuring at once (calibrate, apply,
        health) each add to the other's file instead of writing over it. Returns it."""
        with self.write_lock():
            before = self.load_calibration()
            after = change(before)
            if after != before:
                text = json.dumps(after.to_json(), indent=1) + "\n"
                write_atomic(self.calibration_path, text)
            return after

    def save_calibration(self, calibration: Calibration) -> None:
        """Write `calibration` over the file: for a writer that read nothing from it."""
        self.update_calibration(lambda _: calibration)

    # --- the write lock ---------------------------------------------------------------------

    @contextlib.contextmanager
    def write_lock(self) -> Iterator[None]:
        """Hold the folder's write lock (an flock on `write.lock`, dropped by the kernel when
        its process dies). Re-entrant within a process; threads of one process take turns."""
        path = self.write_lock_path
        with _WRITERS:
            if path in _HELD:
                yield
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                _flock(fd, path)
                _HELD.add(path)
                try:
                    yield
                finally:
                    _HELD.discard(path)
                    os.ftruncate(fd, 0)
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _load_document(
    where: Path, what: str, empty: Callable[[], T], parse: Callable[[bytes], T], fix: str
) -> T:
    """The document at `where` as `parse` reads it, `empty()` where there is none yet. One
    that cannot be read is the file system's failure (OperationError); one that cannot be
    used is refused with the field that is wrong and `fix`, how to mend it (UserError)."""
    try:
        text = documents.read_file(where)
    except FileNotFoundError:
        return empty()
    except OSError as e:
        raise OperationError(
            f"{where}: cannot read {what}: {e.strerror or e} (check that it is a file this "
            "user can read)"
        ) from None
    try:
        return parse(text)
    except DocumentError as e:
        raise UserError(f"{what} is not usable: {e}", Location(str(where)), fix) from None


# The write locks this process holds, and the guard that lets one thread of it at a time in.
_HELD: set[Path] = set()
_WRITERS = threading.RLock()


def _flock(fd: int, path: Path) -> None:
    """Take the flock on `fd`, saying once on stderr who is waited for; OperationError after
    WRITE_LOCK_WAIT_S."""
    end = time.monotonic() + WRITE_LOCK_WAIT_S
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(fd)
            if time.monotonic() > end:
                raise OperationError(
                    f"{path}: {holder} has held the state folder's write lock for over "
                    f"{WRITE_LOCK_WAIT_S:g} s; if it is stuck, stop it and run this again"
                ) from None
            if not said:
                sys.stderr.write(f"{path}: waiting for {holder} to finish writing\n")
                sys.stderr.flush()
                said = True
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    me = {"pid": os.getpid(), "command": " ".join(sys.argv[1:2])}
    os.pwrite(fd, json.dumps(me).encode(), 0)


def _holder(fd: int) -> str:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        doc = None
    if not isinstance(doc, dict):
        return "another process"
    return f"pid {doc.get('pid', '?')} (`fleetctl {str(doc.get('command', '?'))[:40]}`)"


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write via a temporary file, fsync and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
