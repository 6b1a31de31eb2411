"""Memory-bandwidth utilization from a node's dcgm-exporter: the parser on real pages, and
the router's live state reading a real HTTP endpoint (sources: tests/data/dcgm/README.md)."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from fleetctl.daemon.dcgm import parse_dcgm_mem_copy
from fleetctl.daemon.live import LiveState
from fleetctl.fleet.http import Client
from fleetctl.routing.types import Backend
from tests.conftest import DATA

L4 = (DATA / "dcgm" / "dcgm-exporter-l4-driver580-excerpt.txt").read_text()
T4 = (DATA / "dcgm" / "dcgm-exporter-t4-driver590-excerpt.txt").read_text()
# Constructed: the real T4 page with a second GPU (its lines copied, index and value changed),
# for a server spanning two GPUs.
TWO = T4 + "\n".join(
    line.replace('gpu="0"', 'gpu="1"').replace("nvidia0", "nvidia1").rsplit(" ", 1)[0] + " 95"
    for line in T4.splitlines()
    if line.startswith("DCGM_FI_DEV_MEM_COPY_UTIL")
)


def test_parser_reads_the_gpu_label_of_real_pages():
    assert parse_dcgm_mem_copy(T4) == {0: 73.0}
    assert parse_dcgm_mem_copy(L4) == {0: 0.0}  # idle, and HELP/TYPE lines are skipped
    assert parse_dcgm_mem_copy(TWO) == {0: 73.0, 1: 95.0}
    vllm_page = (DATA / "vllm-0.32.0-cpu-metrics.txt").read_text()
    assert parse_dcgm_mem_copy(vllm_page) == {}


class _Page(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_live_state_prefers_fresh_dcgm_and_falls_back_when_stale():
    _Page.body = TWO.encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    one = Backend("http://a:8000", "a", "RTX-4090", "m", "bf16", 1000, gpus=(0,), dcgm_url=url)
    both = Backend("http://a:8001", "a", "RTX-4090", "m", "bf16", 1000, gpus=(0, 1), dcgm_url=url)
    other = Backend("http://a:8002", "a", "RTX-4090", "m", "bf16", 1000, gpus=(5,), dcgm_url=url)
    other.bandwidth_util = 0.2  # what vLLM's counter or the model said
    live = LiveState([one, both, other])

    async def scrape() -> None:
        client = Client(5.0)
        await live.scrape_dcgm(client, url)
        await client.close()

    try:
        asyncio.run(scrape())
    finally:
        server.shutdown()
    at = live.dcgm[url][0]
    live.apply_dcgm([one, both, other], at)
    assert one.bandwidth_util == 0.73
    assert both.bandwidth_util == 0.95  # a TP group is as busy as its busiest GPU
    assert other.bandwidth_util == 0.2  # no reading for its GPU: left alone
    one.bandwidth_util = 0.1
    live.apply_dcgm([one], at + live.stale_after + 0.1)
    assert one.bandwidth_util == 0.1  # stale: not used


def test_the_scrape_loop_applies_a_fresh_dcgm_reading():
    """`LiveState.run`, not only `apply_dcgm` called by hand: after one round of scrapes the
    DCGM figure is the backend's bandwidth utilization."""
    _Page.body = TWO.encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    # The page answers every path: the backend's /metrics reads as a page with no vLLM figures.
    b = Backend(base, "a", "RTX-4090", "m", "bf16", 1000, gpus=(1,), dcgm_url=f"{base}/metrics")
    b.bandwidth_util = 0.2
    live = LiveState([b])

    async def one_round() -> None:
        done = asyncio.Event()
        expire_all = live.expire_all

        def after_a_round(now: float) -> None:  # the loop calls it after applying DCGM
            expire_all(now)
            done.set()

        live.expire_all = after_a_round  # type: ignore[method-assign]
        task = asyncio.create_task(live.run())
        await asyncio.wait_for(done.wait(), 30)
        task.cancel()

    try:
        asyncio.run(one_round())
    finally:
        server.shutdown()
    assert b.bandwidth_util == 0.95


def test_backends_from_state_know_their_gpus_and_dcgm_page(tmp_path, catalog):
    from fleetctl.daemon.backends import backends_from_state
    from fleetctl.fleet.inventory import load_inventory
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir
    from fleetctl.planner import plan_fleet
    from tests.conftest import write

    inv = load_inventory(
        write(
            tmp_path,
            "nodes:\n  - {name: a100-1, host: 10.0.0.5, gpus: {type: A100-SXM4-80GB, count: 2}}\n"
            "models:\n  - {name: llama-3-8b, profile: llama-3-8b, variants: {bf16: {source: x}},"
            " max_context: 8192}\nrouter: {dcgm_exporter_port: 9400}\n",
        ),
        catalog,
    )
    plan = plan_fleet(inv)
    StateDir(tmp_path / ".fleetctl").save_state(State(1, plan.deployments))
    found = backends_from_state(inv, StateDir(tmp_path / ".fleetctl"))
    assert [(b.gpus, b.dcgm_url) for b in found] == [
        (d.gpu_indices, "http://10.0.0.5:9400/metrics") for d in plan.deployments
    ]
