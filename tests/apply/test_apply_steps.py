"""The pure part of apply: what to do on a node, from the plan and what runs there."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from fleetctl.apply.node import Live, env_file, manifest, parse_inspect, server_id
from fleetctl.apply.steps import Step, _util, node_steps, sleepers_under
from fleetctl.fleet.plan import Deployment, Server
from fleetctl.fleet.state import Sleeper, State


def server(max_len: int = 8192, util: float = 0.92, tp: int = 1) -> Server:
    return Server(
        model="llama-3-8b",
        variant="bf16",
        source="meta-llama/Meta-Llama-3-8B-Instruct",
        gpu_type="A100-SXM4-80GB",
        tensor_parallel_size=tp,
        max_model_len=max_len,
        gpu_memory_utilization=util,
        kv_cache_dtype="auto",
        max_num_batched_tokens=2048,
        max_num_seqs=256,
        kv_budget_bytes=1,
        kv_budget_tokens=1,
        max_sequences_at_max_len=1,
        weights_bytes=1,
        predicted_decode_tok_s=1.0,
        capacity_rps=1.0,
        reasons=(),
        args_head=("serve", "meta-llama/Meta-Llama-3-8B-Instruct"),
        args_tail=(
            "--max-model-len",
            str(max_len),
            "--gpu-memory-utilization",
            f"{util:g}",
            "--tensor-parallel-size",
            str(tp),
        ),
        env=(("VLLM_LOGGING_LEVEL", "INFO"),),
    )


def dep(gpus: tuple[int, ...], **kw: object) -> Deployment:
    return Deployment("n1", "10.0.0.1", gpus, 8000 + gpus[0], server(tp=len(gpus), **kw))  # type: ignore[arg-type]


def live(d: Deployment, alive: bool = True) -> Live:
    return Live(server_id(d), alive, alive, 1234, manifest(d, server_id(d), "tok", "now"))


def kinds(steps):
    return [
        (s.kind, s.deployment.gpu_indices if s.deployment else None, s.stop, s.stop_first)
        for s in steps
    ]


def test_keep_adopt_restart_and_start():
    a, b, c, d = dep((0,)), dep((1,)), dep((2,)), dep((3,))
    steps = node_steps("n1", [a, b, c, d], [live(a), live(b), live(c, alive=False)], recorded=[a])
    assert kinds(steps) == [
        ("keep", (0,), (), False),
        ("adopt", (1,), (), False),  # running with the planned flags but not recorded
        ("restart", (2,), (server_id(c),), True),  # its folder is there, its process is not
        ("start", (3,), (), True),
    ]


def test_replace_stops_first_unless_both_fit():
    old, new = dep((0,)), dep((0,), max_len=4096)
    [step] = node_steps("n1", [new], [live(old)], recorded=[old])
    assert (step.kind, step.stop_first, step.deployment.port) == ("replace", True, 8000)
    assert "needs the old one's GPU memory" in step.note and step.replaced == (old,)

    old, new = dep((0,), util=0.45), dep((0,), util=0.45, max_len=4096)
    [step] = node_steps("n1", [new], [live(old)], recorded=[old])
    assert (step.kind, step.stop_first, step.deployment.port) == ("replace", False, 9000)
    assert step.stop == (server_id(old),)
    # The next replacement of that slot goes back to the base port.
    moved = dataclasses.replace(new, port=9000)
    newer = dataclasses.replace(dep((0,), util=0.45, max_len=2048), port=9000)
    [step] = node_steps("n1", [newer], [live(moved)], recorded=[moved])
    assert step.deployment.port == 8000 and not step.stop_first


def test_unplanned_servers_stop_after_the_new_ones_start():
    gone, new = dep((1,)), dep((0,))
    steps = node_steps("n1", [new], [live(gone)], recorded=[gone])
    assert kinds(steps) == [("start", (0,), (), True), ("stop", None, (server_id(gone),), False)]


def test_one_server_split_in_two_stops_it_first():
    """A TP=2 server replaced by two TP=1 servers: even if both fit, the second new server
    would share GPU 1 with it, so the old one must stop before either starts."""
    old = dep((0, 1), util=0.45)
    a, b = dep((0,), util=0.45), dep((1,), util=0.45)
    steps = node_steps("n1", [a, b], [live(old)], recorded=[old])
    assert [s.kind for s in steps] == ["replace", "replace"]
    assert steps[0].stop == (server_id(old),) and steps[0].stop_first
    assert steps[1].stop == () and steps[1].stop_first


# --- node_steps, step by step: each expected Step written out in full --------------------------

GPU_MEMORY_FIRST = "stop then start: the new server needs the old one's GPU memory"
PORT_FIRST = "stop then start: the new server needs the old one's port"
BOTH_FIT = "start before stop: both fit in GPU memory"
NOT_RUNNING = "it was not running"


def copy_of(d: Deployment, sid: str, alive: bool) -> Live:
    """Another folder holding the same server (same manifest, so the same args hash)."""
    return Live(sid, alive, alive, None, manifest(d, sid, "tok", "now"))


def test_a_step_names_only_its_kind_and_node_by_default():
    """A bare step deploys nothing, stops nothing, after the start, for no stated reason, and
    replaces nothing; steps are values (frozen), so apply cannot alter one behind the plan."""
    step = Step("stop", "n1")
    assert (step.deployment, step.stop, step.stop_first, step.note, step.replaced) == (
        None,
        (),
        False,
        "",
        (),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.note = "x"  # type: ignore[misc]


def test_util_reads_the_flag_or_takes_vllms_default():
    assert _util(["serve", "--gpu-memory-utilization", "0.3", "--port", "1"]) == 0.3
    assert _util(("serve",)) == 0.9  # vLLM's default when absent
    assert _util(["serve", "--gpu-memory-utilization"]) == 0.9  # no value after the flag
    assert _util(["--gpu-memory-utilization", "--port"]) == 0.9  # not a number


def test_every_step_in_full_for_keep_adopt_restart_start_and_stop():
    a, b, c, d, gone, dead = dep((0,)), dep((1,)), dep((2,)), dep((3,)), dep((4,)), dep((5,))
    steps = node_steps(
        "n1",
        [a, b, c, d],
        [live(a), live(b), live(c, alive=False), live(gone), live(dead, alive=False)],
        recorded=[a, c],
    )
    assert steps == [
        Step("keep", "n1", a),
        Step("adopt", "n1", b),
        Step("restart", "n1", c, (server_id(c),), True, NOT_RUNNING),
        Step("start", "n1", d, (), True, ""),
        Step("stop", "n1", None, (server_id(gone),), False, "not in the plan"),
        Step("stop", "n1", None, (server_id(dead),), False, "not in the plan (was not running)"),
    ]


@pytest.mark.parametrize("live_first", [True, False])
def test_a_live_copy_is_kept_over_a_dead_one_in_either_order(live_first):
    a = dep((0,))
    up, down = copy_of(a, "8000-up", True), copy_of(a, "8000-down", False)
    found = [up, down] if live_first else [down, up]
    assert node_steps("n1", [a], found, recorded=[a]) == [
        Step("keep", "n1", a),
        Step("stop", "n1", None, ("8000-down",), False, "not in the plan (was not running)"),
    ]


def test_of_two_dead_copies_the_first_is_restarted_the_other_stopped():
    a = dep((0,))
    first, second = copy_of(a, "8000-a", False), copy_of(a, "8000-b", False)
    assert node_steps("n1", [a], [first, second], recorded=[a]) == [
        Step("restart", "n1", a, ("8000-a",), True, NOT_RUNNING),
        Step("stop", "n1", None, ("8000-b",), False, "not in the plan (was not running)"),
    ]


def test_a_dead_server_in_the_way_is_restarted_over_not_replaced():
    """A dead server on the new one's GPU (any port) holds no memory: stop its folder, start."""
    old, new = dep((0,)), dataclasses.replace(dep((0,), max_len=4096), port=8500)
    assert node_steps("n1", [new], [live(old, alive=False)], recorded=[old]) == [
        Step("restart", "n1", new, (server_id(old),), True, NOT_RUNNING)
    ]


def test_a_dead_tp2_server_split_in_two_restarts_once():
    old = dep((0, 1))
    a, b = dep((0,)), dep((1,))
    assert node_steps("n1", [a, b], [live(old, alive=False)], recorded=[old]) == [
        Step("restart", "n1", a, (server_id(old),), True, NOT_RUNNING),
        Step("start", "n1", b, (), True, ""),  # the old folder is already the first's to stop
    ]


def test_replacements_that_fit_start_first_on_the_other_port():
    # 0.45 + 0.45 of the GPU: both fit; the old one holds port 8000, so the new one takes
    # 8000 + 1000 and the old one's recorded deployment is what a failed start keeps.
    old, new = dep((0,), util=0.45), dep((0,), util=0.45, max_len=4096)
    moved = dataclasses.replace(new, port=9000)
    assert node_steps("n1", [new], [live(old)], recorded=[old]) == [
        Step(
            "replace",
            "n1",
            moved,
            (server_id(old),),
            False,
            f"{BOTH_FIT}, new server on port 9000",
            (old,),
        )
    ]
    # Not recorded in state: nothing to keep there if the start fails.
    assert node_steps("n1", [new], [live(old)])[0].replaced == ()
    # Another port base: 7000 + GPU 0, and its surge port 8000.
    base = dataclasses.replace(old, port=7000)
    newer = dataclasses.replace(new, port=7000)
    [step] = node_steps("n1", [newer], [live(base)], recorded=[base], port_base=7000)
    assert (step.deployment.port, step.stop_first) == (8000, False)


def test_shares_summing_to_exactly_one_fit():
    old, new = dep((0,), util=0.55), dep((0,), util=0.45, max_len=4096)
    [step] = node_steps("n1", [new], [live(old)], recorded=[old])
    assert (step.kind, step.stop_first, step.deployment.port) == ("replace", False, 9000)
    over = dep((0,), util=0.56, max_len=4096)
    [step] = node_steps("n1", [over], [live(old)], recorded=[old])
    assert step == Step("replace", "n1", over, (server_id(old),), True, GPU_MEMORY_FIRST, (old,))


def test_a_replacement_on_another_port_keeps_its_port():
    """The old server shares the GPU but not the port: both fit, no port to move to."""
    old = dep((0,), util=0.45)
    new = dataclasses.replace(dep((0,), util=0.45, max_len=4096), port=9000)
    assert node_steps("n1", [new], [live(old)], recorded=[old]) == [
        Step("replace", "n1", new, (server_id(old),), False, BOTH_FIT, (old,))
    ]


def test_a_replacement_moves_only_to_a_free_port():
    old, new = dep((0,), util=0.45), dep((0,), util=0.45, max_len=4096)
    # Port 9000 is held by a server on GPU 1 that stays.
    squatter = dataclasses.replace(dep((1,)), port=9000)
    steps = node_steps("n1", [squatter, new], [live(squatter), live(old)], recorded=[old])
    assert steps[1] == Step("replace", "n1", new, (server_id(old),), True, GPU_MEMORY_FIRST, (old,))
    # ... or by a server about to be stopped (still running while the new one would start).
    steps = node_steps("n1", [new], [live(squatter), live(old)], recorded=[old])
    assert steps[0] == Step("replace", "n1", new, (server_id(old),), True, GPU_MEMORY_FIRST, (old,))
    # ... or by a server an earlier step starts.
    steps = node_steps("n1", [squatter, new], [live(old)], recorded=[old])
    assert steps[0] == Step("start", "n1", squatter, (), True, "")
    assert steps[1] == Step("replace", "n1", new, (server_id(old),), True, GPU_MEMORY_FIRST, (old,))


def test_a_server_on_the_new_ones_port_alone_is_stopped_first_when_no_port_is_free():
    # The new server runs on GPU 1 at port 8000, held by a live server on GPU 0; its other
    # port, 8001 (base + GPU 1), is held by a server that stays: the old one must go first.
    holder = dep((0,))
    new = dataclasses.replace(dep((1,)), port=8000)
    stays = dataclasses.replace(dep((2,)), port=8001)
    steps = node_steps("n1", [stays, new], [live(stays), live(holder)], recorded=[holder, stays])
    assert steps == [
        Step("keep", "n1", stays),
        Step("replace", "n1", new, (server_id(holder),), True, PORT_FIRST, (holder,)),
    ]
    # With 8001 free the new server starts there first.
    steps = node_steps("n1", [new], [live(holder)], recorded=[holder])
    moved = dataclasses.replace(new, port=8001)
    assert steps == [
        Step(
            "replace",
            "n1",
            moved,
            (server_id(holder),),
            False,
            f"{BOTH_FIT}, new server on port 8001",
            (holder,),
        )
    ]


def test_a_replacement_stops_live_and_dead_servers_in_its_way():
    # A TP=2 server over GPUs 0 and 1 where a live (recorded) and a dead server ran.
    live_old, dead_old = dep((0,), util=0.45), dep((1,), util=0.45)
    new = dep((0, 1), util=0.45)
    steps = node_steps(
        "n1", [new], [live(live_old), live(dead_old, alive=False)], recorded=[live_old, dead_old]
    )
    moved = dataclasses.replace(new, port=9000)
    assert steps == [
        Step(
            "replace",
            "n1",
            moved,
            (server_id(live_old), server_id(dead_old)),
            False,
            f"{BOTH_FIT}, new server on port 9000",
            (live_old,),  # only a live one is still running if the start fails
        )
    ]


def test_one_server_split_in_two_every_step_in_full():
    old = dep((0, 1), util=0.45)
    a, b = dep((0,), util=0.45), dep((1,), util=0.45)
    moved = dataclasses.replace(a, port=9000)
    steps = node_steps("n1", [a, b], [live(old)], recorded=[old])
    assert steps == [
        Step(
            "replace",
            "n1",
            moved,
            (server_id(old),),
            True,
            f"{BOTH_FIT}, new server on port 9000",
            (old,),
        ),
        Step("replace", "n1", b, (), True, GPU_MEMORY_FIRST, ()),
    ]


def test_env_file_quotes_values_and_carries_the_token(tmp_path):
    d = dep((0, 1))
    hostile = "hf_a'b c $(touch x) `id` ${HOME} \\ \" ; & | % \u00e9"
    text = env_file(d, {"HF_TOKEN": hostile}, "tok-1")
    assert "CUDA_VISIBLE_DEVICES='0,1'\n" in text
    assert "FLEETCTL_SERVER_TOKEN='tok-1'\n" in text
    assert "hf_a" not in str(manifest(d, server_id(d), "tok-1", "now"))
    # Sourced by a real sh, as the node does, it gives back exactly the values and runs nothing.
    (tmp_path / "env").write_text(text)
    out = subprocess.run(
        ["sh", "-c", "set -a; . ./env; set +a; printf '%s' \"$HF_TOKEN\""],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == hostile
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"X=1; touch /tmp/x; Y": "v"}, "not an environment variable name"),
        ({"OK": "line\nbreak"}, "control character"),
    ],
)
def test_env_file_refuses_what_the_inventory_would(env, why):
    with pytest.raises(ValueError, match=why):
        env_file(dep((0,)), env, "tok-1")


def test_parse_inspect_reads_blocks_and_survives_a_damaged_manifest():
    text = (
        "@@server 8000-llama\nalive=1\nlistening=1\nholder=77 python3 -m vllm serve x\npid=77\n"
        'manifest={"port": 8000, "args_hash": "abc"}\n'
        "@@server 8001-llama\nalive=0\nlistening=0\npid=\nmanifest={not json\n"
    )
    a, b = parse_inspect(text)
    assert (a.sid, a.alive, a.pid, a.args_hash, a.foreign_holder) == (
        "8000-llama",
        True,
        77,
        "abc",
        "",
    )
    assert (b.alive, b.pid, b.manifest) == (False, None, {})
    squatted = dataclasses.replace(a, alive=False)
    assert squatted.foreign_holder == "python3 -m vllm serve x"


@pytest.mark.parametrize(
    ("host", "url"),
    [("10.0.1.11", "http://10.0.1.11:8000/health"), ("fd00::11", "http://[fd00::11]:8000/health")],
)
def test_a_server_url_brackets_an_ipv6_host(host, url):
    """One URL builder for apply's health waits, health checks and the router's backends:
    without brackets an IPv6 node applies and then every routed request fails."""
    d = dataclasses.replace(dep((0,)), host=host, port=8000)
    assert d.url("/health") == url


def test_the_router_reaches_an_ipv6_node_in_brackets(tmp_path):
    from fleetctl.daemon.backends import backends_from_state
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.model.catalog import load_catalog
    from fleetctl.planner import plan_fleet

    inv_path = tmp_path / "inventory.yaml"
    inv_path.write_text(
        "nodes:\n  - {name: n1, host: 'fd00::11', gpus: {type: L4}}\n"
        "models:\n  - {name: m, profile: llama-3-8b, max_context: 4096,\n"
        "     variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}}\n"
    )
    inv = load_inventory(inv_path, load_catalog())
    StateDir(tmp_path).save_state(State(1, plan_fleet(inv).deployments))
    [b] = backends_from_state(inv, StateDir(tmp_path))
    assert b.name.startswith("http://[fd00::11]:"), b.name  # a backend is named by its URL


def test_sleepers_stay_where_the_plan_leaves_their_gpus_be():
    awake, other = dep((0,)), dep((1,))
    asleep = Sleeper(dataclasses.replace(dep((0,), max_len=4096), port=8100))
    fate = sleepers_under([awake, other], [awake, other], [asleep])
    assert fate.keep == (asleep,) and not fate.wake and not fate.stop


def test_a_sleeper_the_plan_wants_is_woken_unless_a_leaving_server_holds_its_gpus():
    awake = dep((0,))
    sleeper = Sleeper(dataclasses.replace(dep((0,), max_len=4096), port=8100))
    fate = sleepers_under([sleeper.deployment], [], [sleeper])
    assert fate.wake == (sleeper,)
    # What runs on its GPUs leaves: that one stops first, so this one starts cold after it.
    fate = sleepers_under([sleeper.deployment], [awake], [sleeper])
    assert fate.stop == (sleeper,) and not fate.wake


def test_a_sleeper_whose_gpus_go_to_another_server_is_stopped():
    sleeper = Sleeper(dep((0,)))
    new = dep((0, 1))
    fate = sleepers_under([new], [], [sleeper])
    assert fate.stop == (sleeper,)


def test_the_state_book_keeps_sleepers_and_drains_through_a_node_rewrite(tmp_path):
    from fleetctl.apply.book import StateBook
    from fleetctl.fleet.state import server_name
    from fleetctl.fleet.statedir import StateDir

    awake, kept = dep((0,)), dep((1,))
    sleeper = Sleeper(dataclasses.replace(dep((0,), max_len=4096), port=8100))
    sdir = StateDir(tmp_path)
    state = State(1, (awake, kept), asleep=(sleeper,), draining=frozenset({server_name(awake)}))
    book = StateBook(sdir, state)
    book.set_node("n1", [kept])
    saved = sdir.load_state()
    assert saved.asleep == (sleeper,)
    assert saved.draining == frozenset()  # the drained server is gone: so is its mark
    book.set_asleep("n1", [])
    assert sdir.load_state().asleep == ()
