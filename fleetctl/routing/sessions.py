"""Session affinity: which class (and node) served a session's turn, for the sessions used last."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Pin:
    node_class: str
    node: str


# Pins a router keeps, least recently used first out (route-serve's --max-sessions): ~260
# bytes each (tracemalloc, 100,000 pins), so ~26 MB at most. A session forgotten is only
# routed afresh on its next turn.
SESSIONS_MAX = 100_000
# A session id is kept as a digest of this many bytes: a client's 1 MB "user" costs what a
# short one does, in memory and in Redis keys, and the id itself is never stored.
KEY_BYTES = 16


def session_key(session: str) -> str:
    """The fixed-size name the router keeps a session's pin under."""
    data = session.encode("utf-8", "surrogatepass")  # JSON may hold lone surrogates
    return hashlib.blake2b(data, digest_size=KEY_BYTES).hexdigest()


class SessionTable:
    """Session -> the class (and node) that served its last turn, for the `capacity` sessions
    used last. In memory; the daemon can keep it in Redis so that several router replicas
    agree."""

    def __init__(self, capacity: int = SESSIONS_MAX):
        self.pins: OrderedDict[str, Pin] = OrderedDict()
        self.capacity = max(1, capacity)

    def get(self, session: str) -> Pin | None:
        pin = self.pins.get(session)
        if pin is not None:
            self.pins.move_to_end(session)
        return pin

    def set(self, session: str, pin: Pin) -> None:
        self._put(session, pin)

    def _put(self, session: str, pin: Pin) -> None:
        self.pins[session] = pin
        self.pins.move_to_end(session)
        while len(self.pins) > self.capacity:
            self.forget(self.pins.popitem(last=False)[0])

    def forget(self, session: str) -> None:
        """`session`'s pin left the table (the least recently used past the capacity)."""
