"""Simulator workloads: real request traces (Azure LLM inference CSVs) and synthetic ones."""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TextIO, TypeVar

from fleetctl.base.errors import Location, UserError
from fleetctl.base.limits import MAX_RATE
from fleetctl.fleet.inventory import BucketSpec, WorkloadSpec
from fleetctl.routing.prefix import PromptBlocks, chain

PROGRESS_ROWS = 4096  # rows between progress reports


@dataclass(frozen=True, slots=True)
class WorkItem:
    id: int
    arrival: float  # seconds from the start
    prompt: int
    output: int  # tokens the model will really generate
    model: str
    priority: int = 0
    session: str | None = None
    precision: str | None = None
    strict: bool = False
    max_tokens: int | None = None  # what the client asked for; None: the router estimates
    blocks: PromptBlocks | None = None  # the prompt's chained block hashes, when the trace has them
    adapter: str | None = None  # the LoRA adapter of `model` it names (a trace row's "adapter")


# The Mooncake trace names each 512-token block of a prompt (FAST'25 release, README).
MOONCAKE_BLOCK_TOKENS = 512


def load_trace(
    path: Path,
    model: str,
    limit: int | None = None,
    progress: Callable[[float], None] | None = None,
    window: tuple[float, float] | None = None,
) -> list[WorkItem]:
    """A request trace, its format told by the first character of each file:
    - Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`);
    - Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`);
    - route-serve's request log: the same JSONL with more fields (model, session, priority,
      precision, max_tokens, block_tokens), one file or a folder of them; a row's `adapter`
      names the LoRA adapter of its model it asks for.

    Rows of another model than `model` (where a row names one) are left out. `window`
    (start, end): only the requests arriving in [start, end) seconds from the trace's start,
    shifted to start at 0. `limit`: the first N requests. `progress`, if given, hears the
    characters read so far every few thousand rows.
    """
    files = trace_files(path)
    read = 0
    items: list[WorkItem] = []
    cut = limit if window is None and len(files) == 1 else None
    for f in files:
        try:
            handle = f.open(newline="", encoding="utf-8")
        except OSError as e:
            raise UserError(
                f"cannot read trace: {e.strerror}", Location(str(f)), "check the path"
            ) from None

        def lines(handle: TextIO = handle) -> Iterator[str]:
            nonlocal read
            for line in handle:
                read += len(line)
                yield line

        with handle:
            first = handle.read(1)
            handle.seek(0)
            if first == "{":
                rows = _read_jsonl(f, lines(), model, cut, progress, lambda: read)
            elif len(files) > 1:
                continue  # a folder holds request logs; anything else in it is not a trace
            else:
                rows = _read_csv(f, lines(), model, cut, progress, lambda: read)
        items.extend(rows)
    items.sort(key=lambda w: w.arrival)  # stable: ties keep the files' order
    if items:
        start = items[0].arrival + (window[0] if window else 0.0)
        end = items[0].arrival + window[1] if window else math.inf
        items = [replace(w, arrival=w.arrival - start) for w in items if start <= w.arrival < end]
    if limit:
        items = items[:limit]
    return [replace(w, id=i) if w.id != i else w for i, w in enumerate(items)]


def trace_files(path: Path) -> list[Path]:
    """The files of a trace: the path itself, or a folder's request logs in name order (one
    per day, rotated by size: names sort in time order)."""
    if not path.is_dir():
        return [path]
    found = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
    if not found:
        raise UserError(
            "no request log (*.jsonl) in the folder",
            Location(str(path)),
            "point --trace at a trace file or at route-serve's requests folder",
        )
    return found


def _read_jsonl(
    path: Path,
    lines: Iterator[str],
    model: str,
    limit: int | None,
    progress: Callable[[float], None] | None,
    read: Callable[[], int],
) -> list[WorkItem]:
    """Mooncake rows, or route-serve's request log. Each prompt's `hash_ids` become chained
    hashes of `block_tokens`-token blocks (512 in Mooncake's trace), so two prompts share a
    leading run of hashes exactly when the trace says they share that prefix. Mooncake's
    output length is what the client asks for as max_tokens (as `vllm bench serve` sends
    it); the log says what the client asked for."""
    items: list[WorkItem] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item = trace_row(row, model)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(
                f"bad trace row {line.strip()[:80]!r}",
                Location(str(path), line_no),
                "expected JSON with integer timestamp (ms), input_length, output_length "
                "and a list of integer hash_ids",
            ) from None
        if item is not None:
            items.append(replace(item, id=len(items)))
        if limit and len(items) >= limit:
            break
        if progress is not None and line_no % PROGRESS_ROWS == 0:
            progress(read())
    return items


def trace_row(row: dict[str, object], model: str) -> WorkItem | None:
    """One JSONL row as a request of `model`; None for a row of another model."""
    named = row.get("model")
    if named is not None and named != model:
        return None
    ms, prompt, output = (
        _int(row, "timestamp"),
        _int(row, "input_length"),
        _int(row, "output_length"),
    )
    ids = row.get("hash_ids") or []
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise TypeError
    block_tokens = _int(row, "block_tokens", MOONCAKE_BLOCK_TOKENS)
    if block_tokens <= 0:
        raise ValueError
    max_tokens = row.get("max_tokens", output)
    if max_tokens is not None and not _is_int(max_tokens):
        raise TypeError
    session, precision = _text(row, "session"), _text(row, "precision")
    adapter = _text(row, "adapter")
    prompt, output = max(1, prompt), max(1, output)
    return WorkItem(
        0,
        ms / 1000,
        prompt,
        output,
        model,
        max(0, _int(row, "priority", 0)),
        session,
        precision,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        blocks=PromptBlocks(chain(ids), block_tokens, prompt) if ids else None,
        adapter=adapter or None,
    )


def _int(row: dict[str, object], key: str, default: int | None = None) -> int:
    v = row.get(key, default) if default is not None else row[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError
    return v


def _text(row: dict[str, object], key: str) -> str | None:
    v = row.get(key)
    if v is not None and not isinstance(v, str):
        raise TypeError
    return v


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_csv(
    path: Path,
    lines: Iterator[str],
    model: str,
    limit: int | None,
    progress: Callable[[float], None] | None,
    read: Callable[[], int],
) -> list[WorkItem]:
    items: list[WorkItem] = []
    reader = csv.reader(lines)
    header = next(reader, None)
    want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    if header is None or [h.strip() for h in header[:3]] != want:
        raise UserError(
            f"trace header is {header!r}",
            Location(str(path), 1),
            "expected TIMESTAMP,ContextTokens,GeneratedTokens",
        )
    start: datetime | None = None
    for line, row in enumerate(reader, start=2):
        try:
            ts = datetime.fromisoformat(row[0].strip()[:26])
            prompt, output = int(row[1]), int(row[2])
        except (ValueError, IndexError):
            raise UserError(
                f"bad trace row {row!r}", Location(str(path), line), "fix or remove the row"
            ) from None
        start = start or ts
        items.append(
            WorkItem(
                len(items), (ts - start).total_seconds(), max(1, prompt), max(1, output), model
            )
        )
        if limit and len(items) >= limit:
            break
        if progress is not None and line % PROGRESS_ROWS == 0:
            progress(read())
    return items


def scale_time(items: list[WorkItem], factor: float) -> list[WorkItem]:
    """Arrivals `factor` times denser (factor > 1 raises the load)."""
    return [replace(w, arrival=w.arrival / factor) for w in items]


@dataclass
class Synthetic:
    """A synthetic workload: `key=value,...` on the command line (see `parse_spec`)."""

    model: str = ""
    rate: float = 10.0  # requests/s
    duration: float = 600.0  # seconds
    prompt: int = 1000  # mean prompt tokens
    output: int = 200  # mean output tokens
    lengths: str = "lognormal"  # lognormal | exp | fixed
    long_share: float = 0.0  # share of requests drawn from the long mode
    long_prompt: int = 6000  # mean prompt tokens of the long mode
    max_context: int = 0  # cap prompt + output (0: no cap)
    arrivals: str = "poisson"  # poisson | bursty
    burst: float = 4.0  # bursty: rate multiplier during bursts (a quarter of the time)
    sessions: float = 0.0  # share of requests that are turns of multi-turn sessions
    turns: int = 4
    think_s: float = 10.0  # mean seconds between a session's turns
    priorities: str = ""  # e.g. "0:0.7/1:0.3" (class:share)
    precision: str = ""  # e.g. "int4:0.1" (hint:share), add ";strict" for strict hints

    def generate(self, seed: int) -> list[WorkItem]:
        rng = random.Random(seed)
        classes: list[tuple[int, float]] = [(int(k), v) for k, v in _shares(self.priorities)]
        classes = classes or [(0, 1.0)]
        hints = _shares(self.precision.split(";")[0])
        strict = self.precision.endswith(";strict")
        items: list[WorkItem] = []
        t = 0.0
        session_no = 0
        while t < self.duration:
            t += rng.expovariate(self._rate_at(t))
            if t >= self.duration:
                break
            prio = _pick(rng, classes)
            hint = _pick(rng, hints) if hints and rng.random() < sum(s for _, s in hints) else None
            if self.sessions and rng.random() < self.sessions:
                session_no += 1
                at = t
                context = 0
                for _turn in range(self.turns):
                    prompt, output = self._lengths(rng)
                    context += prompt  # each turn resends the conversation so far
                    total = self._cap(context, output)
                    items.append(
                        WorkItem(
                            0,
                            at,
                            total[0],
                            total[1],
                            self.model,
                            prio,
                            f"s{seed}-{session_no}",
                            hint,
                            strict,
                        )
                    )
                    context += output
                    at += rng.expovariate(1 / self.think_s) + 1.0
            else:
                prompt, output = self._cap(*self._lengths(rng))
                items.append(WorkItem(0, t, prompt, output, self.model, prio, None, hint, strict))
        items.sort(key=lambda w: w.arrival)
        return [replace(w, id=i) for i, w in enumerate(items)]

    def _rate_at(self, t: float) -> float:
        if self.arrivals == "bursty":
            # Bursts a quarter of the time at `burst` x the rate; the mean rate is kept.
            quiet = self.rate / (0.75 + 0.25 * self.burst)
            return quiet * self.burst if (t % 60.0) < 15.0 else quiet
        return self.rate

    def _lengths(self, rng: random.Random) -> tuple[int, int]:
        mean_prompt = self.long_prompt if rng.random() < self.long_share else self.prompt
        return _draw(rng, self.lengths, mean_prompt), _draw(rng, self.lengths, self.output)

    def _cap(self, prompt: int, output: int) -> tuple[int, int]:
        if self.max_context and prompt + output > self.max_context:
            output = max(1, min(output, self.max_context // 4))
            prompt = max(1, self.max_context - output)
        return prompt, output


def _draw(rng: random.Random, kind: str, mean: float) -> int:
    if kind == "fixed":
        return max(1, int(mean))
    if kind == "exp":
        return max(1, int(rng.expovariate(1 / mean)))
    sigma = 0.8  # lognormal with this mean: mu = ln(mean) - sigma^2 / 2
    return max(1, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def _shares(text: str) -> list[tuple[str, float]]:
    """`a:0.7/b:0.3` -> [("a", 0.7), ("b", 0.3)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split("/"))):
        key, _, share = part.partition(":")
        out.append((key, float(share or 1.0)))
    return out


T = TypeVar("T")


def _pick(rng: random.Random, options: list[tuple[T, float]]) -> T:
    total = sum(s for _, s in options)
    x = rng.random() * total
    for value, share in options:
        x -= share
        if x <= 0:
            return value
    return options[-1][0]


def parse_spec(spec: str, model: str) -> Synthetic:
    """`rate=20,duration=600,prompt=1500,output=300,long_share=0.2,...` -> Synthetic."""
    w = Synthetic(model=model)
    fields = {f: type(getattr(w, f)) for f in w.__dataclass_fields__ if f != "model"}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise UserError(
                f"bad workload setting {part!r}",
                None,
                f"use key=value with keys: {', '.join(fields)}",
            )
        try:
            setattr(w, key, fields[key](value.strip()))
        except ValueError:
            raise UserError(
                f"bad value for {key}: {value!r}", None, f"expected {fields[key].__name__}"
            ) from None
    return w


# Traffic is summed in windows of this length; the peak rate is a high percentile of them.
RATE_WINDOW_S = 300.0
PEAK_PERCENTILE = 95


@dataclass(frozen=True)
class Derived:
    """One model's workload as its traffic shows it (`plan --workload-from`)."""

    requests: int
    requests_per_s: float  # the PEAK_PERCENTILE-th percentile of RATE_WINDOW_S-second rates
    mean_prompt_tokens: int
    mean_output_tokens: int
    p95_prompt_tokens: int
    long_share: float  # prompt + output over the router's long_context_tokens
    session_share: float  # requests that carry a session
    # The length distribution and the arrivals' burstiness the planner's capacity is judged
    # on (WorkloadSpec's fields of the same names).
    prompt_quantiles: tuple[int, int, int] = (0, 0, 0)  # p50, p90, p99
    max_prompt_tokens: int = 0
    output_quantiles: tuple[int, int, int] = (0, 0, 0)
    burstiness: float = 1.0

    def to_json(self) -> dict[str, object]:
        quantiles = {
            **{
                f"prompt_tokens_p{q}": v
                for q, v in zip(QUANTILES, self.prompt_quantiles, strict=True)
            },
            "max_prompt_tokens": self.max_prompt_tokens,
            **{
                f"output_tokens_p{q}": v
                for q, v in zip(QUANTILES, self.output_quantiles, strict=True)
            },
            "burstiness": round(self.burstiness, 3),
        }
        return {
            "requests": self.requests,
            "requests_per_s": round(self.requests_per_s, 4),
            "mean_prompt_tokens": self.mean_prompt_tokens,
            "mean_output_tokens": self.mean_output_tokens,
            "p95_prompt_tokens": self.p95_prompt_tokens,
            "long_share": round(self.long_share, 4),
            "session_share": round(self.session_share, 4),
            **quantiles,
        }


def derive_workload(items: list[WorkItem], long_tokens: int) -> Derived | None:
    """The workload `items` (one model's, in arrival order) amount to; None for no requests.

    The rate is a peak, not the mean, as the planner sizes for it: the PEAK_PERCENTILE-th
    percentile of the rates over RATE_WINDOW_S-second windows, and at least the mean rate (a
    trace shorter than one window: its own rate; a one-request trace: one request per
    window)."""
    if not items:
        return None
    n = len(items)
    span = items[-1].arrival - items[0].arrival
    if span < RATE_WINDOW_S:
        rate = n / span if span > 0 and n > 1 else 1 / RATE_WINDOW_S
    else:
        counts = [0] * (int(span // RATE_WINDOW_S) + 1)
        for w in items:
            counts[int((w.arrival - items[0].arrival) // RATE_WINDOW_S)] += 1
        rates = [c / RATE_WINDOW_S for c in counts[:-1]]
        # The last window is partial: its own rate counts once it spans a fifth of a window
        # (a burst at the end of a log is traffic too; a few seconds' worth is noise).
        tail = span - (len(counts) - 1) * RATE_WINDOW_S
        if tail >= RATE_WINDOW_S / 5:
            rates.append(counts[-1] / tail)
        ranked = sorted(rates)
        peak = ranked[min(len(ranked) - 1, len(ranked) * PEAK_PERCENTILE // 100)]
        rate = max(peak, (n - 1) / span)  # a peak never below the mean
    prompts = sorted(w.prompt for w in items)
    outputs = sorted(w.output for w in items)
    return Derived(
        n,
        rate,
        round(sum(prompts) / n),
        max(1, round(sum(outputs) / n)),
        prompts[min(n - 1, n * 95 // 100)],
        sum(1 for w in items if w.prompt + w.output > long_tokens) / n,
        sum(1 for w in items if w.session) / n,
        _quantiles(prompts),
        prompts[-1],
        _quantiles([max(1, x) for x in outputs]),
        burstiness([w.arrival for w in items]),
    )


QUANTILES = (50, 90, 99)
# Burstiness counts arrivals in windows that hold this many requests on average (the
# planner's BURST_WINDOW): a span that scales with the rate, so replaying a trace faster or
# slower leaves it unchanged.
BURST_WINDOW = 100


def _quantiles(ordered: list[int]) -> tuple[int, int, int]:
    n = len(ordered)
    p50, p90, p99 = (ordered[min(n - 1, n * q // 100)] for q in QUANTILES)
    return p50, p90, p99


def burstiness(arrivals: list[float]) -> float:
    """Variance over mean of the arrival count in windows holding BURST_WINDOW requests on
    average (1 for Poisson arrivals; Azure's code trace: about 136); 1 where the traffic
    holds fewer than three windows."""
    n = len(arrivals)
    span = arrivals[-1] - arrivals[0] if n else 0.0
    windows = int(n // BURST_WINDOW)
    if span <= 0 or windows < 3:
        return 1.0
    width = span / windows
    counts = [0] * windows
    for t in arrivals:
        counts[min(windows - 1, int((t - arrivals[0]) / width))] += 1
    mean = n / windows
    return sum((c - mean) ** 2 for c in counts) / windows / mean


@dataclass(frozen=True)
class Bucket:
    """A slice of one model's requests by length: their share of all requests, mean
    lengths, the longest (prompt + output), and the prompt and output ranges it spans."""

    share: float
    mean_prompt_tokens: int
    mean_output_tokens: int
    max_tokens: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]


def length_buckets(items: list[WorkItem], n: int) -> list[Bucket]:
    """At most `n` slices of `items` by length, for the cost planner (Melange's request
    sizes): equal-count prompt-length quantiles, each split again at its output-length
    quantiles (n = 2 or 3: prompt only; 4: 2 x 2; 6: 3 x 2). Empty for n < 2 or fewer than
    10 requests a slice: one mean shape is all the traffic shows."""
    if n < 2 or len(items) < 10 * n:
        return []
    by_prompt = n if n < 4 else n // 2
    by_output = n // by_prompt
    total = len(items)
    out = []
    for group in _quantile_groups(sorted(items, key=lambda w: (w.prompt, w.output)), by_prompt):
        for part in _quantile_groups(sorted(group, key=lambda w: (w.output, w.prompt)), by_output):
            prompts = [w.prompt for w in part]
            outputs = [w.output for w in part]
            out.append(
                Bucket(
                    len(part) / total,
                    max(1, round(sum(prompts) / len(part))),
                    max(1, round(sum(outputs) / len(part))),
                    max(w.prompt + w.output for w in part),
                    (min(prompts), max(prompts)),
                    (min(outputs), max(outputs)),
                )
            )
    return out


def _quantile_groups(ordered: list[WorkItem], k: int) -> list[list[WorkItem]]:
    """`ordered` cut into `k` runs of (nearly) equal length."""
    n = len(ordered)
    return [ordered[i * n // k : (i + 1) * n // k] for i in range(k)]


def spec_of(items: list[WorkItem], long_tokens: int, buckets: int) -> WorkloadSpec | None:
    """The workload `items` (one model's, in arrival order) amount to, in the inventory's
    form with at most `buckets` length buckets; None for no requests."""
    derived = derive_workload(items, long_tokens)
    return None if derived is None else workload_spec(derived, length_buckets(items, buckets))


def workload_spec(derived: Derived, buckets: list[Bucket]) -> WorkloadSpec:
    """The inventory's form of a derived workload and its length buckets."""
    return WorkloadSpec(
        requests_per_s=min(MAX_RATE, max(derived.requests_per_s, 1e-6)),
        mean_prompt_tokens=derived.mean_prompt_tokens,
        mean_output_tokens=derived.mean_output_tokens,
        prompt_tokens_p50=derived.prompt_quantiles[0],
        prompt_tokens_p90=derived.prompt_quantiles[1],
        prompt_tokens_p99=derived.prompt_quantiles[2],
        max_prompt_tokens=derived.max_prompt_tokens,
        output_tokens_p50=derived.output_quantiles[0],
        output_tokens_p90=derived.output_quantiles[1],
        output_tokens_p99=derived.output_quantiles[2],
        burstiness=derived.burstiness,
        buckets=tuple(
            BucketSpec(
                share=b.share,
                mean_prompt_tokens=b.mean_prompt_tokens,
                mean_output_tokens=b.mean_output_tokens,
                max_tokens=b.max_tokens,
            )
            for b in buckets
        ),
    )
