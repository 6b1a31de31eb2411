"""`calibrate`: read the live servers' /metrics and keep what they measure in the state folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fleetctl.cli import common
from fleetctl.cli.app import app
from fleetctl.cli.options import InventoryArg, JsonOpt, ProfilesOpt, StateDirOpt
from fleetctl.jsonout import print_json

if TYPE_CHECKING:
    from fleetctl.calibration import Key, Scrape, ServerReading
    from fleetctl.http import Client
    from fleetctl.routing.types import Backend

SCRAPE_TIMEOUT_S = 5.0


@app.command()
def calibrate(
    inventory: str = InventoryArg,
    backends: Path | None = typer.Option(
        None,
        "--backends",
        metavar="FILE",
        help="YAML list of servers fleetctl did not launch (default: the state).",
    ),
    window: float = typer.Option(
        10.0,
        "--window",
        min=0.1,
        max=3600,
        metavar="SECONDS",
        help="How long to watch each server; its counters' changes over it are the samples.",
    ),
    interval: float = typer.Option(
        1.0,
        "--interval",
        min=0.05,
        metavar="SECONDS",
        help="Time between scrapes: each pair is one sample, at the batch size of its moment.",
    ),
    state_dir: Path | None = StateDirOpt,
    profiles: list[Path] = ProfilesOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure KV capacity, decode step and prefill speed on the running servers."""
    import asyncio
    import datetime as dt

    from fleetctl.calibration import entry_for
    from fleetctl.router.backends import load_backends

    inv, catalog = common.load(inventory, profiles)
    sdir = common.state_dir(inv, state_dir)
    found = load_backends(inv, catalog, backends, sdir)
    readings = asyncio.run(_read_all(found, window, interval))
    before = sdir.load_calibration()
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    groups: dict[Key, list[tuple[Backend, ServerReading]]] = {}
    for b, r in zip(found, readings, strict=True):
        if r.key is not None:
            groups.setdefault(r.key, []).append((b, r))
    fresh = []
    for key, members in groups.items():
        perf = next((b.perf for b, _ in members if b.perf is not None), None)
        fresh.append(
            entry_for(
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
        )
    if fresh:
        sdir.save_calibration(before.merged(fresh))
    failed = [r for r in readings if r.error is not None]
    if as_json:
        entries = []
        for e in fresh:
            j = e.to_json()
            j.pop("samples")
            entries.append(j)
        print_json(
            {
                "calibration": str(sdir.calibration_path),
                "servers": [r.to_json() for r in readings],
                "entries": entries,
            }
        )
    else:
        from fleetctl.render import calibration_table
        from fleetctl.text import plural

        console = common.console()
        console.print(calibration_table(readings))
        for r in failed:
            console.print(r.error, markup=False, highlight=False, soft_wrap=True)
        if fresh:
            console.print(
                f"Saved {plural(len(fresh), 'entry', 'entries')} to {sdir.calibration_path}."
            )
    if failed:
        raise typer.Exit(1)


async def _read_all(found: list[Backend], window: float, interval: float) -> list[ServerReading]:
    from fleetctl.http import Client

    client = Client(SCRAPE_TIMEOUT_S)
    try:
        import asyncio

        return list(await asyncio.gather(*(_read_one(client, b, window, interval) for b in found)))
    finally:
        await client.close()


async def _read_one(client: Client, b: Backend, window: float, interval: float) -> ServerReading:
    """Scrape one server every `interval` over `window`; a fault ends this server alone."""
    import asyncio

    from fleetctl.calibration import Key, ServerReading, measure, parse_metrics, windows
    from fleetctl.http import HttpError

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
            reply = await client.get(f"{b.name}/metrics")
            if reply.status != 200:
                raise HttpError(f"/metrics answered HTTP {reply.status}")
            scrape = parse_metrics(reply.text)
            if not scrape.is_vllm:
                raise HttpError("its /metrics page has no vLLM series (is it a vLLM server?)")
            scrapes.append(scrape)
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
    from fleetctl.http import HttpError

    try:
        reply = await client.get(f"{b.name}/version")
        version = reply.json().get("version") if reply.status == 200 else None
    except (HttpError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) and version else None


async def _max_model_len(client: Client, b: Backend) -> int | None:
    """The served model's max_model_len, from /v1/models; None when it does not say."""
    from fleetctl.http import HttpError
    from fleetctl.router.backends import served_name

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
