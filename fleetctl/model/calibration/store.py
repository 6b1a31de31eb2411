"""What `.fleetctl/calibration.json` holds: an entry of measured figures per class key and
the servers' start-ups, read and written by these dataclasses' types (fleetctl/base/documents)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, replace
from typing import Annotated, Any

from pydantic import Field, FiniteFloat

from fleetctl.base import documents
from fleetctl.model.calibration.figures import Figure, measure
from fleetctl.model.calibration.fit import StepModel
from fleetctl.model.calibration.key import Key, best
from fleetctl.model.calibration.rules import (
    CALIBRATION_FORMAT,
    KEEP_SAMPLES,
    CalibrationError,
    Name,
)
from fleetctl.model.calibration.startup import KEEP_STARTUPS, Startup
from fleetctl.model.calibration.window import Sample
from fleetctl.model.perf import EnginePerf


@dataclass(frozen=True)
class Entry:
    """The measured figures of one key: from `servers`, fitted over `samples`, at `measured_at`
    (UTC, ISO 8601)."""

    key: Key
    measured_at: Name
    servers: tuple[str, ...] = ()
    kv_tokens: Figure | None = None
    step: StepModel | None = None
    step_at_batch: Annotated[Figure | None, Field(alias="step_at_batch_s")] = None
    prefill_tok_s: Figure | None = None
    ttft_s: Figure | None = None
    samples: tuple[Sample, ...] = ()
    # The servers' setting, which their KV cache depends on.
    gpu_memory_utilization: FiniteFloat | None = None

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    @property
    def step_trusted(self) -> bool:
        return (
            self.step is not None and self.step_at_batch is not None and self.step_at_batch.trusted
        )

    def describe(self) -> str:
        """`calibrated from 3 servers, 2026-12-01 10:20`."""
        n = len(self.servers)
        when = self.measured_at[:16].replace("T", " ")
        return f"calibrated from {n} server{'s' if n != 1 else ''}, {when}"

    def to_json(self) -> dict[str, Any]:
        """The entry as the file keeps it (`calibrate --json` shows the fresh ones)."""
        return documents.data(self)


@dataclass(frozen=True)
class Calibration:
    entries: tuple[Entry, ...] = ()
    # How long servers took to start, as apply timed them (warm-up; fleetctl/apply/warmup.py).
    # Absent from files written before apply timed start-ups.
    startups: tuple[Startup, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The file's document: entries and start-ups in key order, so that a file changes only
        where a measurement did."""
        return documents.dump(
            replace(
                self,
                entries=tuple(sorted(self.entries, key=lambda e: _in_order(e.key))),
                startups=tuple(sorted(self.startups, key=lambda s: _in_order(s.key))),
            ),
            CALIBRATION_FORMAT,
        )

    @classmethod
    def from_json(cls, raw: object) -> Calibration:
        """A calibration from a parsed document; CalibrationError names the field that is wrong."""
        try:
            return documents.parse(raw, cls, reads=(CALIBRATION_FORMAT,))
        except documents.DocumentError as e:
            raise CalibrationError(str(e)) from None

    def get(self, key: Key) -> Entry | None:
        return next((e for e in self.entries if e.key == key), None)

    def merged(self, fresh: Iterable[Entry]) -> Calibration:
        """This calibration with `fresh` entries replacing those of the same key."""
        new = {e.key: e for e in fresh}
        kept = [e for e in self.entries if e.key not in new]
        return Calibration(tuple(kept) + tuple(new.values()), self.startups)

    def find(
        self,
        gpu: str,
        model: str,
        fmt: str,
        tp: int,
        vllm_version: str | None = None,
        max_model_len: int | None = None,
    ) -> Entry | None:
        """The entry for a class: the same GPU, model, format and TP; of those, a class entry
        (not one node's), then the same vLLM version, then the same max_model_len, then the
        newest."""
        return best(self.entries, (gpu, model, fmt, tp), vllm_version, max_model_len)


def _in_order(key: Key) -> tuple[tuple[bool, Any], ...]:
    # Key's own order compares None with a value (a node's key beside its class's) and fails:
    # an absent field sorts first instead.
    return tuple((v is not None, v) for v in astuple(key))


def entry_for(
    key: Key,
    servers: Sequence[str],
    samples: Sequence[Sample],
    kv_tokens: Sequence[int],
    measured_at: str,
    previous: Entry | None = None,
    perf: EnginePerf | None = None,
    model_kv_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
) -> Entry:
    """The entry after a calibration run: this run's samples after the previous entry's (the
    newest KEEP_SAMPLES of them), refitted; KV from this run's servers."""
    kept = ((previous.samples if previous else ()) + tuple(samples))[-KEEP_SAMPLES:]
    prev_kv = None
    if previous and previous.kv_tokens and previous.kv_tokens.trusted:
        prev_kv = int(previous.kv_tokens.value)
    figs = measure(kept, kv_tokens, perf, model_kv_tokens, prev_kv)
    util = gpu_memory_utilization
    if figs.kv_tokens is None and previous is not None:
        figs = replace(figs, kv_tokens=previous.kv_tokens)
        util = previous.gpu_memory_utilization
    return Entry(
        key,
        measured_at,
        tuple(servers),
        figs.kv_tokens,
        figs.step,
        figs.step_at_batch,
        figs.prefill_tok_s,
        figs.ttft_s,
        kept,
        util,
    )


def record_startup(
    cal: Calibration,
    key: Key,
    seconds: float,
    measured_at: str,
    phases: dict[str, float] | None = None,
    server: str = "",
) -> Calibration:
    """`cal` with one more start-up of `key` (the newest KEEP_STARTUPS kept)."""
    old = next((s for s in cal.startups if s.key == key), None)
    times = ((old.seconds if old else ()) + (seconds,))[-KEEP_STARTUPS:]
    servers = tuple(dict.fromkeys((*(old.servers if old else ()), server)))
    servers = tuple(s for s in servers if s)[-KEEP_STARTUPS:]
    fresh = Startup(key, measured_at, times, dict(phases or {}), servers)
    kept = tuple(s for s in cal.startups if s.key != key)
    return replace(cal, startups=(*kept, fresh))


def find_startup(
    cal: Calibration,
    gpu: str,
    model: str,
    fmt: str,
    tp: int,
    vllm_version: str | None = None,
) -> Startup | None:
    """The start-ups of a class (GPU, model, format, TP): the same vLLM version first, then
    the newest."""
    return best(cal.startups, (gpu, model, fmt, tp), vllm_version)
