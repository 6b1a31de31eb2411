"""Progress for long work: a bar on a terminal's stderr, nothing at all anywhere else."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

# Work that ends sooner never shows a bar: a flash of one is noise, not information.
SHOW_AFTER_S = 0.5


class Tracker:
    """Where one piece of work stands: `update(done)` out of `total`, a bar once it runs long."""

    def __init__(self, description: str, total: float, stream: IO[str] | None) -> None:
        self.description = description
        self.total = total
        self._stream = stream  # None: report nothing
        self._started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def update(self, done: float, description: str | None = None) -> None:
        if description is not None:
            self.description = description
        if self._stream is None:
            return
        if self._bar is None:
            if time.monotonic() - self._started < SHOW_AFTER_S:
                return
            self._start()
        self._bar.update(self._task, completed=done, description=self.description)

    def _start(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=Console(file=self._stream),
            transient=True,
        )
        self._task = self._bar.add_task(self.description, total=self.total)
        self._bar.start()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def on_terminal(stream: IO[str] | None = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream is not a terminal
        return False


@contextmanager
def progress(
    description: str, total: float, *, enabled: bool = True, stream: IO[str] | None = None
) -> Iterator[Tracker]:
    """A `Tracker` that draws on `stream` (stderr) only if enabled and it is a terminal."""
    stream = stream if stream is not None else sys.stderr
    tracker = Tracker(description, total, stream if enabled and on_terminal(stream) else None)
    try:
        yield tracker
    finally:
        tracker.close()
