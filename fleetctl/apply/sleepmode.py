"""vLLM's sleep-mode dev endpoints on a server, for apply and the autopilot: `POST /sleep`,
`POST /wake_up`, `GET /is_sleeping` (served with VLLM_SERVER_DEV_MODE=1). Each call is bounded
and fails with `SleepModeError`, one line saying why."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from fleetctl.base.names import http_url
from fleetctl.daemon.dcgm import DCGM_FB_FREE, parse_dcgm
from fleetctl.fleet import http
from fleetctl.fleet.plan import Deployment

TIMEOUT_S = 10.0
# A wake reads the weights back (level 1 over PCIe, level 2 from disk): seconds to minutes.
WAKE_TIMEOUT_S = 600.0
MIB = 2**20
GIB = 2**30
# What a sleeping vLLM server keeps on each GPU (its CUDA context and allocator's slack): a
# wake takes back its share of the GPU less this.
ASLEEP_BYTES = GIB


class SleepModeError(Exception):
    """A server did not do what was asked; the text is one line."""


def _post(url: str, timeout: float) -> dict[str, object]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read(1 << 20)
    except urllib.error.HTTPError as e:
        text = e.read(4096).decode("utf-8", "replace")
        raise SleepModeError(f"HTTP {e.code}: {_message(text)}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SleepModeError(str(reason).lower() or type(e).__name__) from None
    try:
        answer = json.loads(body)
    except ValueError:
        raise SleepModeError(f"not JSON: {body[:80]!r}") from None
    return answer if isinstance(answer, dict) else {}


def _message(text: str) -> str:
    """vLLM's error answer's message (`{"error": {"message": ...}}`), else the text."""
    try:
        doc = json.loads(text)
        err = doc.get("error", doc)
        msg = err.get("message") if isinstance(err, dict) else err
        text = str(msg or text)
    except (ValueError, AttributeError):
        pass
    return " ".join(text.split())[:300]


def is_sleeping(d: Deployment) -> bool:
    try:
        reply = http.get(d.url("/is_sleeping"), TIMEOUT_S)
    except http.HttpError as e:
        raise SleepModeError(f"GET /is_sleeping: {e}") from None
    if reply.status != 200:
        raise SleepModeError(
            f"GET /is_sleeping answered {reply.status}: is it started with "
            "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1?"
        )
    try:
        return bool(reply.json()["is_sleeping"])
    except (ValueError, KeyError, TypeError):
        raise SleepModeError(f"GET /is_sleeping: unexpected answer {reply.text[:80]!r}") from None


def sleep(d: Deployment, level: int) -> None:
    try:
        _post(d.url(f"/sleep?level={level}"), TIMEOUT_S)
    except SleepModeError as e:
        raise SleepModeError(f"POST /sleep?level={level}: {e}") from None


def wake(d: Deployment) -> None:
    """Wake `d`; raises SleepModeError where the wake failed (out of memory among them) or the
    server still sleeps after it."""
    try:
        answer = _post(d.url("/wake_up"), WAKE_TIMEOUT_S)
    except SleepModeError as e:
        raise SleepModeError(f"POST /wake_up: {e}") from None
    if answer.get("status") == "sleeping" or is_sleeping(d):
        raise SleepModeError("POST /wake_up: the server still sleeps after it")


def wake_bytes(d: Deployment, gpu_memory_bytes: int) -> int:
    """What a wake of `d` takes on each of its GPUs: its share of the GPU, less what it kept
    asleep."""
    return max(0, int(d.server.gpu_memory_utilization * gpu_memory_bytes) - ASLEEP_BYTES)


def check_room(d: Deployment, dcgm_port: int, need: int) -> str:
    """Raise SleepModeError where the node's dcgm-exporter says one of `d`'s GPUs has less
    than `need` bytes free (the wake would fail out of memory, and a failed wake can leave
    the server half awake); "" where each has room, a note where the exporter cannot say."""
    try:
        reply = http.get(http_url(d.host, dcgm_port, "/metrics"), TIMEOUT_S)
    except http.HttpError as e:
        return f" (free GPU memory unchecked: dcgm-exporter: {e})"
    free = parse_dcgm(reply.text, DCGM_FB_FREE) if reply.status == 200 else {}
    if not all(g in free for g in d.gpu_indices):
        return " (free GPU memory unchecked: dcgm-exporter lists no DCGM_FI_DEV_FB_FREE for it)"
    for g in d.gpu_indices:
        have = free[g] * MIB
        if have < need:
            raise SleepModeError(
                f"not woken: GPU {g} of {d.node} has {have / GIB:.1f} GiB free and its wake "
                f"needs {need / GIB:.1f} GiB (another process holds the memory; vLLM's wake "
                "would fail out of memory)"
            )
    return ""
