"""The live autopilot's HTTP: vLLM's sleep-mode dev endpoints on a server (`POST /sleep`,
`POST /wake_up`, `GET /is_sleeping`, served with VLLM_SERVER_DEV_MODE=1) and route-serve's
/metrics, for what it still has in flight at a server. Each call is bounded and fails with
`EdgeError`, one line saying why."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from fleetctl.fleet import http
from fleetctl.fleet.plan import Deployment

TIMEOUT_S = 10.0
# A wake reads the weights back (level 1 over PCIe, level 2 from disk): seconds to minutes.
WAKE_TIMEOUT_S = 600.0
OUTSTANDING = re.compile(r'^fleetctl_backend_outstanding_requests\{backend="([^"]*)"\}\s+(\S+)$')


class EdgeError(Exception):
    """A server or route-serve did not do what was asked; the text is one line."""


def _post(url: str, timeout: float) -> dict[str, object]:
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read(1 << 20)
    except urllib.error.HTTPError as e:
        text = e.read(4096).decode("utf-8", "replace")
        raise EdgeError(f"HTTP {e.code}: {_message(text)}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise EdgeError(str(reason).lower() or type(e).__name__) from None
    try:
        answer = json.loads(body)
    except ValueError:
        raise EdgeError(f"not JSON: {body[:80]!r}") from None
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
        raise EdgeError(f"GET /is_sleeping: {e}") from None
    if reply.status != 200:
        raise EdgeError(
            f"GET /is_sleeping answered {reply.status}: is it started with "
            "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1?"
        )
    try:
        return bool(reply.json()["is_sleeping"])
    except (ValueError, KeyError, TypeError):
        raise EdgeError(f"GET /is_sleeping: unexpected answer {reply.text[:80]!r}") from None


def sleep(d: Deployment, level: int) -> None:
    try:
        _post(d.url(f"/sleep?level={level}"), TIMEOUT_S)
    except EdgeError as e:
        raise EdgeError(f"POST /sleep?level={level}: {e}") from None


def wake(d: Deployment) -> None:
    """Wake `d`; raises EdgeError where the wake failed (out of memory among them) or the
    server still sleeps after it."""
    try:
        answer = _post(d.url("/wake_up"), WAKE_TIMEOUT_S)
    except EdgeError as e:
        raise EdgeError(f"POST /wake_up: {e}") from None
    if answer.get("status") == "sleeping" or is_sleeping(d):
        raise EdgeError("POST /wake_up: the server still sleeps after it")


def outstanding(router: str, d: Deployment) -> int:
    """Requests route-serve has in flight at `d` (0 where it lists none for it)."""
    try:
        reply = http.get(router.rstrip("/") + "/metrics", TIMEOUT_S)
    except http.HttpError as e:
        raise EdgeError(f"route-serve /metrics: {e}") from None
    if reply.status != 200:
        raise EdgeError(f"route-serve /metrics answered {reply.status}")
    want = f"{d.host}:{d.port}".lower()
    bracketed = f"[{d.host}]:{d.port}".lower()
    total = 0.0
    for line in reply.text.splitlines():
        m = OUTSTANDING.match(line)
        if m and urlsplit(m.group(1)).netloc.rpartition("@")[2].lower() in (want, bracketed):
            total += float(m.group(2))
    return int(total)
