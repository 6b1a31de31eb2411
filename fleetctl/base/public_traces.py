"""The public LLM request traces fleetctl knows by name, their cache, and `--trace NAME`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

from fleetctl.base import names as check
from fleetctl.base.errors import Location, UserError, shown, suggestion, what_and_fix

# A JSON file of entries that replace built-in ones by name (any subset of their fields) or add
# new ones (name, file, url, size and sha256 at least): a mirror's URLs, or a test's server.
REGISTRY_ENV = "FLEETCTL_TRACE_REGISTRY"
# The cache root; traces go in its traces/ folder. Unset: $XDG_CACHE_HOME/fleetctl, else
# ~/.cache/fleetctl.
CACHE_ENV = "FLEETCTL_CACHE"

_AZURE_CITE = (
    'Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024'
)
_MOONCAKE_CITE = (
    'Qin et al., "Mooncake: Trading More Storage for Less Computation - A KVCache-centric '
    'Architecture for Serving LLM Chatbot", USENIX FAST 2025'
)
_AZURE_RAW = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/"
_MOONCAKE_RAW = "https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"


@dataclass(frozen=True)
class PublicTrace:
    """One downloadable trace: where it comes from, its exact bytes, and whom to credit."""

    name: str
    file: str  # the upstream file name
    url: str
    size: int  # bytes
    sha256: str
    license: str = ""  # SPDX identifier
    description: str = ""
    citation: str = ""

    @property
    def cache_name(self) -> str:
        # Named for the entry, not the upstream file: two sources may both ship "trace.jsonl".
        return self.name + Path(self.file).suffix

    def to_json(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Sizes and checksums are those of the files as the URLs serve them (the repositories' blobs,
# identical to the copies in the shared traces folder); `fleetctl traces get` checks both.
# Mooncake's tool-agent trace and BurstGPT are not here: their checksums could not be taken
# from the files themselves, and an entry is only added with one that was.
BUILTIN: tuple[PublicTrace, ...] = (
    PublicTrace(
        name="azure-conv-2023",
        file="AzureLLMInferenceTrace_conv.csv",
        url=_AZURE_RAW + "AzureLLMInferenceTrace_conv.csv",
        size=719_188,
        sha256="2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
        license="CC-BY-4.0",
        description="Azure LLM inference 2023, conversation: 19,366 requests in one hour (CSV)",
        citation=_AZURE_CITE,
    ),
    PublicTrace(
        name="azure-code-2023",
        file="AzureLLMInferenceTrace_code.csv",
        url=_AZURE_RAW + "AzureLLMInferenceTrace_code.csv",
        size=320_117,
        sha256="54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
        license="CC-BY-4.0",
        description="Azure LLM inference 2023, code: 8,819 requests in one hour (CSV)",
        citation=_AZURE_CITE,
    ),
    PublicTrace(
        name="mooncake-conversation",
        file="conversation_trace.jsonl",
        url=_MOONCAKE_RAW + "conversation_trace.jsonl",
        size=3_029_533,
        sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        license="Apache-2.0",
        description="Kimi's conversation service: 12,031 requests in one hour, prompt block "
        "hashes (JSONL)",
        citation=_MOONCAKE_CITE,
    ),
)


def registry() -> dict[str, PublicTrace]:
    """The known traces by name: the built-in ones, changed or extended by $REGISTRY_ENV."""
    known = {t.name: t for t in BUILTIN}
    path = os.environ.get(REGISTRY_ENV)
    if not path:
        return known
    where = Location(path)
    fix = f"fix the file or unset {REGISTRY_ENV}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read the trace registry: {e.strerror}", where, fix) from None
    except ValueError as e:
        raise UserError(f"the trace registry is not JSON: {e}", where, fix) from None
    entries = data.get("traces") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise UserError("the trace registry is not a list of traces", where, fix)
    names = {f.name for f in fields(PublicTrace)}
    for i, entry in enumerate(entries):
        at = Location(path, path=f"traces[{i}]")
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise UserError("a trace needs a name", at, fix)
        unknown = sorted(set(entry) - names)
        if unknown:
            raise UserError(f"unknown field {shown(unknown[0])}", at, f"use {sorted(names)}")
        _check_path_parts(entry, path, i)
        try:
            base = known.get(entry["name"])
            known[entry["name"]] = replace(base, **entry) if base else PublicTrace(**entry)
        except TypeError:
            raise UserError("a new trace needs name, file, url, size and sha256", at, fix) from None
    return known


def _check_path_parts(entry: dict[str, object], path: str, i: int) -> None:
    """The name and the upstream file name make the cached file's name, so each must be a
    name by the inventory's grammar: no separator, no '..', nothing that leaves the cache."""
    for key in ("name", "file"):
        if key not in entry:
            continue
        value = entry[key]
        try:
            if not isinstance(value, str):
                raise ValueError(f"trace {key} {shown(value)} is not text | write a name")
            check.name(value, f"trace {key}")
        except ValueError as e:
            what, fix = what_and_fix(e)
            raise UserError(what, Location(path, path=f"traces[{i}].{key}"), fix) from None


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg) / "fleetctl") if xdg else str(Path.home() / ".cache" / "fleetctl")
    return Path(root) / "traces"


def cached_path(trace: PublicTrace) -> Path:
    folder = cache_dir()
    path = folder / trace.cache_name
    if path.parent != folder or trace.cache_name in (".", ".."):
        # Every entry's names were checked when the registry was read; this keeps a trace
        # made some other way from writing outside the cache too.
        raise UserError(
            f"trace {shown(trace.name)} would be cached outside the cache",
            Location(str(folder)),
            "name traces with letters, digits, '.', '_' and '-'",
        )
    return path


# A download writes `.{cache name}.{pid}.{random}.part` beside its final path and renames it in
# when its checksum matches. Each writer holds the cache's lock file shared while it writes, so
# the first command that gets it exclusively knows every partial file there is a dead writer's
# (SIGKILL, a power cut: nothing runs in the process to remove its own).
_LOCK = ".lock"
_PART = ".part"


def partial_prefix(trace: PublicTrace) -> str:
    """The start of a partial file's name for this process (mkstemp adds the rest)."""
    return f".{trace.cache_name}.{os.getpid()}."


@contextlib.contextmanager
def cache_writer() -> Iterator[Path]:
    """The cache folder, made and held for writing partial files: the dead writers' are
    removed first, and this process's own are removed on the way out, however it goes
    (an exception, or a signal turned into one)."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # Read-only: flock needs no write access, so one user's lock file serves all of a shared cache.
    fd = os.open(folder / _LOCK, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _remove_dead_partials(fd, folder)
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield folder
    finally:
        own = str(os.getpid())
        for part in folder.glob(f".*{_PART}"):
            if part.name.split(".")[-3:-2] == [own]:
                part.unlink(missing_ok=True)
        os.close(fd)  # releases the lock


def clean_partials() -> None:
    """Remove partial files left by dead writers, if the cache exists and is ours to write."""
    folder = cache_dir()
    try:
        fd = os.open(folder / _LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # no cache yet
    try:
        _remove_dead_partials(fd, folder)
    finally:
        os.close(fd)


def _remove_dead_partials(fd: int, folder: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # a download is running; the next command after it cleans up
    for part in folder.glob(f".*{_PART}"):
        with contextlib.suppress(OSError):
            part.unlink()


def is_cached(trace: PublicTrace) -> bool:
    """Whether the cache holds the trace. Only its size is checked: a file arrives in the cache
    by a rename after its checksum matched, so hashing it again on every use buys nothing."""
    try:
        return cached_path(trace).stat().st_size == trace.size
    except OSError:
        return False


def find(name: str) -> PublicTrace:
    """The registered trace `name`; an unknown one is a UserError naming the closest."""
    known = registry()
    if name in known:
        return known[name]
    hint = suggestion(name, list(known))
    see = "see `fleetctl traces list`"
    fix = f"{hint} {see}" if hint else see
    raise UserError(f"no public trace named {shown(name)}", None, fix)


def resolve_trace(value: Path | None) -> Path | None:
    """What a trace option means: an existing path as it is, else a registered trace's cached
    file. Every option that takes a trace uses this as its callback."""
    if value is None or value.exists():
        return value
    text = str(value)
    if text not in registry() and ("/" in text or os.sep in text or value.suffix):
        return value  # a file that is not there: the loader says so, as it always has
    trace = find(text)
    if not is_cached(trace):
        raise UserError(
            f"public trace {shown(text)} is not downloaded",
            Location(str(cached_path(trace))),
            f"run `fleetctl traces get {text}`",
        )
    return cached_path(trace)
