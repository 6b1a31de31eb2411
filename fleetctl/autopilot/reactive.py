"""The field's baseline scaler, for comparison: KEDA scaling each model's servers on vLLM's
waiting requests through the Horizontal Pod Autoscaler, as KServe and the vLLM production
stack deploy it.

Each model owns the servers the inventory's plan gives it (a scaler moves no GPU between
models). Every POLL_S seconds (KEDA's polling interval) it reads the waiting requests of the
model's awake servers (`vllm:num_requests_waiting`, plus the router's queue for the model) and
asks for `ceil(awake x average waiting / TARGET_WAITING)` replicas (the HPA's rule), at least
`floor` and at most the plan's. More replicas start at once; fewer only when every
recommendation of the last DOWN_WINDOW_S seconds said so (the HPA's scale-down
stabilization). A replica starts cold (a new pod) and stops when scaled in: what the field
does; sleeping replicas are the autopilot's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fleetctl.sim.controls import Control, Observation

POLL_S = 30.0  # KEDA's default pollingInterval
TARGET_WAITING = 5.0  # waiting requests per replica the HPA aims at
DOWN_WINDOW_S = 300.0  # the HPA's default scale-down stabilization window


@dataclass
class Reactive:
    """One scaler over a fixed set of servers per model; call it with each observation."""

    servers: dict[str, list[str]]  # model -> its servers, in the order they are added
    start_s: Callable[[str], float]  # a server's cold start seconds
    floor: int = 1
    target_waiting: float = TARGET_WAITING
    down_window_s: float = DOWN_WINDOW_S
    history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def __call__(self, o: Observation) -> Sequence[Control]:
        out: list[Control] = []
        for model, names in self.servers.items():
            up = [n for n in names if o.states.get(n) in ("awake", "waking")]
            awake = [n for n in up if o.states.get(n) == "awake"]
            waiting = sum(o.waiting.get(n, 0) for n in awake) + o.queued.get(model, 0)
            average = waiting / max(1, len(awake))
            wanted = math.ceil(len(awake) * average / self.target_waiting) if awake else 1
            wanted = max(self.floor, min(len(names), wanted))
            if model not in self.history:  # the fleet ran at its size before: a first
                self.history[model] = deque([(o.now, len(up))])  # recommendation to hold
            seen = self.history[model]
            seen.append((o.now, wanted))
            while seen and seen[0][0] < o.now - self.down_window_s:
                seen.popleft()
            if wanted > len(up):
                for n in [n for n in names if n not in up][: wanted - len(up)]:
                    out.append(Control(o.now, n, "start", self.start_s(n)))
            else:
                keep = max(w for _, w in seen)  # the highest recent recommendation
                for n in list(reversed(awake))[: max(0, len(up) - keep)]:
                    out.append(Control(o.now, n, "stop"))
        return out
