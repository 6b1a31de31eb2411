"""Bringing a public trace into the cache: downloaded or copied, checked, then renamed in."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from fleetctl.base.errors import Location, UserError
from fleetctl.base.progress import progress
from fleetctl.base.public_traces import (
    CACHE_ENV,
    PublicTrace,
    cache_writer,
    cached_path,
    is_cached,
    partial_prefix,
)

CHUNK = 1 << 20
TIMEOUT_S = 60  # per read: a stalled server fails rather than hangs


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_and_valid(trace: PublicTrace) -> bool:
    """Whether the cached copy is there and whole; `get` hashes it, where a use only stats it."""
    return is_cached(trace) and sha256_of(cached_path(trace)) == trace.sha256


def download(trace: PublicTrace, show_progress: bool = True) -> Path:
    """Fetch the trace's URL into the cache; a failure or a wrong checksum leaves no file."""
    import http.client
    import urllib.error
    import urllib.request

    fix = (
        "check the network, or download it yourself and run "
        f"`fleetctl traces get {trace.name} --from FILE`"
    )
    where = Location(trace.url)
    try:
        answer = urllib.request.urlopen(trace.url, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise UserError(f"download failed: HTTP {e.code} {e.reason}", where, fix) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise UserError(f"download failed: {reason}", where, fix) from None

    def chunks() -> Iterator[bytes]:
        try:
            yield from _chunks(answer)
        except (OSError, http.client.HTTPException) as e:  # broke or timed out mid-way
            raise UserError(f"download failed: {e or type(e).__name__}", where, fix) from None

    with answer:
        return _install(trace, chunks(), trace.url, show_progress)


def copy_from(trace: PublicTrace, source: Path, show_progress: bool = True) -> Path:
    """Take a copy already on disk into the cache, checked as a download is."""
    where = Location(str(source))
    try:
        f = source.open("rb")
    except OSError as e:
        raise UserError(
            f"cannot read the trace copy: {e.strerror}", where, "check the path"
        ) from None

    def chunks() -> Iterator[bytes]:
        try:
            yield from _chunks(f)
        except OSError as e:
            raise UserError(f"cannot read the trace copy: {e.strerror}", where) from None

    with f:
        return _install(trace, chunks(), str(source), show_progress)


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    return iter(lambda: stream.read(CHUNK), b"")


def _install(trace: PublicTrace, chunks: Iterator[bytes], origin: str, show: bool) -> Path:
    """Write `chunks` to a temporary file beside the cached path, hashing as they come; rename
    it into place only if size and sha256 match, so a half-written or wrong file never counts
    as cached. Read errors are the caller's (its `chunks` raise them as UserErrors)."""
    final = cached_path(trace)
    try:
        # The writer removes its partial file on the way out, a signal included (a killed
        # one's is removed by the next writer).
        with cache_writer() as folder, _signals_exit():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=partial_prefix(trace), suffix=".part")
            with os.fdopen(fd, "wb") as out:
                done, digest = _write(trace, chunks, out, show)
                out.flush()
                os.fsync(out.fileno())
            _check(trace, done, digest, origin)
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from its other users
            os.replace(tmp, final)
    except OSError as e:
        raise UserError(
            f"cannot write the trace cache: {e.strerror or e}",
            Location(str(final.parent)),
            f"free some space or fix its permissions, or set {CACHE_ENV} to another folder",
        ) from None
    return final


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP end the process by an exception (exit status 128 + the signal), so
    that cleanups on the way out run: their default action ends it with none run."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; a signal still ends the process
        return

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _write(
    trace: PublicTrace, chunks: Iterator[bytes], out: BinaryIO, show: bool
) -> tuple[int, str]:
    """Bytes written and their sha256; stops one chunk past the expected size."""
    h = hashlib.sha256()
    done = 0
    with progress(trace.name, trace.size, enabled=show) as bar:
        for chunk in chunks:
            done += len(chunk)
            if done > trace.size:
                break  # more than the registry says: the wrong file; stop before it fills a disk
            h.update(chunk)
            out.write(chunk)
            bar.update(done)
    return done, h.hexdigest()


def _check(trace: PublicTrace, done: int, digest: str, origin: str) -> None:
    if done > trace.size:
        what = f"{trace.name}: over {trace.size:,} bytes, the size expected"
    elif done != trace.size:
        what = f"{trace.name}: {done:,} bytes, expected {trace.size:,}"
    elif digest != trace.sha256:
        what = f"{trace.name}: sha256 {digest}, expected {trace.sha256}"
    else:
        return
    raise UserError(
        what,
        Location(origin),
        "not cached: the file is not the registry's; try again, or get it from the source "
        "`fleetctl traces list` names",
    )
