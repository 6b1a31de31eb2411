"""Starting the routing daemon: backends, policy and scheduler from the inventory; reloads."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import functools
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from fleetctl.base import names
from fleetctl.base.errors import FleetError, Location, UserError
from fleetctl.daemon.adapters import Loader, adapter_bases, loadable
from fleetctl.daemon.autopilot_log import AutopilotLog
from fleetctl.daemon.backends import KvEndpoint, kv_events_from_state, load_backends
from fleetctl.daemon.intake import JsonErrorRunner
from fleetctl.daemon.listen import bind, busy, start, stop, stop_signals
from fleetctl.daemon.live import LiveState
from fleetctl.daemon.proxy import SERVED_BY
from fleetctl.daemon.relay import CUT, header_value
from fleetctl.daemon.request_log import MB, RequestLog
from fleetctl.daemon.router import PREFIX_CAPACITY, DaemonConfig, Router, routing_core
from fleetctl.daemon.tokens import TokenCounter
from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.slo import Slo, planned_unless_stated
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.catalog import Catalog
from fleetctl.routing.policy import RoutingConfig
from fleetctl.routing.registry import policy_names
from fleetctl.routing.scheduler import Aging
from fleetctl.routing.sessions import SESSIONS_MAX
from fleetctl.routing.types import Backend, OutputEstimator

log = logging.getLogger("fleetctl.router")
Reload = Callable[[], "list[Backend]"]
# One line per request; never headers, so never an Authorization header or API key. AccessLog
# adds the backend and class that served it.
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tfs'
# Request heads, as aiohttp parses them (its defaults, stated): longer lines or fields are a
# 400 "Line is too long" / "Got more than 8190 bytes", more header lines a 400 too.
MAX_LINE_BYTES = 8190  # the request target (aiohttp counts it without method and version)
MAX_FIELD_BYTES = 8190  # one header's value (without its name)
MAX_HEADERS = 128  # header lines per request
LISTEN_FIX = "pick another with --listen, or stop the process that holds it"


def served_by(b: Backend | None) -> tuple[str, str]:
    """(host:port, class) of the backend that served a request, for the access log: the URL's
    user:password part, if any, never reaches a log."""
    return ("-", "-") if b is None else _where(b.name, b.node_class)


@functools.lru_cache(maxsize=4096)  # once per backend, not once per request
def _where(url: str, node_class: str) -> tuple[str, str]:
    return header_value(urlsplit(url).netloc.rpartition("@")[2]), header_value(node_class)


class AccessLog(AbstractAccessLogger):
    """The line aiohttp's AccessLogger writes for ACCESS_LOG_FORMAT, and where it went, e.g.
    `127.0.0.1 "POST /v1/completions HTTP/1.1" 200 512 0.001234s backend=rtx-3:8000
    class=RTX-4090/awq-int4` (`-` for a request no backend saw; ` cut` ends the line of a
    request cut at the drain's end), built by one format string
    instead of a list of per-field methods and an `extra` dict nobody reads (the handler's
    format is the message alone). It runs once per request."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        v = request.version
        backend, node_class = served_by(request.get(SERVED_BY))
        self.logger.info(
            '%s "%s %s HTTP/%d.%d" %d %d %06fs backend=%s class=%s%s',
            request.remote or "-",
            request.method,
            request.path_qs,
            v.major,
            v.minor,
            response.status,
            response.body_length,
            time,
            backend,
            node_class,
            " cut" if request.get(CUT) else "",
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)  # so FLEETCTL_LOG_LEVEL=WARNING skips it


def read_secret(path: Path, what: str) -> str:
    """A secret from a file that only its owner can read (0600 or stricter)."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise UserError(
            f"cannot read the {what}: {e.strerror}", Location(str(path)), "check the path"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(
            f"the {what} is readable by others (mode {stat.S_IMODE(mode):o})",
            Location(str(path)),
            f"chmod 600 {path}",
        )
    if not text:
        raise UserError(f"the {what} is empty", Location(str(path)), "write the key on one line")
    return text


def build_router(
    inv: Inventory,
    catalog: Catalog,
    *,
    backends_file: Path | None,
    state_dir: StateDir,
    policy: str,
    config: DaemonConfig,
    scrape_interval: float,
    session_store: str | None = None,
    online_fit: bool = True,
    calibrated: bool = True,
    prefix_capacity: int = PREFIX_CAPACITY,
    kv_events: dict[str, str | KvEndpoint] | None = None,
    use_kv_events: bool | None = None,
    request_log: bool | None = None,
    max_sessions: int = SESSIONS_MAX,
    autopilot_log: Path | None = None,
) -> Router:
    """The daemon for an inventory. `prefix_capacity` bounds the prefix index (blocks over
    all backends, least recently used first out; 0: no index) that Router gives a policy
    that reads one; its placements feed it (approximate), shared with the other replicas
    through the session store; or, with `kv_events` (backend name -> ZMQ endpoint), the
    servers' KV events feed it (precise; Router.kv_events). Without `kv_events`,
    `use_kv_events` (None: the inventory's router.prefix_cache.kv_events) takes them from
    the flags `fleetctl apply` started each server with (kv_sources). `request_log` (None: the
    inventory's router.request_log.enabled) keeps the log of finished requests in the state
    folder's requests/ (daemon/request_log.py). `max_sessions` bounds the session pins held in
    memory (least recently used first out). `autopilot_log`: the autopilot's audit log, whose
    decisions /metrics shows (daemon/autopilot_log.py)."""
    if policy not in policy_names():
        raise UserError(
            f"unknown policy '{policy}'", None, f"choose from {', '.join(policy_names())}"
        )
    spec = inv.spec.router
    # Live servers' measured KV and speed over the model's, where `fleetctl calibrate` has them.
    backends = load_backends(inv, catalog, backends_file, state_dir, calibrated=calibrated)
    if kv_events is None:
        kv_events = kv_sources(inv, backends_file, state_dir, use_kv_events, backends)
    if kv_events:
        _need_prefix_extra()
    outputs = {m.name: m.spec.workload.mean_output_tokens for m in inv.models if m.spec.workload}
    # vLLM's --api-key guards /v1/models too, which the model-name check reads.
    # Each backend's speed is learned from its own /metrics while it serves (online_fit).
    live = LiveState(
        backends,
        interval=scrape_interval,
        api_key=config.backend_api_key,
        online_fit=online_fit,
        warmup_requests=spec.warmup_requests,
    )
    shared = None
    if session_store:
        if not session_store.startswith(("redis://", "rediss://", "unix://")):
            raise UserError(
                f"unknown session store {session_store!r}", None, "use redis://HOST:PORT/DB"
            )
        from fleetctl.daemon.shared import RedisShared

        shared = RedisShared(session_store, max_sessions=max_sessions)
    # A model with no stated SLO routes and counts attainment by the one the applied plan
    # was made by, as `plan` printed it (state.json keeps it); servers given by --backends
    # were planned by none, so theirs is derived from them (fleetctl/fleet/slo.py).
    routing = RoutingConfig.of(inv, [(b.model, b.perf, b.max_model_len) for b in backends])
    if backends_file is None:
        routing.slo.update(planned_unless_stated(inv.models, state_dir.load_state().slo))
    for name, slo in sorted(routing.slo.items()):
        log.info("SLO of %s: %s", name, slo_origin(slo))
    sched = routing_core(
        policy,
        len(backends),
        config=routing,
        aging=Aging(spec.aging.factor, spec.aging.window_s, spec.aging.enabled),
        prefix_capacity=prefix_capacity,
        kv_events=bool(kv_events),
        shared=shared,
        max_sessions=max_sessions,
    )
    # A variant whose source is a local folder lends the router its tokenizer.
    local = {
        m.name: Path(v.source).expanduser()
        for m in inv.models
        for v in m.variants
        if Path(v.source).expanduser().exists()
    }
    router = Router(
        backends,
        sched,
        config,
        OutputEstimator(outputs),
        live,
        shared=shared,
        tokens=TokenCounter(local),
        known_formats=frozenset(catalog.formats),
        slo=routing.slo,
        prefix_capacity=prefix_capacity,
        kv_events=kv_events,
        request_log=open_request_log(inv, state_dir, request_log),
    )
    if autopilot_log is not None:
        router.metrics.sources.append(AutopilotLog(autopilot_log).render)
    router.intake.use_adapters(adapter_bases(inv), Loader(loadable(inv), config.backend_api_key))
    return router


def slo_origin(slo: Slo) -> str:
    """`99% within TTFT <= 2.4 s and TPOT <= 52 ms (derived, as the applied plan (state
    serial 3) records it)`, or where route-serve derived it itself, from what."""
    if slo.origin == "derived":
        return (
            f"{slo.share * 100:.4g}% within {slo.text()} (derived from the servers given, "
            f"no applied plan records one: {slo.basis})"
        )
    return slo.describe()


def open_request_log(
    inv: Inventory, state_dir: StateDir, enabled: bool | None
) -> RequestLog | None:
    """The request log the inventory asks for (router.request_log), unless `enabled` says."""
    spec = inv.spec.router.request_log
    if not (spec.enabled if enabled is None else enabled):
        return None
    folder = state_dir.requests_path
    try:
        return RequestLog(folder, int(spec.max_file_mb * MB), int(spec.max_total_mb * MB))
    except OSError as e:
        raise UserError(
            f"cannot keep the request log: {e.strerror or e}",
            Location(str(folder)),
            "make the state folder writable, or run route-serve with --no-request-log",
        ) from None


def kv_sources(
    inv: Inventory,
    backends_file: Path | None,
    state_dir: StateDir,
    enabled: bool | None,
    backends: list[Backend],
) -> dict[str, str | KvEndpoint] | None:
    """Where each backend publishes KV events, read from the state's recorded flags, when
    `enabled` (None: the inventory's router.prefix_cache.kv_events); None when off."""
    on = inv.spec.router.prefix_cache.kv_events if enabled is None else enabled
    if not on:
        return None
    if backends_file is not None:
        if enabled:
            raise UserError(
                "--kv-events reads each server's KV event ports from the state, not from a "
                "backends file",
                Location(str(backends_file)),
                "route servers fleetctl applied (no --backends), or leave out --kv-events",
            )
        log.warning("KV events: not read for a backends file's servers (--backends)")
        return None
    found: dict[str, str | KvEndpoint] = dict(kv_events_from_state(state_dir))
    missing = [b.name for b in backends if b.name not in found]
    if missing:
        log.warning(
            "KV events: %d of %d backends publish none (e.g. %s): `fleetctl apply` restarts "
            "them with router.prefix_cache.kv_events; until then they find no cached prefix",
            len(missing),
            len(backends),
            missing[0],
        )
    return found


def _need_prefix_extra() -> None:
    """KV events need pyzmq and msgpack (the `prefix` extra): say so before serving."""
    import importlib.util

    missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"KV events need {' and '.join(missing)}, which are not installed",
            None,
            "pip install 'fleetctl[prefix]', or run route-serve with --no-kv-events",
        )


def server_options(config: DaemonConfig) -> dict[str, Any]:
    """aiohttp's per-connection limits. keepalive_timeout also bounds how long a request head
    may take: aiohttp closes a connection whose head is not whole by then."""
    return {
        "max_line_size": MAX_LINE_BYTES,
        "max_field_size": MAX_FIELD_BYTES,
        "max_headers": MAX_HEADERS,
        "keepalive_timeout": config.idle_timeout_s,
        "lingering_time": config.linger_s,
        "handler_cancellation": True,  # a client that disconnects cancels its upstream request
    }


def serve(
    router: Router,
    listen: str,
    reload: Reload,
    watch: StateDir | None,
    workers: int = 1,
) -> None:
    """Serve until SIGTERM or SIGINT; with `workers` > 1, as that many processes on one
    listening port (SO_REUSEPORT: the kernel spreads connections over them), restarted if one
    dies. They share session pins, the aging window and the prefix index through the session
    store, if the router has one; without, each worker keeps its own. The port is bound
    first, here: one taken is a UserError before anything else is printed."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if workers <= 1:
        _serve_one(router, bind(host, int(port), False, LISTEN_FIX), reload, watch)
        return
    # One socket per worker, all bound before any starts; a worker started again takes its
    # predecessor's, so connections queued on it are not lost.
    socks = [bind(host, int(port), True, LISTEN_FIX) for _ in range(workers)]
    if router.shared is None:
        log.warning(
            "--workers %d without --session-store: each worker keeps its own session pins, "
            "aging window and prefix index, so a session's turns may reach another class; "
            "give --session-store redis://HOST:PORT/DB to share them",
            workers,
        )

    def child(worker: int) -> None:
        router.become_worker(worker)  # a replica of its own in the session store
        for i, other in enumerate(socks):
            if i != worker:
                for s in other:
                    s.close()
        _serve_one(router, socks[worker], reload, watch)

    supervise(child, workers)


# A worker that dies is started again, unless this many died within RESTART_WINDOW_S (a worker
# that cannot start at all: the port is taken, say); then route-serve stops with exit 1.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 30.0


def supervise(child: Callable[[int], None], workers: int) -> None:
    """Fork `workers` processes running `child(i)`, forward SIGTERM, SIGINT (as SIGTERM) and
    SIGHUP to them, start one again when it dies, and return once all have ended."""
    children: dict[int, int] = {}
    stopping = False

    def spawn(i: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_DFL)
                child(i)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                log.exception("worker %d failed", i)
            finally:
                logging.shutdown()
                os._exit(code)
        children[pid] = i

    def forward(sig: int, frame: object) -> None:
        nonlocal stopping
        if sig != signal.SIGHUP:
            stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP if sig == signal.SIGHUP else signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for i in range(workers):
        spawn(i)
    log.info("route-serve: %d workers (pids %s) on one port", workers, " ".join(map(str, children)))
    deaths: list[float] = []
    failed = False
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        i = children.pop(pid, -1)
        if i < 0 or stopping:
            continue
        now = time.monotonic()
        deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
        code = os.waitstatus_to_exitcode(status)
        if len(deaths) >= MAX_RESTARTS:
            log.error("worker %d exited (%d): too many workers died; stopping", i, code)
            failed = stopping = True
            forward(signal.SIGTERM, None)
            continue
        log.warning("worker %d (pid %d) exited (%d); starting another", i, pid, code)
        spawn(i)
    if failed:
        raise SystemExit(1)


def _serve_one(
    router: Router, socks: list[socket.socket], reload: Reload, watch: StateDir | None
) -> None:
    app = router.app()

    async def on_start(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload(router, reload))
        if watch is not None:
            app["watch"] = asyncio.create_task(_watch(router, reload, watch))

    async def on_stop(app: web.Application) -> None:
        task = app.get("watch")
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.on_startup.append(on_start)
    app.on_cleanup.append(on_stop)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    # `kill -USR1 PID` prints every thread's stack to the log, even with the event loop stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    host, port = socks[0].getsockname()[:2]
    log.info(
        "fleetctl route-serve on %s: %d backends, policy %s%s",
        names.http_url(host, port),
        len(router.backends),
        router.policy.name,
        "" if router.worker is None else f" (worker {router.worker}, pid {os.getpid()})",
    )
    asyncio.run(_run(app, socks, router))


async def _run(app: web.Application, socks: list[socket.socket], router: Router) -> None:
    """Serve `app` on `socks` until a signal; then drain (listen.py), and cut what is left
    (Router.cut)."""
    config = router.config
    first, second = asyncio.Event(), asyncio.Event()
    stop_signals(first, second)  # before the app starts: a signal during its start counts
    runner = await start(
        app,
        socks,
        JsonErrorRunner,
        access_log_class=AccessLog,
        access_log_format=ACCESS_LOG_FORMAT,
        **server_options(config),
    )
    try:
        await first.wait()
        log.info("stopping: %s", _draining(runner, config.drain_timeout_s))
    finally:
        await stop(runner, config.drain_timeout_s, second, router.cut)


def _draining(runner: web.AppRunner, drain_s: float) -> str:
    n = busy(runner.server) if runner.server is not None else 0
    if not n:
        return "no request in flight"
    return f"{n} requests in flight get up to {drain_s:g} s to finish (signal again to cut them)"


def _reload(router: Router, reload: Reload) -> None:
    """Load the backends again; one that fails keeps the last good ones and says why in one
    line, each time, so a daemon never stops following its files or dies of a bad one."""
    try:
        fresh = reload()
    except FleetError as e:
        log.error("reload failed, keeping the last good backends: %s", e)
        return
    except Exception as e:  # a bug must not take the signal handler or the watch down
        log.error("reload failed, keeping the last good backends: internal error: %r", e)
        return
    router.replace_backends(fresh)
    log.info("reloaded: %d backends", len(fresh))


async def _watch(router: Router, reload: Reload, state_dir: StateDir) -> None:
    """Reload when `fleetctl apply` rewrites state.json or `fleetctl health` health.json.
    A change is a new modification time, size or file (an atomic write is a new inode); a
    reload that failed is tried again at the file's next change, not every second."""
    paths = (state_dir.state_path, state_dir.health_path)

    def stamp() -> tuple[tuple[int, int, int], ...]:
        out = []
        for path in paths:
            try:
                st = path.stat()
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append((0, 0, 0))
        return tuple(out)

    seen = stamp()
    while True:
        await asyncio.sleep(1.0)
        now = stamp()
        if now != seen:
            seen = now
            _reload(router, reload)
