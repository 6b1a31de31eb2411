"""Parse `fleetctl emulate`'s own flags together with the `vllm serve` flags a shim forwards."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from fleetctl.base.errors import UserError
from fleetctl.vllm.hashing import ALGOS, DEFAULT_ALGO

# Flags we read; every other `--flag` is one of vLLM's hundreds and is ignored with a warning.
PROG = "fleetctl emulate"


@dataclass
class EmulatorArgs:
    """The parsed command line: what to emulate, vLLM's serve flags, and the fault switches."""

    gpu: str
    model: str
    variant: str | None = None
    source: str | None = None
    profiles: list[Path] = field(default_factory=list)
    time_scale: float = 1.0
    truth_speed: float = 1.0
    truth_kv: float = 1.0
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    quantization: str | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.92
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    api_key: list[str] = field(default_factory=list)
    enforce_eager: bool = False
    revision: str | None = None
    seed: int = 0
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str = "sha256"
    kv_events_config: str | None = None
    kv_transfer_config: str | None = None
    kv_link_gbps: float = 100.0
    kv_link_rdma: bool = False
    startup_delay: float = 0.0
    crash_after: int | None = None
    hang_after: int | None = None
    error_rate: float = 0.0
    die_mid_stream: int | None = None
    enable_sleep_mode: bool = False
    gpu_ledger: Path | None = None
    enable_lora: bool = False
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_modules: list[str] = field(default_factory=list)
    max_cpu_loras: int | None = None
    lora_load_seconds: float | None = None


_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """vLLM's human-readable integers: '1k' is 1,000, '1K' is 1,024, '25.6k' is 25,600."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    value = float(m.group(1)) * _SUFFIX.get(m.group(2), 1)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line in the project's style (exit code 2) instead of argparse's usage dump.
        raise UserError(f"emulate: {message}", None, f"see `{PROG} --help`")


def _parser() -> _Parser:
    p = _Parser(
        prog=PROG,
        description="Serve one emulated vLLM 0.32 OpenAI-compatible server on a modelled GPU. "
        "Accepts `vllm serve` flags; unknown ones are ignored with a warning.",
        allow_abbrev=False,
    )
    own = p.add_argument_group("emulation")
    own.add_argument("--gpu", required=True, help="GPU profile name or nvidia-smi alias")
    own.add_argument("--model", required=True, help="model profile name (profiles/models)")
    own.add_argument("--variant", help="quantization format (default: from --quantization/--dtype)")
    own.add_argument(
        "--profiles",
        type=Path,
        action="append",
        default=[],
        help="a profiles folder (gpus/, models/, formats/) whose profiles override the bundled "
        "ones by name: the emulator's truth may differ from what the planner and router assume",
    )
    own.add_argument("--time-scale", type=float, default=1.0, help="run the engine X times faster")
    own.add_argument(
        "--truth-speed",
        type=float,
        default=1.0,
        help="the GPU runs X times as fast as its profile (0.7: every step takes 1/0.7 as long)",
    )
    own.add_argument(
        "--truth-kv",
        type=float,
        default=1.0,
        help="the GPU holds X of the KV cache its profile leaves (less memory, same reserves)",
    )
    own.add_argument(
        "--kv-link-gbps",
        type=float,
        default=100.0,
        help="the network a decode server pulls KV caches over, Gb/s (with --kv-transfer-config)",
    )
    own.add_argument(
        "--kv-link-rdma", action="store_true", help="that network has RDMA (RoCE, InfiniBand)"
    )
    own.add_argument(
        "--gpu-ledger",
        type=Path,
        metavar="DIR",
        help="emulators given the same folder share one GPU's memory: a wake from sleep that "
        "would not fit beside the others fails out of memory",
    )
    own.add_argument(
        "--lora-load-seconds",
        type=float,
        default=None,
        metavar="S",
        help="emulated seconds one runtime adapter load takes (POST /v1/load_lora_adapter, "
        "served with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); default: the "
        "performance model's read of an adapter of --max-lora-rank from disk",
    )
    faults = p.add_argument_group("faults")
    faults.add_argument(
        "--startup-delay", type=float, default=0.0, help="wall seconds of 503s first (unscaled)"
    )
    faults.add_argument("--crash-after", type=int, help="exit 1 after N completed requests")
    faults.add_argument(
        "--hang-after", type=int, help="after N completion requests, never answer anything"
    )
    faults.add_argument("--error-rate", type=float, default=0.0, help="fraction answered 500")
    faults.add_argument("--die-mid-stream", type=int, help="the N-th stream drops its connection")
    vllm = p.add_argument_group("vllm serve")
    vllm.add_argument("source", nargs="?", help="model path or Hugging Face id")
    vllm.add_argument("--host", default="127.0.0.1")
    vllm.add_argument("--port", type=int, default=8000)
    vllm.add_argument("--served-model-name", nargs="+", default=[])
    vllm.add_argument("--quantization", "-q")
    vllm.add_argument("--dtype", default="auto")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    vllm.add_argument("--max-model-len", type=human_int)
    vllm.add_argument(
        "--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.92
    )
    vllm.add_argument("--kv-cache-dtype", default="auto")
    vllm.add_argument("--max-num-seqs", type=human_int)
    vllm.add_argument("--max-num-batched-tokens", type=human_int)
    vllm.add_argument("--api-key", nargs="+", default=[])
    vllm.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    vllm.add_argument("--revision")
    vllm.add_argument("--seed", type=int, default=0)
    vllm.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None
    )
    vllm.add_argument("--prefix-caching-hash-algo", choices=ALGOS, default=DEFAULT_ALGO)
    vllm.add_argument("--kv-events-config", metavar="JSON")
    vllm.add_argument("--kv-transfer-config", metavar="JSON")
    vllm.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False)
    vllm.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False)
    vllm.add_argument("--max-loras", type=int)
    vllm.add_argument("--max-lora-rank", type=int)
    vllm.add_argument("--max-cpu-loras", type=int)
    vllm.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH")
    vllm.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def _known_flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _normalize(token: str) -> str:
    """vLLM accepts `--max_model_len` as well as `--max-model-len`."""
    if not token.startswith("--"):
        return token
    name, eq, value = token.partition("=")
    return name.replace("_", "-") + eq + value


def split_unknown(argv: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Separate the flags we parse from vLLM flags we do not know (and their values).

    An unknown `--flag` takes the next token as its value unless that token is a flag: vLLM's
    usage puts the model source first, so a bare word after an unknown flag is its value.
    """
    ours: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        token = _normalize(argv[i])
        name = token.split("=", 1)[0]
        unknown = token.startswith("-") and name not in known and token not in ("-h", "--help")
        if not unknown:
            ours.append(token)
            i += 1
            continue
        takes_value = "=" not in token and i + 1 < len(argv) and not argv[i + 1].startswith("-")
        ignored.append(f"{token} {argv[i + 1]}" if takes_value else token)
        i += 2 if takes_value else 1
    return ours, ignored


def parse_args(argv: list[str]) -> tuple[EmulatorArgs, list[str]]:
    """The emulator's arguments and the unknown vLLM flags that were ignored."""
    p = _parser()
    ours, ignored = split_unknown(argv, _known_flags(p))
    ns = p.parse_args(ours)
    del ns.debug
    args = EmulatorArgs(**vars(ns))
    if not args.api_key and os.environ.get("VLLM_API_KEY"):
        args.api_key = [os.environ["VLLM_API_KEY"]]
    return args, ignored
