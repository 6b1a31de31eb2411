"""state.json as an apply or the autopilot rewrites it: each node's servers, the sleepers and
the draining marks, written atomically whenever they change, from any thread."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from fleetctl.base.names import natural_key
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import Sleeper, State, server_name
from fleetctl.fleet.statedir import StateDir


class StateBook:
    """state.json, rewritten atomically whenever a node's servers change; thread-safe."""

    def __init__(self, state_dir: StateDir, state: State):
        self.state_dir = state_dir
        self.serial = state.serial
        self.slo = state.slo
        self.by_node: dict[str, list[Deployment]] = {}
        for d in state.deployments:
            self.by_node.setdefault(d.node, []).append(d)
        # The autopilot's sleepers and the servers it drains: kept through an apply where the
        # plan leaves them be (apply/steps.py `sleepers_under`).
        self.asleep: dict[str, list[Sleeper]] = {}
        for s in state.asleep:
            self.asleep.setdefault(s.deployment.node, []).append(s)
        self.draining = state.draining
        self._lock = threading.Lock()

    def recorded(self, node: str) -> list[Deployment]:
        with self._lock:
            return list(self.by_node.get(node, ()))

    def sleeping(self, node: str) -> list[Sleeper]:
        with self._lock:
            return list(self.asleep.get(node, ()))

    def set_asleep(self, node: str, sleepers: Iterable[Sleeper]) -> None:
        with self._lock:
            self.asleep[node] = list(sleepers)
            if not self.asleep[node]:
                del self.asleep[node]
            self.serial += 1
            self.state_dir.save_state(self.state())

    def set_node(self, node: str, deployments: Iterable[Deployment]) -> None:
        with self._lock:
            self.by_node[node] = sorted(deployments, key=lambda d: (d.gpu_indices, d.port))
            if not self.by_node[node]:
                del self.by_node[node]
            self.serial += 1
            self.state_dir.save_state(self.state())

    def record_slo(self, before: State) -> None:
        """Write the state now where the plan's SLO differs from the one `before` holds: an
        apply that starts and stops nothing (a plan from new traffic, on the same servers)
        still records the SLO route-serve is to judge by."""
        mine = {name: slo.record() for name, slo in self.slo.items()}
        if mine != {name: slo.record() for name, slo in before.slo.items()}:
            with self._lock:
                self.serial += 1
                self.state_dir.save_state(self.state())

    def state(self) -> State:
        nodes = sorted(self.by_node, key=natural_key)
        awake = tuple(d for n in nodes for d in self.by_node[n])
        asleep = tuple(s for n in sorted(self.asleep, key=natural_key) for s in self.asleep[n])
        names = {server_name(d) for d in awake}
        return State(self.serial, awake, self.slo, asleep, self.draining & names)
