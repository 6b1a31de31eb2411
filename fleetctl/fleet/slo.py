"""Each model's SLO: the one its inventory states, else a default derived from its servers.

A fleet with no stated objective still needs one: hardware-aware weighs TTFT and TPOT against
their objectives, and a capacity is a goodput rate, which only an SLO defines. The default is
read off the one performance model (the engines passed in are the calibrated ones where a
calibration exists), on the slowest class that serves the model, so it is reachable on every
class and binds only under load. The planner derives it once, before placement, from every
candidate server that can hold the model (planner/candidates.py) and the traffic planned
for, and that is the model's SLO from then on: the plan prints and records it (`Plan.slos`;
`slo` in `plan --json` and `plan -o`), `apply` keeps it in state.json, and route-serve and
simulate judge by the recorded one. Re-deriving it from the servers placed gives a tighter
one wherever the slowest candidate is left out, and planning by that a tighter one again (a
large mixed fleet's 8B: TPOT 170 ms planned, 22 ms printed). Only where no plan recorded one
(route-serve given --backends, a fleet not applied) is it derived from the servers and the
traffic at hand, by the same rule:

- TTFT objective = TTFT_FACTOR x the slowest class's idle prefill of a long prompt: the
  workload's `prompt_tokens_p99` where it states one, else LONG_PROMPT_FACTOR x its mean
  prompt (a workload may give only means), capped at what the class's max_model_len takes;
- TPOT objective = TPOT_FACTOR x the slowest class's idle decode step at MODERATE_BATCH
  sequences of the mean request's context.

On the seed's fleet (A100 + RTX 4090, Llama-3 8B BF16, 1,500-token prompts, 300-token
outputs) that is TTFT <= 2.4 s and TPOT <= 52 ms, where peers' benchmarks of 8B chat models
use 2 s and 50-60 ms (docs/concepts/cost-and-slos.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from fleetctl.base.limits import MAX_TIMEOUT_S
from fleetctl.fleet.inventory import Model, SloSpec
from fleetctl.model.perf import EnginePerf

# The Azure 2023 traces' p99 prompt is 3.6x their mean (conversation 4,142 / 1,155 tokens,
# code 7,436 / 2,048): 4x the mean stands for the long prompts the TTFT tail is made of.
LONG_PROMPT_FACTOR = 4.0
# Twice the idle figure: an idle server meets it with room for about one prompt queued ahead
# (or a decode step stretched by prefill chunks to twice its length), and a loaded one misses
# it. On the seed fleet and the Azure conversation trace's first 4,000 requests: by 1.5x
# (1.8 s, 39 ms) round-robin missed the 99% at 30% load already (97.4%, its RTX 4090s' TPOT
# p99 45 ms); by 3x (3.5 s, 77 ms) it still met it at 50% (99.1%), so the SLO no longer
# told routing apart; by 2x it serves 99.6% at 30% and 91.9% at 50%, hardware-aware 99.9%.
TTFT_FACTOR = 2.0
TPOT_FACTOR = 2.0
# vLLM serves tens of sequences at once at moderate load; 16 is where an 8B model's step on
# an RTX 4090 is still bandwidth-bound (weights dominate: 25 ms against 21 ms alone).
MODERATE_BATCH = 16
# The request the planner assumes where a model states no workload (planner/candidates.py).
DEFAULT_PROMPT, DEFAULT_OUTPUT = 1000, 200
# `ttft_p99_s` and `tpot_p99_ms` name 99th percentiles: 99% of requests within both.
DEFAULT_SHARE = 0.99


@dataclass(frozen=True, slots=True)
class Slo:
    """A model's objectives in seconds (None: none on that figure), the share of requests
    that must meet both, and whether the inventory stated them or they were derived
    (`basis` says from what). Hardware-aware routes by them, the simulator counts who met
    them, and a capacity is the rate at which `share` of the requests do."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    share: float = DEFAULT_SHARE
    derived: bool = False
    basis: str = ""
    # Where a command read it back from, not derived itself: "the applied plan (state
    # serial 3)"; "" where it is the inventory's or derived on the spot.
    recorded: str = ""

    @classmethod
    def of(cls, spec: SloSpec | None) -> Slo | None:
        """The inventory's `slo` of a model (p99 TTFT in s, TPOT in ms); None: none."""
        if spec is None or (spec.ttft_p99_s is None and spec.tpot_p99_ms is None):
            return None
        tpot = None if spec.tpot_p99_ms is None else spec.tpot_p99_ms / 1000
        return cls(spec.ttft_p99_s, tpot, spec.share)

    @property
    def source(self) -> str:
        return "derived" if self.derived else "stated"

    @property
    def origin(self) -> str:
        """`stated` (the inventory's), `planned` (derived by the plan that a plan file or
        state.json recorded) or `derived` (here, from the servers and traffic at hand)."""
        return "planned" if self.recorded and self.derived else self.source

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """Whether a request with this TTFT and TPOT (None: one output token, no TPOT) met
        both objectives; an objective left out is met."""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s

    def text(self) -> str:
        """`TTFT <= 2 s and TPOT <= 50 ms`."""
        parts = []
        if self.ttft_s is not None:
            parts.append(f"TTFT <= {self.ttft_s:g} s")
        if self.tpot_s is not None:
            parts.append(f"TPOT <= {self.tpot_s * 1000:g} ms")
        return " and ".join(parts) or "no objective"

    def describe(self) -> str:
        """`99% within TTFT <= 2.4 s and TPOT <= 52 ms (derived)`, and where it was read
        from where a plan recorded it."""
        where = f", as {self.recorded} records it" if self.recorded else ""
        return f"{self.share * 100:.4g}% within {self.text()} ({self.source}{where})"

    def record(self) -> SloRecord:
        """The form a plan file and state.json keep it in (`to_json`'s keys)."""
        tpot = None if self.tpot_s is None else round(self.tpot_s * 1000, 6)
        source: Literal["stated", "derived"] = "derived" if self.derived else "stated"
        return SloRecord(self.ttft_s, tpot, self.share, source, self.basis or None)

    @classmethod
    def of_record(cls, r: SloRecord, recorded: str) -> Slo:
        """The SLO a plan file or state.json recorded; `recorded` says which."""
        tpot = None if r.tpot_p99_ms is None else r.tpot_p99_ms / 1000
        return cls(r.ttft_p99_s, tpot, r.share, r.source == "derived", r.basis or "", recorded)

    def to_json(self) -> dict[str, object]:
        r = self.record()
        return {
            "ttft_p99_s": r.ttft_p99_s,
            "tpot_p99_ms": r.tpot_p99_ms,
            "share": r.share,
            "source": r.source,
            "basis": r.basis,
        }


_Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]


@dataclass(frozen=True)
class SloRecord:
    """A model's SLO as a plan file and state.json hold it (`plan --json`'s `slo` keys)."""

    ttft_p99_s: _Seconds | None = None
    tpot_p99_ms: Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S * 1000)] | None = None
    share: Annotated[float, Field(gt=0, le=1)] = DEFAULT_SHARE
    source: Literal["stated", "derived"] = "derived"
    basis: Annotated[str, Field(max_length=1000)] | None = None


def recorded_slos(records: Mapping[str, SloRecord], where: str) -> dict[str, Slo]:
    """Each model's SLO as `where` (a plan file, state.json) recorded it."""
    return {name: Slo.of_record(r, where) for name, r in records.items()}


def planned_unless_stated(models: Iterable[Model], recorded: Mapping[str, Slo]) -> dict[str, Slo]:
    """The recorded SLO of each model whose inventory states none: a stated one wins, even
    over what an older plan recorded, and the rest keep the one they were planned by."""
    return {
        m.name: recorded[m.name]
        for m in models
        if m.name in recorded and Slo.of(m.spec.slo) is None
    }


def derive(
    model: Model,
    engines: Iterable[tuple[EnginePerf, int]],
    mean_prompt: int | None = None,
    mean_output: int | None = None,
) -> Slo | None:
    """The default SLO of `model` on the engines (perf, max_model_len; 0: the model's
    max_context) that serve it, for requests of these mean lengths (None: the model's
    workload, as the planner reads it, its p99 prompt the long one where stated). None
    where no engine serves it. A stated `share` without objectives is kept."""
    w = model.spec.workload
    # The workload's own p99 prompt is the long one; a mean passed in (route-serve's
    # observed traffic) comes without its quantiles, so 4x it stands in.
    p99 = w.prompt_tokens_p99 if w is not None and mean_prompt is None else None
    prompt = mean_prompt or (
        w.mean_prompt_tokens if w else min(DEFAULT_PROMPT, model.spec.max_context // 2)
    )
    output = mean_output or (w.mean_output_tokens if w else DEFAULT_OUTPUT)
    ttft = tpot = 0.0
    ttft_on = tpot_on = ""
    seen = False
    for perf, max_len in engines:
        seen = True
        limit = max_len or model.spec.max_context
        long = max(1, min(p99 or round(LONG_PROMPT_FACTOR * prompt), limit - output))
        t = perf.prefill_time(long)
        if t > ttft:
            ttft, ttft_on = t, f"{perf.gpu.name}'s idle prefill of {long:,} tokens"
        context = prompt + output / 2
        s = perf.step_time(MODERATE_BATCH, MODERATE_BATCH * context)
        if s > tpot:
            tpot, tpot_on = s, f"{perf.gpu.name}'s decode step at batch {MODERATE_BATCH}"
    if not seen:
        return None
    spec = model.spec.slo
    share = spec.share if spec is not None else DEFAULT_SHARE
    return Slo(
        _up(TTFT_FACTOR * ttft),
        _up(TPOT_FACTOR * tpot),
        share,
        derived=True,
        basis=f"{TTFT_FACTOR:g} x {ttft_on}; {TPOT_FACTOR:g} x {tpot_on}",
    )


def _up(seconds: float) -> float:
    """Rounded up to two significant figures: a printable objective, never tighter."""
    if seconds <= 0:
        return seconds
    scale = 10 ** (math.floor(math.log10(seconds)) - 1)
    return round(math.ceil(round(seconds / scale, 9)) * scale, 12)


def objectives(
    model: Model,
    engines: Iterable[tuple[EnginePerf, int]],
    mean_prompt: int | None = None,
    mean_output: int | None = None,
) -> Slo | None:
    """The model's stated SLO, else the one derived from its engines."""
    return Slo.of(model.spec.slo) or derive(model, engines, mean_prompt, mean_output)
