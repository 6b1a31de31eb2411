"""Hostile and damaged state folder files are refused at the door: one line naming the file
and the field, exit code 2, no traceback, whatever the file holds (depth, ports, GPU indices,
hosts, names, booleans for numbers, a deployment recorded twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, write
from tests.fleet.test_inventory_errors import assert_one_clear_line


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> tuple[Path, dict]:
    """An inventory and a saved plan of it: its deployments are what a good state holds."""
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.model.catalog import load_catalog
    from fleetctl.planner import plan_fleet

    tmp = tmp_path_factory.mktemp("state-hostile")
    inv = write(tmp, (REPO / "inventory" / "seed-mixed-8b.yaml").read_text())

    plan = plan_fleet(load_inventory(inv, load_catalog()))
    return inv, {"format": 1, "serial": 3, "deployments": [d.to_json() for d in plan.deployments]}


def _with(doc: dict, i: int, **fields: object) -> dict:
    deps = [dict(d) for d in doc["deployments"]]
    deps[i].update(fields)
    return {**doc, "deployments": deps}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (id, how the good document becomes hostile, words the one line must hold)
CASES = [
    ("deep-100000", lambda d: _nested(100_000), ["nested deeper than 64 levels"]),
    ("deep-in-a-field", lambda d: _with(d, 0, perf=json.loads(_nested(70))), ["nested deeper"]),
    ("port-70000", lambda d: _with(d, 0, port=70000), ["deployments[0].port", "65535"]),
    ("port-0", lambda d: _with(d, 1, port=0), ["deployments[1].port", "greater than"]),
    ("gpu-minus-1", lambda d: _with(d, 0, gpu_indices=[-1]), ["deployments[0].gpu_indices[0]"]),
    ("gpu-64", lambda d: _with(d, 0, gpu_indices=[0, 64]), ["deployments[0].gpu_indices[1]"]),
    ("no-gpus", lambda d: _with(d, 0, gpu_indices=[]), ["deployments[0].gpu_indices"]),
    (
        "gpu-twice",
        lambda d: _with(d, 0, gpu_indices=[1, 1]),
        ["deployments[0]: gpu_indices [1, 1]"],
    ),
    (
        "host-shell",
        lambda d: _with(d, 0, host="10.0.1.11; rm -rf /"),
        ["deployments[0].host", "is not a hostname"],
    ),
    ("host-url", lambda d: _with(d, 0, host="http://x"), ["deployments[0].host", "URL scheme"]),
    ("node-path", lambda d: _with(d, 0, node="../../etc"), ["deployments[0].node", "valid name"]),
    ("model-shell", lambda d: _with(d, 0, model="m;reboot"), ["deployments[0].model"]),
    ("source-option", lambda d: _with(d, 0, source="--trust"), ["deployments[0].source"]),
    ("env-key", lambda d: _with(d, 0, env={"A;B": "1"}), ["deployments[0].env['A;B']"]),
    # A key from the file is quoted in the field's path: its newline cannot split the line.
    ("env-key-newline", lambda d: _with(d, 0, env={"A\nB": "1"}), ["env['A\\nB']"]),
    (
        "args-newline",
        lambda d: _with(d, 0, vllm_args=["serve", "x\nrm", "--host", "h", "--port", "1"]),
        ["deployments[0].vllm_args[1]", "control character 0x0a"],
    ),
    ("tp-0", lambda d: _with(d, 0, tensor_parallel_size=0), ["deployments[0].tensor_parallel"]),
    ("format-true", lambda d: {**d, "format": True}, ["format: expected a whole number"]),
    ("format-text", lambda d: {**d, "format": "1"}, ["format: expected a whole number"]),
    ("serial-negative", lambda d: {**d, "serial": -1}, ["serial"]),
    ("serial-bool", lambda d: {**d, "serial": True}, ["serial"]),
    (
        "duplicate",
        lambda d: {**d, "deployments": [*d["deployments"], d["deployments"][0]]},
        ["recorded twice", "(first at deployments[0])"],
    ),
    # A sleeper shares its slot's GPUs, never an awake server's port on the same node.
    (
        "sleeper-on-a-port",
        lambda d: {**d, "asleep": [{"deployment": d["deployments"][0], "level": 1}]},
        ["asleep[0]: node", "recorded twice (first at deployments[0])"],
    ),
    (
        "sleep-level-3",
        lambda d: {**d, "asleep": [{"deployment": _moved(d["deployments"][0]), "level": 3}]},
        ["asleep[0].level"],
    ),
    ("draining-unknown", lambda d: {**d, "draining": ["nowhere:1"]}, ["draining[0]: nowhere:1"]),
]


def _moved(record: dict) -> dict:
    """The record on another port: a sleeper beside its slot's awake server."""
    port = record["port"] + 100
    args = list(record["vllm_args"])
    args[args.index("--port") + 1] = str(port)
    return {**record, "port": port, "vllm_args": args}


def test_sleepers_and_draining_servers_round_trip(applied):
    """A slot's awake server and a sleeper on the same GPUs, and a draining server, read back
    as written; a state without them writes neither key (older readers' files stay as
    they were)."""
    from fleetctl.fleet.state import State

    _, doc = applied
    plain = State.from_json(doc)
    assert "asleep" not in plain.to_json() and "draining" not in plain.to_json()
    first = doc["deployments"][0]
    name = f"{first['node']}:{first['port']}"
    rich = {**doc, "asleep": [{"deployment": _moved(first), "level": 2}], "draining": [name]}
    state = State.from_json(rich)
    (sleeper,) = state.asleep
    assert sleeper.level == 2 and sleeper.deployment.key == plain.deployments[0].key
    assert state.draining == {name}
    assert State.from_json(state.to_json()) == state


@pytest.mark.parametrize(("how", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_state_file_is_one_line_naming_the_field(cli, applied, tmp_path, how, words):
    inv, good = applied
    state = tmp_path / "state.json"
    doc = how(good)
    state.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    r = cli("plan", inv, "--state-dir", tmp_path)
    msg = assert_one_clear_line(r, state, None, ["the state file is not usable", *words])
    if "recorded twice" in words:  # named at the second record, the one to remove
        assert f"deployments[{len(good['deployments'])}]: " in msg, msg


def test_the_good_state_still_reads(cli, applied, tmp_path):
    """What this release writes passes every check above: the plan keeps every server."""
    inv, good = applied
    (tmp_path / "state.json").write_text(json.dumps(good))
    r = cli("plan", inv, "--state-dir", tmp_path, "--json")
    assert r.code == 0, r.err
    assert {a["op"] for a in json.loads(r.out)["actions"]} == {"keep"}


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("facts.json", _nested(100_000), ["cannot read facts", "nested deeper"]),
        ("facts.json", '{"format": true, "nodes": {}}', ["format: expected a whole number"]),
        (
            "facts.json",
            '{"format": 2, "nodes": {"rtx-1": {"gpus": [{"index": -1}]}}}',
            ["nodes.rtx-1.gpus[0].index: input should be greater than or equal to 0"],
        ),
        (
            "facts.json",
            '{"format": 2, "nodes": {"rtx-1": {"gpus": [{"index": 0, "memory_total_mib": -8}]}}}',
            ["nodes.rtx-1.gpus[0].memory_total_mib"],
        ),
        ("calibration.json", _nested(100_000), ["cannot read the calibration", "nested"]),
        ("calibration.json", '{"format": true}', ["format: expected a whole number"]),
    ],
    ids=[
        "facts-deep",
        "facts-format-true",
        "facts-gpu-index",
        "facts-memory",
        "calibration-deep",
        "calibration-format-true",
    ],
)
def test_every_state_folder_document_is_read_the_same_way(
    cli, applied, tmp_path, name, text, words
):
    inv, _ = applied
    (tmp_path / name).write_text(text)
    r = cli("plan", inv, "--state-dir", tmp_path)
    assert_one_clear_line(r, tmp_path / name, None, words)


def test_an_oversized_state_file_is_refused_unread(cli, applied, tmp_path):
    """A state file past 64 MiB is refused after reading one byte past the bound, whatever
    it holds (here a good document padded with spaces, which JSON allows)."""
    inv, _ = applied
    state = tmp_path / "state.json"
    with state.open("w") as f:
        f.write('{"format": 1}')
        f.write(" " * 64 * 2**20)  # the documented bound, written out
    r = cli("plan", inv, "--state-dir", tmp_path)
    assert_one_clear_line(r, state, None, ["the state file is not usable: larger than 64 MiB"])
