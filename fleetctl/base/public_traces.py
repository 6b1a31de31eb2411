"""The public LLM request traces fleetctl knows by name, their cache, and `--trace NAME`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from fleetctl.base.errors import Location, UserError, did_you_mean, shown

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
        try:
            base = known.get(entry["name"])
            known[entry["name"]] = replace(base, **entry) if base else PublicTrace(**entry)
        except TypeError:
            raise UserError("a new trace needs name, file, url, size and sha256", at, fix) from None
    return known


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg) / "fleetctl") if xdg else str(Path.home() / ".cache" / "fleetctl")
    return Path(root) / "traces"


def cached_path(trace: PublicTrace) -> Path:
    return cache_dir() / trace.cache_name


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
    hint = did_you_mean(name, list(known))
    see = "see `fleetctl traces list`"
    fix = f"did you mean {hint!r}? {see}" if hint else see
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
