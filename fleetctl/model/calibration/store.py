"""What `.fleetctl/calibration.json` holds: an entry of measured figures per class key and
the servers' start-ups, to and from JSON."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fleetctl.model.calibration.figures import Figure, measure
from fleetctl.model.calibration.fit import StepModel
from fleetctl.model.calibration.key import Key, best
from fleetctl.model.calibration.rules import (
    CALIBRATION_FORMAT,
    KEEP_SAMPLES,
    CalibrationError,
    is_num,
    num,
)
from fleetctl.model.calibration.startup import KEEP_STARTUPS, Startup
from fleetctl.model.calibration.window import Sample
from fleetctl.model.perf import EnginePerf


@dataclass(frozen=True)
class Entry:
    """The measured figures of one key: from `servers`, fitted over `samples`, at `measured_at`
    (UTC, ISO 8601)."""

    key: Key
    measured_at: str
    servers: tuple[str, ...] = ()
    kv_tokens: Figure | None = None
    step: StepModel | None = None
    step_at_batch: Figure | None = None
    prefill_tok_s: Figure | None = None
    ttft_s: Figure | None = None
    samples: tuple[Sample, ...] = ()
    gpu_memory_utilization: float | None = None  # the servers' (their KV cache depends on it)

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
        def fig(f: Figure | None) -> dict[str, Any] | None:
            return None if f is None else f.to_json()

        return {
            "key": self.key.to_json(),
            "measured_at": self.measured_at,
            "servers": list(self.servers),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "n_samples": self.n_samples,
            "kv_tokens": fig(self.kv_tokens),
            "step": None if self.step is None else self.step.to_json(),
            "step_at_batch_s": fig(self.step_at_batch),
            "prefill_tok_s": fig(self.prefill_tok_s),
            "ttft_s": fig(self.ttft_s),
            "samples": [s.to_json() for s in self.samples],
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> Entry:
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: not an object")
        key = Key.from_json(raw.get("key"), f"{where}.key")
        at = raw.get("measured_at")
        if not isinstance(at, str) or not at:
            raise CalibrationError(f"{where}.measured_at: not a timestamp")
        servers = raw.get("servers", [])
        if not isinstance(servers, list) or not all(isinstance(s, str) for s in servers):
            raise CalibrationError(f"{where}.servers: not a list of URLs")
        samples = raw.get("samples", [])
        if not isinstance(samples, list):
            raise CalibrationError(f"{where}.samples: not a list")

        def fig(name: str) -> Figure | None:
            v = raw.get(name)
            return None if v is None else Figure.from_json(v, f"{where}.{name}")

        util = raw.get("gpu_memory_utilization")
        if util is not None and not is_num(util):
            raise CalibrationError(f"{where}.gpu_memory_utilization: not a number")
        step = raw.get("step")
        model = None
        if step is not None:
            if not isinstance(step, dict):
                raise CalibrationError(f"{where}.step: not an object")
            per = step.get("per_seq_s")
            if per is not None and not is_num(per):
                raise CalibrationError(f"{where}.step.per_seq_s: not a number")
            prompt = step.get("per_prefill_token_s")
            if prompt is not None and not is_num(prompt):
                raise CalibrationError(f"{where}.step.per_prefill_token_s: not a number")
            model = StepModel(
                num(step, "fixed_s", f"{where}.step"),
                None if per is None else float(per),
                num(step, "batch_lo", f"{where}.step"),
                num(step, "batch_hi", f"{where}.step"),
                None if prompt is None else float(prompt),
            )
        return cls(
            key,
            at,
            tuple(servers),
            fig("kv_tokens"),
            model,
            fig("step_at_batch_s"),
            fig("prefill_tok_s"),
            fig("ttft_s"),
            tuple(Sample.from_json(s, f"{where}.samples[{i}]") for i, s in enumerate(samples)),
            util,
        )


@dataclass(frozen=True)
class Calibration:
    entries: tuple[Entry, ...] = field(default_factory=tuple)
    # How long servers took to start, as apply timed them (warm-up; fleetctl/apply/warmup.py).
    startups: tuple[Startup, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "entries": [e.to_json() for e in sorted(self.entries, key=lambda e: e.key)],
            "startups": [s.to_json() for s in sorted(self.startups, key=lambda s: s.key)],
        }

    @classmethod
    def from_json(cls, raw: object) -> Calibration:
        """A calibration from a parsed document; CalibrationError names the field that is wrong."""
        if not isinstance(raw, dict):
            raise CalibrationError("not a JSON object")
        fmt = raw.get("format")
        if fmt != CALIBRATION_FORMAT:
            newer = isinstance(fmt, int) and fmt > CALIBRATION_FORMAT
            raise CalibrationError(
                f"format {fmt!r} was written by a {'newer' if newer else 'different'} fleetctl "
                f"(this one reads {CALIBRATION_FORMAT})"
            )
        entries = raw.get("entries")
        if not isinstance(entries, list):
            raise CalibrationError("no 'entries' list")
        # Absent from files written before apply timed start-ups.
        startups = raw.get("startups", [])
        if not isinstance(startups, list):
            raise CalibrationError("'startups' is not a list")
        return cls(
            tuple(Entry.from_json(e, f"entries[{i}]") for i, e in enumerate(entries)),
            tuple(Startup.from_json(s, f"startups[{i}]") for i, s in enumerate(startups)),
        )

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
    fresh = Startup(key, measured_at, times, tuple((phases or {}).items()), servers)
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
