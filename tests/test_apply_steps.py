"""The pure part of apply: what to do on a node, from the plan and what runs there."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from fleetctl.apply.node import Live, env_file, manifest, parse_inspect, server_id
from fleetctl.apply.steps import node_steps
from fleetctl.plan import Deployment, Server


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
    from fleetctl.catalog import load_catalog
    from fleetctl.inventory import load_inventory
    from fleetctl.planner import plan_fleet
    from fleetctl.router.backends import backends_from_state
    from fleetctl.state import State
    from fleetctl.statedir import StateDir

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
