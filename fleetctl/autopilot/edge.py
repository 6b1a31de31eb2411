"""The live autopilot's look at route-serve: its /metrics, for what it still has in flight at a
server before that server sleeps. Bounded; fails with `SleepModeError`, one line."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from fleetctl.apply.sleepmode import TIMEOUT_S, SleepModeError
from fleetctl.fleet import http
from fleetctl.fleet.plan import Deployment

OUTSTANDING = re.compile(r'^fleetctl_backend_outstanding_requests\{backend="([^"]*)"\}\s+(\S+)$')


def outstanding(router: str, d: Deployment) -> int:
    """Requests route-serve has in flight at `d` (0 where it lists none for it)."""
    try:
        reply = http.get(router.rstrip("/") + "/metrics", TIMEOUT_S)
    except http.HttpError as e:
        raise SleepModeError(f"route-serve /metrics: {e}") from None
    if reply.status != 200:
        raise SleepModeError(f"route-serve /metrics answered {reply.status}")
    want = f"{d.host}:{d.port}".lower()
    bracketed = f"[{d.host}]:{d.port}".lower()
    total = 0.0
    for line in reply.text.splitlines():
        m = OUTSTANDING.match(line)
        if m and urlsplit(m.group(1)).netloc.rpartition("@")[2].lower() in (want, bracketed):
            total += float(m.group(2))
    return int(total)
