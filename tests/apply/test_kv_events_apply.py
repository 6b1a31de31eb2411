"""apply turns on prefix caching and KV events (router.prefix_cache): the plan's per-server
flags, the inventory's checks of the event ports, and route-serve subscribing, from the
applied state alone, to the endpoints those flags name (a real zmq publisher on loopback)."""

from __future__ import annotations

import json
import shlex
import socket
import time
from pathlib import Path

import pytest

from fleetctl.daemon.backends import KvEndpoint, kv_endpoint
from fleetctl.daemon.router import DaemonConfig
from fleetctl.daemon.serve import build_router
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.ssh import quote
from fleetctl.fleet.state import State
from fleetctl.fleet.statedir import StateDir
from fleetctl.planner import plan_fleet
from fleetctl.vllm.metrics import parse_metrics
from tests.conftest import DATA, write

INVENTORY = """\
nodes:
  - name: rtx-1
    host: 127.0.0.1
    gpus: {type: RTX-4090, count: 2}
  - name: a100-1
    host: 127.0.0.2
    gpus: {type: A100-SXM4-80GB, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    min_replicas: 3
"""
ON = "router:\n  prefix_cache: {kv_events: true}\n"


def _plan(tmp_path: Path, catalog, text: str):
    return plan_fleet(load_inventory(write(tmp_path, text), catalog))


def _config(d: Deployment) -> dict | None:
    args = list(d.vllm_args)
    if "--kv-events-config" not in args:
        return None
    return json.loads(args[args.index("--kv-events-config") + 1])


def test_prefix_caching_keeps_vllms_default_and_kv_events_are_off_by_default(tmp_path, catalog):
    """No flag by default (vLLM V1 caches prefixes): upgrading restarts no server."""
    plan = _plan(tmp_path, catalog, INVENTORY)
    assert len(plan.deployments) == 3
    for d in plan.deployments:
        assert not {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(d.vllm_args)
        assert _config(d) is None
    assert not any("KV events" in w for w in plan.warnings)
    off = _plan(tmp_path, catalog, INVENTORY + "router:\n  prefix_cache: {enabled: false}\n")
    assert all("--no-enable-prefix-caching" in d.vllm_args for d in off.deployments)


def test_each_server_publishes_on_its_own_ports(tmp_path, catalog):
    plan = _plan(tmp_path, catalog, INVENTORY + ON)
    ports = set()
    for d in plan.deployments:
        c = _config(d)
        assert c == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{d.port + 2000}",
            "replay_endpoint": f"tcp://*:{d.port + 4000}",
            "topic": "kv",
        }
        ports |= {(d.host, d.port + 2000), (d.host, d.port + 4000)}
        assert "--enable-prefix-caching" in d.vllm_args
        assert any("KV events on its port +2000" in r for r in d.server.reasons)
        # Recorded in state and read back, the arguments are the same (drift detection).
        back = Deployment.from_json(json.loads(json.dumps(d.to_json())))
        assert back.vllm_args == d.vllm_args and back.args_hash == d.args_hash
        # apply quotes each argument at the edge: the shell gives the JSON back whole.
        assert shlex.split(quote(*d.vllm_args)) == list(d.vllm_args)
        # route-serve reads where to subscribe from those arguments.
        assert kv_endpoint(d.vllm_args, d.host) == KvEndpoint(
            f"tcp://{d.host}:{d.port + 2000}", "kv", f"tcp://{d.host}:{d.port + 4000}"
        )
    assert len(ports) == 6  # two servers on rtx-1: distinct ports
    (warning,) = [w for w in plan.warnings if w.startswith("KV events")]
    assert "token ids in cleartext" in warning and "firewall" in warning
    assert "10000-10001 and 11000-11001 (events)" in warning
    # A replacement beside the old server (port + 1000) publishes on its own ports too.
    import dataclasses

    d = plan.deployments[0]
    surge = dataclasses.replace(d, port=d.port + 1000)
    assert _config(surge)["endpoint"] == f"tcp://*:{d.port + 3000}"


def test_the_replay_socket_follows_its_offset(tmp_path, catalog):
    text = INVENTORY + "router:\n  prefix_cache: {kv_events: true, replay_port_offset: 5000}\n"
    for d in _plan(tmp_path, catalog, text).deployments:
        c = _config(d)
        assert c is not None and c["replay_endpoint"] == f"tcp://*:{d.port + 5000}"
        assert kv_endpoint(d.vllm_args, d.host).replay == f"tcp://{d.host}:{d.port + 5000}"


def test_no_replay_socket_and_another_topic(tmp_path, catalog):
    text = INVENTORY + (
        "router:\n  prefix_cache: {kv_events: true, replay_port_offset: null, "
        "events_port_offset: 3000, topic: fleet.kv}\n"
    )
    for d in _plan(tmp_path, catalog, text).deployments:
        c = _config(d)
        assert c is not None and "replay_endpoint" not in c
        assert c["endpoint"] == f"tcp://*:{d.port + 3000}" and c["topic"] == "fleet.kv"
        assert kv_endpoint(d.vllm_args, d.host) == KvEndpoint(
            f"tcp://{d.host}:{d.port + 3000}", "fleet.kv", None
        )


def test_unsafe_settings_are_warned(tmp_path, catalog):
    text = INVENTORY.replace(
        "    min_replicas: 3\n",
        "    min_replicas: 3\n    vllm_args: ['--prefix-caching-hash-algo', 'xxhash']\n"
        "    env: {PYTHONHASHSEED: '0'}\n",
    )
    warnings = _plan(tmp_path, catalog, text + ON).warnings
    assert any("--prefix-caching-hash-algo xxhash" in w for w in warnings)
    assert any("PYTHONHASHSEED" in w for w in warnings)
    assert not any("hash-algo" in w for w in _plan(tmp_path, catalog, text).warnings)


def _line(text: str, key: str) -> int:
    return next(i for i, t in enumerate(text.splitlines(), 1) if key in t)


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (  # the replacement servers' ports are port + 1000
            "router:\n  prefix_cache:\n    kv_events: true\n    events_port_offset: 1000\n",
            "events_port_offset:",
            ["events_port_offset 1000", "replacement server ports", "e.g. events_port_offset"],
        ),
        (
            "router:\n  prefix_cache:\n    kv_events: true\n    replay_port_offset: 2001\n",
            "replay_port_offset:",
            ["replay_port_offset 2001", "events ports (10000-10001)"],
        ),
        (
            "planner: {port_base: 61000}\nrouter:\n  prefix_cache:\n    kv_events: true\n",
            "prefix_cache:",  # the replay port offset's default (not written) runs past
            ["replay_port_offset 4000", "past 65535", "lower replay_port_offset to at most 3534"],
        ),
        (
            "router:\n  prefix_cache:\n    kv_events: true\n    enabled: false\n",
            "kv_events:",
            ["prefix caching is off", "enabled to true"],
        ),
        (
            "router:\n  dcgm_exporter_port: 10001\n  prefix_cache: {kv_events: true}\n",
            "dcgm_exporter_port:",
            ["dcgm_exporter_port 10001", "events ports"],
        ),
        (
            "router:\n  prefix_cache: {kv_events: true, topic: 'a b'}\n",
            "prefix_cache:",
            ["topic"],
        ),
    ],
)
def test_inventory_errors_name_one_line(cli, tmp_path, extra, key, words):
    r = cli("validate", write(tmp_path, INVENTORY + extra))
    line = _line(INVENTORY + extra, key)
    assert r.code == 2, r.err
    first = r.err.strip().splitlines()[0]
    assert f"inventory.yaml:{line}" in first, r.err
    for w in words:
        assert w in r.err, r.err


@pytest.mark.parametrize(
    ("args", "key", "words"),
    [
        (
            "['--kv-events-config', '{}']",
            "vllm_args",
            ["set by the plan", "router.prefix_cache.kv_events"],
        ),
        (
            "['--no-enable-prefix-caching']",
            "vllm_args",
            ["--no-enable-prefix-caching", "kv_events"],
        ),
    ],
)
def test_vllm_args_cannot_override_the_events(cli, tmp_path, args, key, words):
    text = INVENTORY.replace(
        "    min_replicas: 3\n", f"    min_replicas: 3\n    vllm_args: {args}\n"
    )
    r = cli("validate", write(tmp_path, text + ON))
    line = _line(text, key)
    assert r.code == 2, r.err
    assert f"inventory.yaml:{line}" in r.err.strip().splitlines()[0], r.err
    for w in words:
        assert w in r.err, r.err


def block_size(page: str) -> int | None:
    return parse_metrics(page).block_size


def test_block_size_is_read_from_cache_config_info():
    page = DATA / "vllm-0.32.0-cpu-metrics.txt"  # a real capture
    assert block_size(page.read_text()) == 128
    line = 'vllm:cache_config_info{_block_size_resolved="True",block_size="16",engine="0"} 1.0'
    assert block_size("# TYPE vllm:cache_config_info gauge\n" + line + "\n") == 16
    assert block_size("vllm:num_requests_running 0\n") is None


# ---------------------------------------------------------------------------------------------
# route-serve, from the applied state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_route_serve_subscribes_to_what_apply_started(tmp_path, catalog):
    """The state alone says where each server publishes: route-serve, with the inventory's
    kv_events on, connects there, and a batch in vLLM's wire format (topic, seq, msgpack
    KVEventBatch) published on loopback reaches the index; /metrics counts it."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    from tests.procs import http_request
    from tests.routing.test_router_prefix import Serving

    events = _free_port()
    base = events - 2000  # the first server's events port is this free one
    inv_path = write(
        tmp_path,
        INVENTORY.replace("    min_replicas: 3\n", "    min_replicas: 1\n")
        + f"planner: {{port_base: {base}}}\n"
        + ON,
    )
    inv = load_inventory(inv_path, catalog)
    plan = plan_fleet(inv)
    first = next(d for d in plan.deployments if d.port == base and d.host == "127.0.0.1")
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, plan.deployments))

    router = build_router(
        inv,
        catalog,
        backends_file=None,
        state_dir=sdir,
        policy="hardware-aware",
        config=DaemonConfig(),
        scrape_interval=60.0,
        prefix_capacity=1000,
        calibrated=False,
    )
    assert router.kv_events is not None
    assert router.kv_events[first.url()] == KvEndpoint(
        f"tcp://127.0.0.1:{events}", "kv", f"tcp://127.0.0.1:{events + 2000}"
    )
    assert len(router.kv_events) == len(plan.deployments)
    index = router.prefix
    assert index is not None and not index.learn

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # vLLM's publisher binds tcp://*:PORT; loopback here
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.RCVTIMEO, 10_000)
    pub.bind(f"tcp://127.0.0.1:{events}")
    s = Serving(router)
    try:
        assert pub.recv()[:1] == b"\x01"  # route-serve subscribed
        stored = {
            "type": "BlockStored",
            "block_hashes": [11, 12, 13],
            "parent_block_hash": None,
            "token_ids": list(range(48)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), msgpack.packb([1.5, [stored], 0])])
        end = time.monotonic() + 10
        while s.on_loop(lambda: index.size(first.url())) != 3:
            assert time.monotonic() < end, "the event never reached the index"
            time.sleep(0.02)
        assert s.on_loop(lambda: sorted(index.blocks[first.url()])) == [11, 12, 13]
        status, _, body = http_request(s.port, "GET", "/metrics", None, timeout=10)
        text = body.decode() if isinstance(body, bytes) else str(body)
        assert status == 200
        assert f'fleetctl_kv_events_total{{backend="{first.url()}",kind="batches"}} 1.0' in text
        assert 'fleetctl_kv_block_size{backend=""} 16' in text

        # A reload (apply moved a server's events elsewhere): route-serve resubscribes, and
        # the counts so far carry over.
        moved = _free_port()
        pub2 = ctx.socket(zmq.XPUB)
        pub2.setsockopt(zmq.LINGER, 0)
        pub2.setsockopt(zmq.RCVTIMEO, 10_000)
        pub2.bind(f"tcp://127.0.0.1:{moved}")
        try:
            fresh = dict(router.kv_events)
            fresh[first.url()] = KvEndpoint(f"tcp://127.0.0.1:{moved}", "kv")
            s.on_loop(lambda: router.set_kv_events(fresh))
            assert pub2.recv()[:1] == b"\x01"
            stored["block_hashes"] = [21]
            stored["token_ids"] = list(range(16))
            pub2.send_multipart([b"kv", (7).to_bytes(8, "big"), msgpack.packb([2.0, [stored], 0])])
            end = time.monotonic() + 10
            while 21 not in s.on_loop(lambda: set(index.blocks[first.url()])):
                assert time.monotonic() < end, "the moved publisher was not subscribed"
                time.sleep(0.02)
            text = http_request(s.port, "GET", "/metrics", None, timeout=10)[2].decode()
            assert f'fleetctl_kv_events_total{{backend="{first.url()}",kind="batches"}} 2.0' in text
        finally:
            pub2.close()
    finally:
        s.stop()
        pub.close()
        ctx.term()


def test_kv_events_need_the_state(cli, tmp_path):
    inv = write(tmp_path, INVENTORY)
    backends = write(
        tmp_path,
        "- {url: 'http://127.0.0.1:9', gpu_type: RTX-4090, model: llama-3-8b}\n",
        "backends.yaml",
    )
    r = cli("route-serve", inv, "--backends", backends, "--kv-events", "--listen", "127.0.0.1:9")
    assert r.code == 2 and "backends.yaml" in r.err and "from the state" in r.err, r.err


def test_kv_events_can_be_turned_off_for_route_serve(tmp_path, catalog):
    inv_path = write(tmp_path, INVENTORY + ON)
    inv = load_inventory(inv_path, catalog)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, plan_fleet(inv).deployments))
    common = dict(
        backends_file=None,
        state_dir=sdir,
        policy="hardware-aware",
        config=DaemonConfig(),
        scrape_interval=60.0,
        calibrated=False,
    )
    off = build_router(inv, catalog, use_kv_events=False, **common)  # --no-kv-events
    assert not off.kv_events and off.prefix is not None and off.prefix.learn
    on = build_router(inv, catalog, **common)
    assert on.kv_events and on.prefix is not None and not on.prefix.learn


def _page(size: int) -> str:
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{size}",engine="0",num_gpu_blocks="1000"}} 1.0\n'
    )


def test_prompts_are_hashed_with_the_block_size_the_servers_report(tmp_path, catalog, caplog):
    inv = load_inventory(write(tmp_path, INVENTORY + ON), catalog)
    sdir = StateDir(tmp_path / ".fleetctl")
    sdir.save_state(State(1, plan_fleet(inv).deployments))
    router = build_router(
        inv,
        catalog,
        backends_file=None,
        state_dir=sdir,
        policy="hardware-aware",
        config=DaemonConfig(),
        scrape_interval=60.0,
        calibrated=False,
    )
    live = router.live
    assert live is not None and live.on_block_size is not None
    assert router.tokens.engine_block_size == 16  # until a server says
    a, b, c = router.backends
    for x in (a, b):
        live.apply(x, _page(128), time.monotonic())  # vLLM's CPU backend
    assert router.tokens.engine_block_size == 128 and not caplog.records
    live.apply(c, _page(16), time.monotonic())
    assert router.tokens.engine_block_size == 128  # the most common size
    assert any(
        "different block sizes (1 x 16, 2 x 128 tokens)" in r.message for r in caplog.records
    )
