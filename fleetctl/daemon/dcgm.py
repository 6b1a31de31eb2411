"""A node's DCGM exporter page: the memory-copy utilization routing reads (a vLLM server's own
/metrics page is fleetctl/vllm/metrics.py's)."""

from __future__ import annotations

DCGM_MEM_COPY = "DCGM_FI_DEV_MEM_COPY_UTIL{"
DCGM_FB_FREE = "DCGM_FI_DEV_FB_FREE{"  # MiB of the GPU's memory free


def parse_dcgm_mem_copy(text: str) -> dict[int, float]:
    """Per GPU index, DCGM's memory-copy utilization in percent (the share of the sample
    period the device memory was being read or written), from a dcgm-exporter page. Lines
    without a `gpu` label (MIG-only views, other families) are skipped."""
    return parse_dcgm(text, DCGM_MEM_COPY)


def parse_dcgm(text: str, family: str) -> dict[int, float]:
    """Per GPU index, the value of a dcgm-exporter family (`family` with its opening brace)."""
    out: dict[int, float] = {}
    at = text.find(family)
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
        at = text.find(family, at + len(family))
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
