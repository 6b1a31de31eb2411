"""Calibration's I/O: scrape the live servers' /metrics over a window; merge and save."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fleetctl.base.text import plural
from fleetctl.fleet.http import Client, HttpError
from fleetctl.model.calibration import Key, ServerReading, entry_for, measure, windows
from fleetctl.model.calibration import window as window_of
from fleetctl.vllm.metrics import parse_metrics

if TYPE_CHECKING:
    from fleetctl.fleet.inventory import Inventory
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.model.calibration import Calibration, Entry
    from fleetctl.model.catalog import Catalog
    from fleetctl.routing.types import Backend
    from fleetctl.vllm.metrics import Scrape

SCRAPE_TIMEOUT_S = 5.0
# `apply` and `health` refresh the calibration on their way out: a short watch keeps them quick
# (4 samples); KV capacity needs one scrape, and the step's fit keeps the last 256 samples.
QUICK_WINDOW_S = 2.0
QUICK_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Refreshed:
    """One refresh: what each server gave, the entries it made, and the calibration saved."""

    readings: list[ServerReading]
    fresh: list[Entry]
    calibration: Calibration
    file: str

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.readings if r.error is not None]

    @property
    def measured(self) -> int:
        """Servers read: those that answered with vLLM's series."""
        return sum(1 for r in self.readings if r.key is not None)

    def lines(self) -> list[str]:
        """What `apply` and `health` say: how many servers, then a note per server not read."""
        name = self.file.rsplit("/", 1)[-1]
        head = f"calibration: refreshed {plural(self.measured, 'server')} ({name})"
        return [head, *(f"calibration: note: {e}" for e in self.errors)]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "refreshed": self.measured,
            "entries": len(self.fresh),
            "notes": self.errors,
        }


def refresh(
    sdir: StateDir,
    targets: list[Backend],
    window_s: float,
    interval_s: float,
    *,
    need_traffic: bool = False,
    on_progress: Callable[[float, int], None] | None = None,
) -> Refreshed:
    """Scrape `targets` every `interval_s` over `window_s`, merge what they measure into the
    state folder's calibration and save it; a server that cannot be read is an error line.
    With `need_traffic` (`fleetctl calibrate`), so is one that ran no request during the
    window: its KV capacity alone is no calibration of its speed, and its entry is kept as
    it was. `on_progress(seconds_left, samples)` hears how the window goes."""
    readings = asyncio.run(_read_all(targets, window_s, interval_s, on_progress))
    if need_traffic:
        readings = [_idle(r, window_s) for r in readings]
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    groups: dict[Key, list[tuple[Backend, ServerReading]]] = {}
    for b, r in zip(targets, readings, strict=True):
        if r.key is not None:
            groups.setdefault(r.key, []).append((b, r))
    fresh: list[Entry] = []

    def merge(before: Calibration) -> Calibration:
        # Under the state folder's write lock: the entries each extend the one saved now, not
        # one read before the window (another calibrate may have saved since).
        fresh[:] = [_entry(key, members, now, before) for key, members in groups.items()]
        return before.merged(fresh) if fresh else before

    after = sdir.update_calibration(merge) if groups else sdir.load_calibration()
    return Refreshed(readings, fresh, after, str(sdir.calibration_path))


def _entry(
    key: Key, members: list[tuple[Backend, ServerReading]], now: str, before: Calibration
) -> Entry:
    """The entry a group of servers of one key measured, over the one saved before."""
    perf = next((b.perf for b, _ in members if b.perf is not None), None)
    return entry_for(
        key,
        [r.url for _, r in members],
        [s for _, r in members for s in r.samples],
        [r.kv_tokens for _, r in members if r.kv_tokens is not None],
        now,
        before.get(key),
        perf,
        members[0][0].kv_tokens,
        members[0][1].gpu_memory_utilization,
    )


def refresh_running(inv: Inventory, catalog: Catalog, sdir: StateDir) -> Refreshed:
    """The quick refresh `apply` and `health` run: every server the state records."""
    from fleetctl.daemon.backends import load_backends

    if not sdir.load_state().deployments:
        return Refreshed([], [], sdir.load_calibration(), str(sdir.calibration_path))
    targets = load_backends(inv, catalog, None, sdir)
    return refresh(sdir, targets, QUICK_WINDOW_S, QUICK_INTERVAL_S)


def _idle(r: ServerReading, window_s: float) -> ServerReading:
    """`r`, or an error saying its server ran no request over the window."""
    if r.error is not None or r.key is None or r.samples:
        return r
    return replace(
        r,
        key=None,
        error=f"no request ran on {r.node} during the {window_s:g} s window: send traffic, "
        "or use a longer --window",
    )


async def _read_all(
    found: list[Backend],
    window: float,
    interval: float,
    on_progress: Callable[[float, int], None] | None = None,
) -> list[ServerReading]:
    client = Client(SCRAPE_TIMEOUT_S)
    counted = [0] * len(found)
    watch = asyncio.create_task(_watch(window, counted, on_progress)) if on_progress else None
    try:
        return list(
            await asyncio.gather(
                *(_read_one(client, b, window, interval, counted, i) for i, b in enumerate(found))
            )
        )
    finally:
        if watch is not None:
            watch.cancel()
        await client.close()


async def _watch(
    window: float, counted: list[int], on_progress: Callable[[float, int], None]
) -> None:
    """Tell `on_progress` the seconds left and the samples so far, twice a second."""
    loop = asyncio.get_running_loop()
    end = loop.time() + window
    while True:
        on_progress(max(0.0, end - loop.time()), sum(counted))
        await asyncio.sleep(0.5)


async def _read_one(
    client: Client,
    b: Backend,
    window: float,
    interval: float,
    counted: list[int] | None = None,
    slot: int = 0,
) -> ServerReading:
    """Scrape one server every `interval` over `window`; a fault ends this server alone.
    `counted[slot]` follows the windows that saw work so far."""
    where = f"{b.node} ({b.name})"
    scrapes: list[Scrape] = []
    # Every `interval` over `window`; an interval as long as the window or longer: two scrapes,
    # `window` apart.
    interval = min(interval, window)
    count = int(window / interval + 1e-9) + 1
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        version, max_len = await _version(client, b), await _max_model_len(client, b)
        for i in range(count):
            # On a fixed schedule, so a slow answer does not stretch the window.
            await asyncio.sleep(max(0.0, start + i * interval - loop.time()))
            asked = loop.time()
            reply = await client.get(f"{b.name}/metrics")
            if reply.status != 200:
                raise HttpError(f"/metrics answered HTTP {reply.status}")
            # The page was drawn somewhere between the question and the answer.
            scrape = replace(parse_metrics(reply.text), at=(asked + loop.time()) / 2)
            if not scrape.is_vllm:
                raise HttpError("its /metrics page has no vLLM series (is it a vLLM server?)")
            scrapes.append(scrape)
            if counted is not None and len(scrapes) > 1 and window_of(scrapes[-2], scrape):
                counted[slot] += 1
    except HttpError as e:
        return ServerReading(
            b.name, b.node, error=f"{where}: cannot read /metrics: {e}: check that it runs"
        )
    perf = b.perf
    key = Key(
        b.gpu_type,
        perf.model.name if perf is not None else b.model,
        b.variant,
        perf.tp if perf is not None else 1,
        version,
        max_len,
        b.node if b.class_tag else None,
    )
    samples = tuple(windows(scrapes))
    kv = scrapes[-1].kv_tokens
    figures = measure(samples, [kv] if kv is not None else [], perf, b.kv_tokens)
    util = scrapes[-1].gpu_memory_utilization
    return ServerReading(b.name, b.node, key, samples, kv, figures, gpu_memory_utilization=util)


async def _version(client: Client, b: Backend) -> str | None:
    """vLLM's release, from its /version; None when it does not say."""
    try:
        reply = await client.get(f"{b.name}/version")
        version = reply.json().get("version") if reply.status == 200 else None
    except (HttpError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) and version else None


async def _max_model_len(client: Client, b: Backend) -> int | None:
    """The served model's max_model_len, from /v1/models; None when it does not say."""
    from fleetctl.daemon.backends import served_name

    try:
        reply = await client.get(f"{b.name}/v1/models")
        cards = reply.json().get("data") if reply.status == 200 else None
    except (HttpError, ValueError, AttributeError):
        return None
    if not isinstance(cards, list):
        return None
    want = served_name(b)
    for card in cards:
        if isinstance(card, dict) and card.get("id") == want:
            length = card.get("max_model_len")
            return length if isinstance(length, int) and not isinstance(length, bool) else None
    return None
