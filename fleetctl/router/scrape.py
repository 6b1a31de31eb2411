"""Reading a vLLM server's /metrics (and a node's DCGM exporter): only the few series routing
needs, cheaply."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; servers of both eras exist.
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:estimated_read_bytes_per_gpu_total": "read_bytes",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:generation_tokens_total": "generation_tokens",
}


@dataclass
class VllmMetrics:
    """What one scrape says; None where the server did not report it."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    read_bytes: float | None = None
    preemptions: float | None = None
    generation_tokens: float | None = None
    kv_cache_size_tokens: int | None = None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse Prometheus text, keeping only the series above (combined over label sets).

    It hops from one `# TYPE` line to the next and reads only the families it wants: vLLM's
    page is ~50 KB, mostly histograms, and routing a hundred backends at 4 scrapes a second
    must not need a core for this. Samples of a family follow its TYPE line, as the text
    exposition format requires.
    """
    out = VllmMetrics()
    at = text.find("# TYPE ")
    while at >= 0:
        name_start = at + 7
        name_end = text.find(" ", name_start)
        block_start = text.find("\n", name_end) + 1
        nxt = text.find("# TYPE ", block_start)
        name = text[name_start:name_end]
        if block_start and (name in _GAUGES or name == "vllm:cache_config_info"):
            block = text[block_start : nxt if nxt >= 0 else len(text)]
            for line in block.splitlines():
                if line.startswith("#") or not line.startswith(name):
                    continue
                if name == "vllm:cache_config_info":
                    out.kv_cache_size_tokens = _label_int(line, "kv_cache_size_tokens")
                else:
                    _add(out, _GAUGES[name], line)
        at = nxt
    return out


def _add(out: VllmMetrics, field: str, line: str) -> None:
    try:
        value = float(line.rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return
    old = getattr(out, field)
    if old is None:
        setattr(out, field, value)
    elif field == "kv_usage":  # a usage fraction: the fullest engine
        setattr(out, field, max(old, value))
    else:  # counts add up over engines (data parallel)
        setattr(out, field, old + value)


def _label_int(line: str, label: str) -> int | None:
    key = f'{label}="'
    at = line.find(key)
    if at < 0:
        return None
    start = at + len(key)
    end = line.find('"', start)
    try:
        return int(float(line[start:end]))
    except ValueError:
        return None


DCGM_MEM_COPY = "DCGM_FI_DEV_MEM_COPY_UTIL{"


def parse_dcgm_mem_copy(text: str) -> dict[int, float]:
    """Per GPU index, DCGM's memory-copy utilization in percent (the share of the sample
    period the device memory was being read or written), from a dcgm-exporter page. Lines
    without a `gpu` label (MIG-only views, other families) are skipped."""
    out: dict[int, float] = {}
    at = text.find(DCGM_MEM_COPY)
    while at >= 0:
        end = text.find("\n", at)
        line = text[at : end if end >= 0 else len(text)]
        gpu = _gpu_label(line)
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            value = None
        if gpu is not None and value is not None:
            out[gpu] = value
        at = text.find(DCGM_MEM_COPY, at + len(DCGM_MEM_COPY))
    return out


def _gpu_label(line: str) -> int | None:
    """The `gpu` label's index (not a longer label name ending in `gpu`)."""
    for key in ('{gpu="', ',gpu="'):
        at = line.find(key)
        if at >= 0:
            start = at + len(key)
            value = line[start : line.find('"', start)]
            return int(value) if value.isdigit() else None
    return None
