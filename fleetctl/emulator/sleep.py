"""vLLM's sleep mode, emulated: the dev endpoints, a paused engine, wakes that take the class's
modelled seconds, and one GPU's memory shared by the servers on it.

What vLLM 0.32 does, read from its source (vllm/entrypoints/serve/dev/sleep/api_router.py,
vllm/v1/engine/core.py, vllm/v1/metrics/loggers.py):
- The endpoints exist only with VLLM_SERVER_DEV_MODE=1: `POST /sleep?level=0|1|2&mode=abort`
  answers `{"status": "sleeping", "level": L}`; `POST /wake_up[?tags=...]` answers
  `{"status": "awake" | "sleeping", "tags": ...}` once the weights are back; `GET
  /is_sleeping` answers `{"is_sleeping": bool}`. Level 0 only pauses the scheduler.
- A sleep pauses the scheduler in mode "abort" (the default): requests in flight end with
  finish_reason "abort", new ones are queued, not refused, and run after the wake. Level 1
  and 2 also drop the prefix cache. Without --enable-sleep-mode a level 1 or 2 sleep fails.
- `vllm:engine_sleep_state{sleep_state}` says awake, weights_offloaded (level 1) or
  discard_all (level 2); `vllm:sleep_mode_operation_duration_seconds{operation}` times each
  operation once the first one ran.

A wake lasts `model/startup.wake_seconds` for the GPU class, level and weights (emulated
seconds). With `--gpu-ledger DIR`, the emulators given one folder share one emulated GPU's
memory: each writes the bytes it holds there, and a wake that would not fit beside the
others fails out of memory and leaves the server asleep, as a real wake does when another
process holds the memory (vllm#47654).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from fleetctl.base.errors import UserError
from fleetctl.emulator import protocol as proto
from fleetctl.emulator.driver import Driver
from fleetctl.emulator.metrics import Histogram, prom_number
from fleetctl.model.startup import SLEEP_LEVELS

# vLLM's buckets for vllm:sleep_mode_operation_duration_seconds.
OPERATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)
OPERATIONS = ("sleep", "wake")


@dataclass
class GpuLedger:
    """The bytes each emulated server on one GPU holds, one small JSON file per server."""

    folder: Path
    me: str
    total: int  # the GPU's memory, as CUDA reports it

    def hold(self, nbytes: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{self.me}.tmp"
        tmp.write_text(json.dumps({"bytes": nbytes, "pid": os.getpid()}))
        tmp.replace(self.folder / f"{self.me}.json")

    def claim(self, nbytes: int) -> int | None:
        """Hold `nbytes` if they fit beside the others (None), else the bytes free. The check
        and the hold are one step under the folder's lock: two servers waking or starting at
        once cannot both take the last room."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = self.total - self.others()
            if nbytes > free:
                return max(0, free)
            self.hold(nbytes)
            return None

    def others(self) -> int:
        """Bytes the other live servers on this GPU hold."""
        total = 0
        for path in self.folder.glob("*.json"):
            if path.stem == self.me:
                continue
            try:
                entry = json.loads(path.read_text())
                os.kill(int(entry["pid"]), 0)  # a server that died holds nothing
            except (OSError, ValueError, KeyError, TypeError):
                continue
            total += int(entry["bytes"])
        return total

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"{self.me}.json").unlink()


@dataclass
class Sleeper:
    """One server's sleep state and what its wakes cost."""

    enabled: bool  # --enable-sleep-mode
    wake_s: Callable[[int], float]  # emulated seconds a wake from this level takes
    awake_bytes: int  # what the server holds on its GPU awake
    asleep_bytes: int  # what stays when it sleeps (the CUDA context)
    time_scale: float = 1.0
    ledger: GpuLedger | None = None
    level: int | None = None  # None: awake; else the level it sleeps at
    waking: bool = False
    durations: dict[str, Histogram] = field(default_factory=dict)

    @property
    def asleep(self) -> bool:
        return self.level is not None

    def start(self) -> None:
        """Take the server's memory on its GPU, or fail as vLLM's start-up does when other
        processes hold too much of it."""
        if self.ledger is None:
            return
        free = self.ledger.claim(self.awake_bytes)
        if free is not None:
            raise UserError(
                f"Free memory on device ({free / 2**30:.2f}/{self.ledger.total / 2**30:.2f} GiB) "
                f"on startup is less than desired GPU memory utilization "
                f"({self.awake_bytes / 2**30:.2f} GiB)",
                None,
                "decrease GPU memory utilization or reduce GPU memory used by other processes",
            )

    def stop(self) -> None:
        if self.ledger is not None:
            self.ledger.release()

    def sleep(self, driver: Driver, level: int) -> None:
        started = time.monotonic()
        if level in SLEEP_LEVELS and not self.enabled:
            raise proto.ApiError(
                500,
                "Sleep mode is not enabled. Enable it with --enable-sleep-mode.",
                "InternalServerError",
            )
        if not driver.paused:
            driver.pause(clear_cache=level >= 1)
        if self.level is None or level > self.level:
            self.level = level
        if level >= 1 and self.ledger is not None:
            self.ledger.hold(self.asleep_bytes)
        self._observe("sleep", time.monotonic() - started)

    async def wake(self, driver: Driver) -> bool:
        """Wake, taking the level's seconds; False while another wake is under way."""
        if self.level is None:
            return True
        started = time.monotonic()
        level = self.level
        if level >= 1 and self.ledger is not None:
            free = self.ledger.claim(self.awake_bytes)
            if free is not None:
                raise proto.ApiError(
                    500,
                    f"CUDA out of memory. Tried to allocate {self.awake_bytes / 2**30:.2f} GiB"
                    f" to wake up; {free / 2**30:.2f} GiB of this GPU are free",
                    "InternalServerError",
                )
        self.waking = True
        try:
            if level >= 1:
                await asyncio.sleep(self.wake_s(level) / self.time_scale)
        finally:
            self.waking = False
        self.level = None
        driver.resume()
        self._observe("wake", time.monotonic() - started)
        return True

    def _observe(self, operation: str, wall_s: float) -> None:
        h = self.durations.setdefault(operation, Histogram(OPERATION_BUCKETS))
        h.observe(wall_s * self.time_scale)  # emulated seconds, as every latency here

    def state_gauge(self) -> dict[str, float]:
        """vllm:engine_sleep_state's three samples."""
        return {
            "awake": 0.0 if self.asleep else 1.0,
            "weights_offloaded": 1.0 if self.level == 1 else 0.0,
            "discard_all": 1.0 if self.level == 2 else 0.0,
        }

    def metrics(self) -> str:
        """vllm:sleep_mode_operation_* once an operation ran (vLLM creates them then)."""
        if not self.durations:
            return ""
        name = "vllm:sleep_mode_operation_duration_seconds"
        lines = [
            f"# HELP {name} Duration of one sleep-mode operation.",
            f"# TYPE {name} histogram",
        ]
        for op, h in self.durations.items():
            for le, n in h.cumulative():
                lines.append(f'{name}_bucket{{le="{le}",operation="{op}"}} {prom_number(n)}')
            lines.append(f'{name}_count{{operation="{op}"}} {prom_number(h.count)}')
            lines.append(f'{name}_sum{{operation="{op}"}} {prom_number(h.sum)}')
        flight = "vllm:sleep_mode_operations_in_flight"
        lines += [
            f"# HELP {flight} Sleep-mode operations currently awaited.",
            f"# TYPE {flight} gauge",
            f'{flight}{{operation="wake"}} {prom_number(1.0 if self.waking else 0.0)}',
        ]
        return "\n".join(lines) + "\n"


SLEEPER = web.AppKey("sleeper", Sleeper)
DRIVER: web.AppKey[Callable[[], Driver]] = web.AppKey("driver_of")


def attach(app: web.Application, sleeper: Sleeper, driver: Callable[[], Driver]) -> None:
    """vLLM's dev routes for sleep mode (only with VLLM_SERVER_DEV_MODE=1, as vLLM)."""
    app[SLEEPER] = sleeper
    app[DRIVER] = driver
    app.router.add_post("/sleep", _sleep)
    app.router.add_post("/wake_up", _wake_up)
    app.router.add_get("/is_sleeping", _is_sleeping)


def _level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        level = -1
    if not 0 <= level <= 2:
        # FastAPI's validation answer for Query(ge=0, le=2)
        raise proto.ApiError(422, f"level must be 0, 1 or 2, got {raw!r}", "BadRequestError")
    mode = request.query.get("mode", "abort")
    if mode != "abort":
        raise proto.ApiError(
            400, f"the emulator pauses in mode 'abort' only, got {mode!r}", "BadRequestError"
        )
    return level


async def _sleep(request: web.Request) -> web.StreamResponse:
    level = _level(request)
    request.app[SLEEPER].sleep(request.app[DRIVER](), level)
    return web.json_response({"status": "sleeping", "level": level}, dumps=proto.dumps)


async def _wake_up(request: web.Request) -> web.StreamResponse:
    tags = request.query.getall("tags", []) or None
    awake = await request.app[SLEEPER].wake(request.app[DRIVER]())
    body = {"status": "awake" if awake else "sleeping", "tags": tags}
    return web.json_response(body, dumps=proto.dumps)


async def _is_sleeping(request: web.Request) -> web.StreamResponse:
    body = {"is_sleeping": request.app[SLEEPER].asleep}
    return web.json_response(body, dumps=proto.dumps)
