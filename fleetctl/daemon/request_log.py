"""route-serve's request log: one JSON line per finished request, in `.fleetctl/requests/`.

Each line is a Mooncake trace row (`timestamp` ms since the Unix epoch, `input_length`,
`output_length`, `hash_ids`) with more fields, so the simulator reads the log as a trace
(fleetctl/sim/workload.py `load_trace`): `block_tokens` (the tokens each hash covers), `model`,
`adapter` (the inventory's LoRA adapter of `model` the request named, or null), `max_tokens`,
`session`, `priority`, `precision`, `backend` (host:port, without any
user:password), `class`, `ttft_s`, `e2e_s` (from arrival, queueing included), `status` (HTTP;
499: the client left; 502: the backend failed, mid-stream too; 503 with `outcome`
`cut_by_drain`: route-serve stopped before the answer ended, `output_length` then counting the
tokens its client got), `outcome` (null, or `cut_by_drain`) and `format`.

Privacy: no prompt or completion text is ever written. The session id and the prompt's block
hashes are keyed with a secret made on first use (`.key`, 0600, in the folder): the hashes
stay equal across replicas sharing the state folder, so prefix analysis works, but a reader of
the log without the key cannot test it against guessed prompts or sessions. Block hashes are
AES-128 of the router's chained block hashes (one call per request, ~0.07 us a block), cut to
53 bits so that every JSON reader holds them exactly; sessions are keyed BLAKE2b, 64 bits.
Every 4th chained hash is logged (LOG_BLOCK_STRIDE: 64-token blocks): a chain of coarser
blocks, `block_tokens` saying how many tokens each covers.
Files are 0600 in a 0700 folder; their names come from the date alone.

Files: `requests-YYYY-MM-DD.jsonl` per UTC day (of the write), then `requests-YYYY-MM-DD_0001.jsonl`
and on past `max_file_bytes` (names sort in time order); the oldest files go when the folder
would pass `max_total_bytes`. Lines are buffered and written `flush_lines` at a time, or each
`flush_s` by `run`, so the event loop never waits on the disk for more than one append.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from fleetctl.base import documents
from fleetctl.routing.blocks import BLOCK_TOKENS
from fleetctl.routing.types import Backend, Request

log = logging.getLogger("fleetctl.router")

LOG_FORMAT = 1
# A line's `outcome` when route-serve stopped before the answer ended (its drain timed out,
# or a second signal): `status` 503, `output_length` the tokens its client got.
CUT_BY_DRAIN = "cut_by_drain"
KEY_FILE = ".key"
KEY_BYTES = 32
HASH_BITS = 53  # exact in every JSON reader (IEEE doubles)
# Every 4th of the router's chained block hashes names the prompt up to a boundary 4 blocks
# on, so the log keeps a chain of 4-times coarser blocks: 64 tokens for 16-token blocks (or
# 64-character text chunks), a quarter of the bytes and of the CPU; a shared prefix is seen to
# within a block. Fixed, not derived from a token estimate, so that one prompt always gets
# the same hashes.
LOG_BLOCK_STRIDE = 4
MB = 2**20
FILE_RE = re.compile(r"^requests-(\d{4}-\d{2}-\d{2})(?:_(\d{4}))?\.jsonl$")
MASK64 = (1 << 64) - 1
# One encoder for every line: json.dumps with arguments builds a new one per call.
ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def file_name(day: str, n: int) -> str:
    """The n-th file of a UTC day (YYYY-MM-DD); names sort in the order they are written."""
    return f"requests-{day}.jsonl" if n == 0 else f"requests-{day}_{n:04d}.jsonl"


def load_key(folder: Path) -> bytes:
    """The deployment's secret, made on first use (0600): replicas that share the state
    folder share it, so their hashes agree."""
    path = folder / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, os.urandom(KEY_BYTES))
        finally:
            os.close(fd)
    for _ in range(50):  # another replica may be writing it this very moment
        key = documents.read_file(path, KEY_BYTES)  # a regular file, read no further
        if len(key) >= KEY_BYTES:
            break
        time.sleep(0.01)
    else:
        raise OSError(errno.EINVAL, f"{path}: the request log's key is too short")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        os.chmod(path, 0o600)
    return key[:KEY_BYTES]


class Keys:
    """Keyed hashes of sessions and of a prompt's chained block hashes."""

    def __init__(self, key: bytes):
        # cryptography comes with paramiko, a dependency; imported here, when a log is kept.
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        # ECB on one 16-byte block per hash: a keyed permutation, the same input giving the
        # same output (which prefix analysis needs). The encryptor keeps no state between
        # calls of whole blocks, so one serves every request.
        self._aes = Cipher(algorithms.AES(key[:16]), modes.ECB()).encryptor()
        self._session_key = key[16:32]
        self._shift = np.uint64(64 - HASH_BITS)

    def session(self, session: str) -> str:
        data = session.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(data, key=self._session_key, digest_size=8).hexdigest()

    def blocks(self, hashes: Sequence[int]) -> list[int]:
        if not hashes:
            return []
        n = len(hashes)
        try:
            ids = np.fromiter(hashes, np.int64, n)
        except OverflowError:  # hashes over 64 bits (vLLM's own names): their low 64
            ids = np.fromiter((h & MASK64 for h in hashes), np.uint64, n).view(np.int64)
        wide = np.zeros(2 * n, np.int64)
        wide[::2] = ids
        out = np.frombuffer(self._aes.update(wide.tobytes()), np.uint64)
        keyed: list[int] = (out[::2] >> self._shift).tolist()
        return keyed


@functools.lru_cache(maxsize=4096)
def where(url: str) -> str:
    """A backend's host:port: the URL's user:password part, if any, never reaches the log."""
    return urlsplit(url).netloc.rpartition("@")[2]


class RequestLog:
    """Buffered JSON lines in `folder`, rotated by UTC day and by size, bounded in total."""

    def __init__(
        self,
        folder: Path,
        max_file_bytes: int = 64 * MB,
        max_total_bytes: int = 1024 * MB,
        flush_lines: int = 256,
        flush_s: float = 1.0,
        clock: Any = time.time,
        stride: int = LOG_BLOCK_STRIDE,
    ):
        self.folder = folder
        self.max_file_bytes = max(1, max_file_bytes)
        self.max_total_bytes = max(self.max_file_bytes, max_total_bytes)
        self.flush_lines = flush_lines
        self.flush_s = flush_s
        self.clock = clock
        self.stride = max(1, stride)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        self.keys = Keys(load_key(folder))
        self._lines: list[str] = []
        self._fd = -1
        self._day = ""
        self._n = 0
        self._size = 0
        self.written = 0  # lines written
        self.dropped = 0  # lines lost to a failing disk
        self._warned = False

    # --- recording: on the event loop, no I/O ---------------------------------------------------

    def record(
        self,
        req: Request,
        arrival: float,
        backend: Backend | None,
        ttft_s: float | None,
        e2e_s: float,
        status: int,
        output_tokens: int | None,
        outcome: str | None = None,
    ) -> None:
        """One finished request; `arrival` in seconds since the Unix epoch; `outcome` None,
        or CUT_BY_DRAIN."""
        blocks = req.blocks
        session = req.session
        ids: list[int] = []
        span = BLOCK_TOKENS
        if blocks is not None:
            k = self.stride
            span = blocks.block_tokens * k
            ids = self.keys.blocks(blocks.hashes[k - 1 :: k] if k > 1 else blocks.hashes)
        row = {
            "timestamp": int(arrival * 1000),
            "input_length": req.prompt_tokens,
            "output_length": output_tokens or 0,
            "hash_ids": ids,
            "block_tokens": span,
            "model": req.model,
            "adapter": req.adapter or None,
            "max_tokens": req.max_tokens,
            "session": self.keys.session(session) if session else None,
            "priority": req.priority,
            "precision": req.precision,
            "backend": where(backend.name) if backend is not None else None,
            "class": backend.node_class if backend is not None else None,
            "ttft_s": round(ttft_s, 6) if ttft_s is not None else None,
            "e2e_s": round(e2e_s, 6),
            "status": status,
            "outcome": outcome,
            "format": LOG_FORMAT,
        }
        self._lines.append(ENCODE(row))
        if len(self._lines) >= self.flush_lines:
            self.flush()

    # --- writing ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Append the buffered lines (one write), rotating first when the file is full."""
        if not self._lines:
            return
        data = ("\n".join(self._lines) + "\n").encode()
        count = len(self._lines)
        self._lines = []
        try:
            self._target(len(data))
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self._size += len(data)
            self.written += count
        except OSError as e:
            self.dropped += count
            self._close_fd()  # opened again, and checked, on the next flush
            if not self._warned:
                log.error("request log: cannot write to %s: %s", self.folder, e.strerror or e)
                self._warned = True

    def _target(self, incoming: int) -> None:
        day = time.strftime("%Y-%m-%d", time.gmtime(self.clock()))
        if day != self._day or self._fd < 0:
            self._close_fd()
            self._day = day
            self._n = self._last(day)
            self._open()
        if self._size and self._size + incoming > self.max_file_bytes:
            self._close_fd()
            self._n += 1
            self._open()

    def _last(self, day: str) -> int:
        """The newest file of `day` already there (a restart goes on appending to it)."""
        last = 0
        for p in self.folder.iterdir():
            m = FILE_RE.match(p.name)
            if m and m.group(1) == day:
                last = max(last, int(m.group(2) or 0))
        return last

    def _open(self) -> None:
        path = self.folder / file_name(self._day, self._n)
        # Never through a link, and only into a regular file: a link planted in the folder
        # would otherwise be appended to and made 0600 wherever it points.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags | os.O_NONBLOCK, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{path.name} is not a regular file")
            os.fchmod(fd, 0o600)
            self._size = st.st_size
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._bound(path)

    def _bound(self, current: Path) -> None:
        """Delete the oldest files until the others and a full current file fit the bound."""
        files = []
        for p in self.folder.iterdir():
            if FILE_RE.match(p.name) and p != current:
                with contextlib.suppress(OSError):
                    files.append((p.name, p, p.stat().st_size))
        files.sort()
        total = sum(size for _, _, size in files) + max(self._size, self.max_file_bytes)
        for _, p, size in files:
            if total <= self.max_total_bytes:
                break
            with contextlib.suppress(FileNotFoundError):  # another replica removed it
                p.unlink()
            total -= size

    def _close_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    async def run(self) -> None:
        """Flush every `flush_s`, so that a quiet router's lines reach the disk too."""
        while True:
            await asyncio.sleep(self.flush_s)
            self.flush()

    def close(self) -> None:
        self.flush()
        self._close_fd()
