"""The autopilot's change set (autopilot/changes.py): from what runs to a target placement,
wakes where the target sleeps on its GPUs, starts where it does not, sleeps at the level host
memory allows, stops for servers without sleep mode; each costed, leaving before arriving."""

from __future__ import annotations

import dataclasses

import pytest

from fleetctl.autopilot.changes import Costs, Resident, changes, conflicts, same_server
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from tests.conftest import REPO

GB = 10**9


@pytest.fixture(scope="module")
def placed() -> list[Deployment]:
    inv = load_inventory(REPO / "inventory" / "seed-multi-model.yaml", load_catalog())
    return list(plan_fleet(inv).deployments)


def _sleepy(d: Deployment) -> Deployment:
    server = dataclasses.replace(d.server, args_tail=(*d.server.args_tail, "--enable-sleep-mode"))
    return dataclasses.replace(d, server=server)


def _as(d: Deployment, other: Deployment) -> Deployment:
    """`other`'s server on `d`'s GPUs (same node, same GPU indices)."""
    return dataclasses.replace(other, node=d.node, host=d.host, gpu_indices=d.gpu_indices)


COSTS = Costs(
    start_s=lambda d: 90.0,
    wake_s=lambda d, level: 1.0 if level == 1 else 5.0,
    host_bytes=lambda node: 1000 * GB,
)


def _pair(placed: list[Deployment]) -> tuple[Deployment, Deployment]:
    """Two servers of different models on one GPU type and TP: one to swap for the other."""
    for a in placed:
        for b in placed:
            if (a.model != b.model and a.gpu_type == b.gpu_type
                    and a.gpu_indices == b.gpu_indices and a.node != b.node):  # fmt: skip
                return _sleepy(a), _sleepy(_as(a, b))
    raise AssertionError("the example has no such pair")


def test_nothing_changes_when_the_target_is_what_runs(placed):
    residents = [Resident(d) for d in placed]
    assert changes(residents, placed, COSTS) == []


def test_a_model_that_sleeps_on_the_gpus_is_woken_not_started(placed):
    now, swap = _pair(placed)
    residents = [Resident(now), Resident(swap, level=1)]
    steps = changes(residents, [swap], COSTS)
    assert [(c.kind, c.deployment.model, c.level) for c in steps] == [
        ("sleep", now.model, 1),
        ("wake", swap.model, 1),
    ]
    assert steps[1].seconds == 1.0
    # Without the sleeper, the target is started cold, at the start's cost.
    cold = changes([Resident(now)], [swap], COSTS)
    assert [c.kind for c in cold] == ["sleep", "start"] and cold[1].seconds == 90.0


def test_host_memory_decides_the_sleep_level(placed):
    now, swap = _pair(placed)
    tight = dataclasses.replace(COSTS, host_bytes=lambda node: now.server.weights_bytes - 1)
    steps = changes([Resident(now)], [swap], tight)
    assert steps[0].kind == "sleep" and steps[0].level == 2
    # One level-1 sleeper already fills the node's host memory: the next sleeps at level 2.
    other = _sleepy(_as(now, placed[-1]))
    room = dataclasses.replace(COSTS, host_bytes=lambda node: now.server.weights_bytes)
    steps = changes([Resident(now), Resident(other, level=1)], [swap], room)
    assert steps[0].level == 2


def test_a_server_without_sleep_mode_is_stopped(placed):
    now, swap = _pair(placed)
    tail = tuple(a for a in now.server.args_tail if a != "--enable-sleep-mode")
    plain = dataclasses.replace(now, server=dataclasses.replace(now.server, args_tail=tail))
    steps = changes([Resident(plain)], [swap], COSTS)
    assert [c.kind for c in steps] == ["stop", "start"]


def test_same_server_means_same_gpus_and_command(placed):
    a = placed[0]
    assert same_server(a, a)
    assert not same_server(a, _sleepy(a))
    assert not same_server(a, dataclasses.replace(a, gpu_indices=(7,)))


def test_a_step_budget_alone_does_not_restart_a_server(placed):
    """A plan for another interval's request shapes may choose another step budget (and
    with it max_num_seqs): the running server stays, where a new command would start a
    second one cold. (It did: the live benchmark's simulated side slept a 4090's server
    and started the same model on its GPU three times in ten minutes.)"""
    a = placed[0]
    tail = list(a.server.args_tail)
    i = tail.index("--max-num-batched-tokens")
    tail[i + 1] = str(int(tail[i + 1]) // 2)
    j = tail.index("--max-num-seqs")
    tail[j + 1] = "64"
    tuned = dataclasses.replace(a, server=dataclasses.replace(a.server, args_tail=tuple(tail)))
    assert tuned.vllm_args != a.vllm_args
    assert same_server(a, tuned)
    assert changes([Resident(a)], [tuned], COSTS) == []
    other = list(a.server.args_tail)
    k = other.index("--max-model-len")
    other[k + 1] = "1024"
    longer = dataclasses.replace(a, server=dataclasses.replace(a.server, args_tail=tuple(other)))
    assert not same_server(a, longer)


def test_a_target_sharing_a_gpu_is_a_conflict(placed):
    now, swap = _pair(placed)
    assert conflicts([now, swap]) == [(now, swap)]
    assert conflicts(placed) == []


def test_a_server_whose_gpus_no_arrival_needs_leaves_after_the_arrivals(placed):
    """Start before stop: a model's leaving server on other GPUs keeps serving until its
    replacement is ready; one whose GPUs the arrival takes leaves first."""
    now, swap = _pair(placed)
    elsewhere = next(d for d in placed if d.node != now.node and d.model == now.model)
    elsewhere = _sleepy(elsewhere)
    steps = changes([Resident(now), Resident(elsewhere)], [swap], COSTS)
    kinds = [(c.kind, c.deployment.node, c.after) for c in steps]
    assert kinds == [
        ("sleep", now.node, False),
        ("start", swap.node, False),
        ("sleep", elsewhere.node, True),
    ]
