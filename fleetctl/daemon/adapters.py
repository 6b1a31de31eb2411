"""Which servers have which LoRA adapters loaded, as route-serve learns it, and a request's."""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetctl.fleet.http import Client, HttpError
from fleetctl.fleet.inventory import Inventory
from fleetctl.routing.request import ClientError, shown
from fleetctl.routing.types import Backend

# vLLM 0.32's series (vllm/v1/metrics/loggers.py): one per label set it has seen, its value
# the Unix time that set was last true; labels in its order (max_lora, waiting, running).
_LORA_INFO = re.compile(
    r'^vllm:lora_requests_info\{max_lora="(\d*)",waiting_lora_adapters="([^"]*)",'
    r'running_lora_adapters="([^"]*)"\}\s+(\S+)',
    re.MULTILINE,
)
MAX_LEARNED = 256  # adapters one server is taken to have loaded, at most (bounds memory)
# A runtime load reads the adapter's files (from the node's disk, or downloads them from
# Hugging Face): seconds for a small one, longer for a large one or a slow link.
LOAD_TIMEOUT_S = 120.0
log = logging.getLogger("fleetctl.router")


def adapter_bases(inv: Inventory) -> dict[str, str]:
    """Each inventory adapter's name -> its base model's name. Only these names route as
    adapters (and reach metric labels), so a client cannot grow the label set."""
    return {a.name: m.name for m in inv.models for a in m.adapters}


def lora_modules(vllm_args: Sequence[str]) -> frozenset[str]:
    """The adapter names a server's `--lora-modules name=path ...` preloads."""
    out: set[str] = set()
    args = list(vllm_args)
    for i, arg in enumerate(args):
        if arg == "--lora-modules":
            for value in args[i + 1 :]:
                if value.startswith("--"):
                    break
                out.add(value.split("=", 1)[0])
        elif arg.startswith("--lora-modules="):
            out.update(v.split("=", 1)[0] for v in shlex.split(arg.split("=", 1)[1]))
    return frozenset(out)


def lora_rank(vllm_args: Sequence[str]) -> int:
    """A server's `--max-lora-rank` (the rank its slots run at), 0 when not given."""
    args = list(vllm_args)
    for i, arg in enumerate(args):
        value = None
        if arg == "--max-lora-rank" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--max-lora-rank="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit():
            return int(value)
    return 0


def listed_adapters(data: Iterable[Any], parent: str) -> frozenset[str]:
    """The adapters a server's /v1/models lists: vLLM's cards whose parent is its base model
    (vllm/entrypoints/openai/models/serving.py, show_available_models)."""
    return frozenset(
        m["id"]
        for m in list(data)[:MAX_LEARNED]
        if isinstance(m, dict) and m.get("parent") == parent and isinstance(m.get("id"), str)
    )


def lora_info(text: str) -> tuple[int, frozenset[str], frozenset[str]] | None:
    """(max_lora, running, waiting) from the newest vllm:lora_requests_info series of one
    /metrics page; None when the page has none (LoRA off, or no step logged yet)."""
    newest: tuple[float, re.Match[str]] | None = None
    for m in _LORA_INFO.finditer(text):
        try:
            at = float(m.group(4))
        except ValueError:
            continue
        if newest is None or at >= newest[0]:
            newest = (at, m)
    if newest is None:
        return None
    m = newest[1]

    def names(joined: str) -> frozenset[str]:
        return frozenset(n for n in joined.split(",")[:MAX_LEARNED] if n)

    return int(m.group(1) or 0), names(m.group(3)), names(m.group(2))


def learn_from_models(b: Backend, data: Iterable[Any], parent: str) -> None:
    """A /v1/models read: what it lists is what the server has loaded now."""
    b.adapters = listed_adapters(data, parent)


def learn_from_metrics(b: Backend, text: str) -> None:
    """A /metrics scrape: adapters running or waiting there are loaded there."""
    info = lora_info(text)
    if info is not None:
        b.lora_max, b.lora_running, b.lora_waiting = info
        b.adapters = b.adapters | info[1] | info[2]


def check_loaded(adapter: str, base: str, backends: Sequence[Backend]) -> None:
    """A 404 in vLLM's words, naming the adapter, when no server of `base` has it loaded."""
    if not any(b.model == base and adapter in b.adapters for b in backends):
        raise ClientError(
            404,
            f"The model `{shown(adapter)[1:-1]}` does not exist: no server of {base} has the "
            "adapter loaded.",
            "NotFoundError",
            "model",
        )


def with_adapters(
    served: Mapping[str, frozenset[str]], adapters: Mapping[str, str]
) -> dict[str, frozenset[str]]:
    """The models a request may name: the served ones, and each adapter of one, whose
    precision hints are checked against its base model's formats."""
    out = dict(served)
    out.update({a: served[base] for a, base in adapters.items() if base in served})
    return out


@dataclass(frozen=True)
class Loadable:
    """An adapter the router may load at runtime: its base model's servers run with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (the inventory's `adapters_runtime`)."""

    path: str  # its `source`, as --lora-modules would name it
    gpu_types: tuple[str, ...]  # the GPU types it is pinned to; empty: any


def loadable(inv: Inventory) -> dict[str, Loadable]:
    """The adapters of the models whose servers load adapters at runtime."""
    return {
        a.name: Loadable(a.spec.source, a.gpu_types)
        for m in inv.models
        if m.spec.adapters_runtime
        for a in m.adapters
    }


@dataclass
class Loader:
    """Loads an adapter no server has on one server of its base model, when the inventory
    lets servers load at runtime: the one with the fewest adapters loaded, then the fewest
    requests in flight. Requests for it meanwhile wait for that one load."""

    adapters: Mapping[str, Loadable] = field(default_factory=dict)
    api_key: str | None = None
    timeout: float = LOAD_TIMEOUT_S
    # One per adapter being loaded; keys only from `adapters`, so bounded by the inventory.
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    loads: int = 0  # loads done, for the log and tests

    async def ensure(self, adapter: str, base: str, backends: Sequence[Backend]) -> None:
        """Return once a server of `base` has `adapter` loaded; a ClientError if none has
        it and it cannot be loaded (not loadable: 404; the load failed: 503)."""
        spec = self.adapters.get(adapter)
        if spec is None or _has(adapter, base, backends):
            check_loaded(adapter, base, backends)
            return
        lock = self._locks.setdefault(adapter, asyncio.Lock())
        async with lock:
            if _has(adapter, base, backends):  # loaded while this request waited
                return
            fit = [
                b
                for b in backends
                if b.model == base
                and b.healthy
                and (not spec.gpu_types or b.gpu_type in spec.gpu_types)
            ]
            if not fit:
                raise ClientError(
                    503, f"no healthy server of {base} may load adapter {adapter}", "server_error"
                )
            best = min(fit, key=lambda b: (len(b.adapters), b.outstanding, b.name))
            await self._load(best, adapter, spec.path)

    async def _load(self, b: Backend, adapter: str, path: str) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        body = {"lora_name": adapter, "lora_path": path}
        started = time.monotonic()
        client = Client(self.timeout)
        try:
            r = await client.post(f"{b.name}/v1/load_lora_adapter", body, headers)
        except HttpError as e:
            raise ClientError(
                503, f"loading adapter {adapter} on {b.node} failed: {e}", "server_error"
            ) from None
        finally:
            await client.close()
        # vLLM's 400 for one loaded meanwhile (by another router replica) is as good.
        if r.status != 200 and not (r.status == 400 and b"already been loaded" in r.body):
            raise ClientError(
                503,
                f"loading adapter {adapter} on {b.node} failed: HTTP {r.status}",
                "server_error",
            )
        b.adapters = b.adapters | {adapter}
        self.loads += 1
        log.info("loaded adapter %s on %s in %.2f s", adapter, b.node, time.monotonic() - started)


def _has(adapter: str, base: str, backends: Sequence[Backend]) -> bool:
    return any(b.model == base and adapter in b.adapters for b in backends)
