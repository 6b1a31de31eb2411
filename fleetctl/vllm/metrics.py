"""One vLLM /metrics page, read once: the gauges routing needs and the counters calibration fits."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

# sample name -> field of Scrape. Values add up over label sets (engines of a data-parallel
# server, finished_reason, ...), except the KV usage: a fraction, the fullest engine's. vLLM
# renamed gpu_cache_usage_perc to kv_cache_usage_perc; servers of both eras exist.
_SERIES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:estimated_read_bytes_per_gpu_total": "read_bytes",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:iteration_tokens_total_sum": "step_tokens",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prompt_tokens_cached_total": "prompt_cached",
    "vllm:request_prefill_time_seconds_sum": "prefill_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_count",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_kv_tokens",
    "vllm:request_prompt_tokens_sum": "prompt_sum",
    "vllm:request_prompt_tokens_count": "prompt_count",
    "vllm:request_generation_tokens_sum": "generation_sum",
    "vllm:request_generation_tokens_count": "generation_count",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
}
_CACHE_INFO = "vllm:cache_config_info"
# vLLM's sleep mode state, one sample per `sleep_state` label (vllm/v1/metrics/loggers.py,
# record_sleep_state): "awake" 1 while it serves, else "weights_offloaded" 1 at level 1 or
# "discard_all" 1 at level 2 (neither: level 0, the scheduler paused).
_SLEEP_STATE = "vllm:engine_sleep_state"
_SLEEP_LEVELS = {"weights_offloaded": 1, "discard_all": 2}
# Sleep-mode operations under way (vllm/entrypoints/serve/dev/sleep/metrics.py), by
# `operation`: "wake" above 0 while a /wake_up is awaited. vLLM creates it at the first one.
_IN_FLIGHT = "vllm:sleep_mode_operations_in_flight"


def _families(name: str) -> set[str]:
    """The names a `# TYPE` line may give the family of sample `name`: a counter's with or
    without `_total` (client libraries differ), a histogram's without `_sum` or `_count`."""
    return {
        name[: len(name) - len(suffix)]
        for suffix in ("", "_total", "_sum", "_count")
        if name.endswith(suffix)
    }


def _by_family() -> dict[str, list[str]]:
    """family -> the wanted samples that may follow its TYPE line."""
    out: dict[str, list[str]] = {
        _CACHE_INFO: [_CACHE_INFO],
        _SLEEP_STATE: [_SLEEP_STATE],
        _IN_FLIGHT: [_IN_FLIGHT],
    }
    for name in _SERIES:
        for family in _families(name):
            out.setdefault(family, []).append(name)
    return out


_BY_FAMILY = _by_family()
_ALL = [*_SERIES, _CACHE_INFO, _SLEEP_STATE, _IN_FLIGHT]
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Scrape:
    """What one /metrics page says; None where the server did not report it."""

    kv_tokens: int | None = None  # num_gpu_blocks x block_size, over the engines
    block_size: int | None = None  # tokens per KV block (16 on GPUs, 128 on vLLM's CPU backend)
    gpu_memory_utilization: float | None = None  # what the KV cache was sized at
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction of KV blocks in use, the fullest engine's
    read_bytes: float | None = None  # estimated HBM bytes read per GPU, a counter
    preemptions: float | None = None
    generation_tokens: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    steps: float | None = None  # engine steps (vllm:iteration_tokens_total's count)
    step_tokens: float | None = None  # tokens those steps computed (decodes and prefill chunks)
    prompt_tokens: float | None = None  # prompt tokens prefilled, counted as they are
    prompt_cached: float | None = None  # of those, found in the prefix cache (not computed)
    prefill_sum: float | None = None
    prefill_count: float | None = None
    prefill_kv_tokens: float | None = None  # prompt tokens computed, not taken from the cache
    prompt_sum: float | None = None
    prompt_count: float | None = None
    generation_sum: float | None = None
    generation_count: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    at: float | None = None  # when it was read (monotonic seconds), set by the reader
    # Whether its engine sleeps (vllm:engine_sleep_state; None: not reported) and at which
    # level (1 or 2; 0: paused only). Any engine asleep counts: it cannot take a request.
    sleeping: bool | None = None
    sleep_level: int | None = None
    waking: bool | None = None  # a /wake_up under way (None: not reported)

    @property
    def is_vllm(self) -> bool:
        return self.kv_tokens is not None or self.itl_count is not None


assert set(_SERIES.values()) <= {f.name for f in fields(Scrape)}


def parse_metrics(text: str) -> Scrape:
    """The series above from one vLLM /metrics page (Prometheus text format), in one pass.

    It hops from one `# TYPE` line to the next and reads only the families it wants: vLLM's
    page is ~50 KB, mostly histograms, and a router scrapes a hundred backends 4 times a second.
    A family's samples follow its TYPE line, as the text exposition format requires.
    """
    values: dict[str, float] = {}
    kv: int | None = None
    util: float | None = None
    size: int | None = None
    sleeping: bool | None = None
    level = 0
    waking: bool | None = None
    for block, names in _wanted_blocks(text):
        for name in names:
            for line in _samples(block, name):
                if name == _IN_FLIGHT:
                    if dict(_LABEL.findall(line)).get("operation") == "wake":
                        count = _float(line.rsplit(" ", 1)[-1])
                        waking = (waking or False) or (count is not None and count > 0)
                    continue
                if name == _SLEEP_STATE:
                    state = dict(_LABEL.findall(line)).get("sleep_state", "")
                    on = _float(line.rsplit(" ", 1)[-1]) == 1.0
                    if state == "awake":
                        sleeping = (sleeping or False) or not on
                    elif on and state in _SLEEP_LEVELS:
                        sleeping, level = True, max(level, _SLEEP_LEVELS[state])
                    continue
                if name == _CACHE_INFO:
                    labels = dict(_LABEL.findall(line))
                    raw = labels.get("block_size", "")
                    if raw.isdigit() and 0 < int(raw) < 10_000_000:
                        size = int(raw)
                    try:
                        tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
                    except (KeyError, ValueError):
                        continue
                    kv = tokens + (kv or 0)
                    util = _float(labels.get("gpu_memory_utilization"))
                    continue
                try:
                    value = float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    continue
                if not math.isfinite(value):
                    continue
                field = _SERIES[name]
                old = values.get(field)
                if old is None:
                    values[field] = value
                elif field == "kv_usage":
                    values[field] = max(old, value)
                else:
                    values[field] = old + value
    return Scrape(
        kv_tokens=kv,
        gpu_memory_utilization=util,
        block_size=size,
        sleeping=sleeping,
        sleep_level=None if sleeping is None else level,
        waking=waking,
        **values,
    )


def _wanted_blocks(text: str) -> list[tuple[str, list[str]]]:
    """Each wanted family's text (from its `# TYPE` line to the next one) with the samples to
    look for in it. A page with no TYPE lines at all (a hand-written one) is one block."""
    at = text.find("# TYPE ")
    if at < 0:
        return [(text, _ALL)]
    blocks = []
    while at >= 0:
        name_start = at + 7
        name_end = text.find(" ", name_start)
        block_start = text.find("\n", name_end) + 1
        if not block_start:  # the page ends on this TYPE line: no samples follow it
            break  # (searching on from 0 would find this line again, for ever)
        nxt = text.find("# TYPE ", block_start)
        names = _BY_FAMILY.get(text[name_start:name_end])
        if names:
            blocks.append((text[block_start : nxt if nxt >= 0 else len(text)], names))
        at = nxt
    return blocks


def _samples(block: str, name: str) -> list[str]:
    """The lines of `block` that are samples of `name` (found by search: a histogram's bucket
    lines, most of the page, are never split out)."""
    out = []
    at = block.find(name)
    while at >= 0:
        end = at + len(name)
        if (at == 0 or block[at - 1] == "\n") and block[end : end + 1] in ("{", " "):
            stop = block.find("\n", end)
            out.append(block[at : stop if stop >= 0 else len(block)])
        at = block.find(name, end)
    return out


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None
