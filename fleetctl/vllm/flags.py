"""The flags a vLLM release's `vllm serve` knows, read from its `--help=all`, and the check of
an inventory's `vllm_args` against them and against what the plan pins."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetctl.base.errors import did_you_mean, shown

# Flags the plan sets itself, each with the inventory field that controls it instead. A
# vllm_args copy would make vLLM differ from what fleetctl planned, health-checks and routes to.
PINNED: dict[str, str] = {
    "--port": "the plan gives each server its port: set planner.port_base",
    "--host": "apply sets it",
    "--uds": "the router reaches servers over TCP: leave it out",
    "--model": "set the variant's 'source'",
    "--served-model-name": "set the model's 'name'",
    "--revision": "set the variant's 'revision'",
    "--tensor-parallel-size": "the planner picks it: limit GPUs with 'placement'",
    "--pipeline-parallel-size": "the planner places one server per GPU group: leave it out",
    "--data-parallel-size": "set min_replicas / max_replicas",
    "--data-parallel-size-local": "set min_replicas / max_replicas",
    "--max-model-len": "set the model's 'max_context'",
    "--gpu-memory-utilization": "set the model's or planner's 'gpu_memory_utilization'",
    "--quantization": "name the format as the key under 'variants'",
    "--dtype": "name the format as the key under 'variants'",
    "--kv-cache-dtype": "set the model's 'kv_cache_dtype'",
    "--max-num-seqs": "the planner sizes it from the KV budget: leave it out",
    "--max-num-batched-tokens": "set planner.max_num_batched_tokens",
    "--enforce-eager": "set planner.enforce_eager",
    "--api-key": "list VLLM_API_KEY in apply.secrets (never on a command line)",
    "--config": "write the flags in vllm_args (a config file could set any pinned flag)",
    "--headless": "every server fleetctl starts serves HTTP: leave it out",
    "--kv-events-config": "set router.prefix_cache.kv_events (each server gets its own ports)",
}

# Flags the plan sets on the servers of a model with LoRA adapters (planner/lora.py).
LORA_PINNED: dict[str, str] = {
    "--enable-lora": "list the model's 'adapters': the plan enables LoRA where they load",
    "--max-loras": "set the model's 'max_loras'",
    "--max-lora-rank": "set each adapter's 'rank': the plan takes the smallest that holds all",
    "--max-cpu-loras": "the plan sizes it from the adapters each server loads: leave it out",
    "--lora-modules": "list the model's 'adapters' (name, source, rank)",
}

_OPTION_LINE = re.compile(r"^  (-[^\s].*?)(?:\s{2,}|$)")


@dataclass(frozen=True)
class Flag:
    name: str  # the canonical long name, e.g. --tensor-parallel-size
    takes_value: bool
    many: bool  # nargs='+': values run until the next option


@dataclass
class ServeFlags:
    """What one release's `vllm serve` accepts: every spelling, mapped to its flag."""

    version: str
    spellings: dict[str, Flag] = field(default_factory=dict)

    def lookup(self, spelling: str) -> Flag | None:
        # vLLM's parser reads --max_model_len as --max-model-len.
        if spelling.startswith("--"):
            spelling = "--" + spelling[2:].replace("_", "-")
        found = self.spellings.get(spelling)
        if found is None and spelling.startswith("--") and "." in spelling:
            # --compilation-config.mode 3: a key inside a JSON-valued flag
            head = self.spellings.get(spelling.split(".", 1)[0])
            if head is not None and head.takes_value:
                return Flag(spelling, True, False)
        return found


def parse_help(text: str, version: str) -> ServeFlags:
    """Read `vllm serve --help=all`: each option line names its spellings and any metavar."""
    out = ServeFlags(version)
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        if not m:
            continue
        parts = [p.strip() for p in re.split(r",\s+(?=-)", m.group(1))]
        names = [p.split()[0] for p in parts]
        takes_value = any(len(p.split(maxsplit=1)) > 1 for p in parts)
        many = "..." in m.group(1)
        canonical = next(
            (n for n in names if n.startswith("--") and not n.startswith("--no-")), names[0]
        )
        flag = Flag(canonical, takes_value, many)
        for n in names:
            out.spellings[n] = flag
    return out


def check_args(
    args: tuple[str, ...] | list[str],
    flags: ServeFlags,
    pinned_too: Mapping[str, str] | None = None,
) -> None:
    """Raise ValueError("what | fix") for the first argument vLLM would not take as given,
    or that would override what the plan pins (PINNED, and `pinned_too` for this model)."""
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise ValueError(
                f"vllm_args[{i - 1}] {shown(arg)} is not an option | the model comes from the "
                "variant's 'source'; every vllm_args item is a --flag or its value"
            )
        spelling, eq, _ = arg.partition("=")
        flag = flags.lookup(spelling)
        if flag is None:
            known = [s for s in flags.spellings if s.startswith("--")]
            hint = did_you_mean(spelling, known)
            fix = f"did you mean {hint}?" if hint else "see `vllm serve --help=all`"
            raise ValueError(
                f"vllm_args[{i - 1}] {shown(spelling)} is not a flag of vLLM {flags.version} "
                f"| {fix}"
            )
        name = flag.name.split(".", 1)[0]
        pinned = PINNED.get(name) or (pinned_too or {}).get(name)
        if pinned is not None:
            raise ValueError(f"vllm_args[{i - 1}] {shown(spelling)} is set by the plan | {pinned}")
        if not flag.takes_value or eq:
            continue
        if i >= len(args):
            raise ValueError(f"vllm_args: {spelling} needs a value | add it as the next item")
        i += 1  # its value, whatever it looks like (e.g. --seed -1)
        while flag.many and i < len(args) and not args[i].startswith("-"):
            i += 1
