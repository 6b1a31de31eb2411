"""Session affinity: which class (and node) served a session's first turn."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Pin:
    node_class: str
    node: str


@dataclass
class SessionTable:
    """Session -> the class (and node) that served its first turn. In memory; the daemon can
    keep it in Redis so that several router replicas agree."""

    pins: dict[str, Pin] = field(default_factory=dict)

    def get(self, session: str) -> Pin | None:
        return self.pins.get(session)

    def set(self, session: str, pin: Pin) -> None:
        self.pins[session] = pin
