"""LoRA on a model's servers: the slots each GPU type starts with and what loads where."""

from __future__ import annotations

from dataclasses import dataclass

from fleetctl.fleet.inventory import LORA_RANKS, Adapter, Model
from fleetctl.fleet.plan import LoraUse
from fleetctl.model.catalog import FormatProfile, ModelProfile
from fleetctl.model.lora import LoraMix
from fleetctl.model.perf import EnginePerf, GiB, lora_slot_bytes

# vLLM batches requests of this many adapters at once by default here (its own default is 1,
# which serialises every second adapter behind the first); a slot costs memory on every GPU.
DEFAULT_MAX_LORAS = 4
# The variable that opens vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class Slots:
    """How a server of one GPU type runs LoRA: vLLM's flags and what it loads at start."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    preloaded: tuple[Adapter, ...]
    runtime: bool

    def args(self) -> tuple[str, ...]:
        """`vllm serve` flags; each adapter as `name=path` (names and paths passed the
        inventory's grammars, and apply quotes every word at the edge)."""
        out = ["--enable-lora", "--max-loras", str(self.max_loras)]
        out += ["--max-lora-rank", str(self.max_lora_rank)]
        out += ["--max-cpu-loras", str(self.max_cpu_loras)]
        if self.preloaded:
            out += ["--lora-modules", *(f"{a.name}={a.spec.source}" for a in self.preloaded)]
        return tuple(out)

    def env(self) -> dict[str, str]:
        return {RUNTIME_ENV: "True"} if self.runtime else {}

    def reason(self, slot_bytes: int, perf: EnginePerf) -> str:
        """Why the server runs LoRA as it does, among the plan's reasons."""
        given = slot_bytes // perf.kv_token_bytes
        loaded = ", ".join(a.name for a in self.preloaded) or "none"
        runtime = "; the others load at runtime" if self.runtime else ""
        return (
            f"LoRA: {self.max_loras} slots of rank {self.max_lora_rank} take "
            f"{slot_bytes / GiB:.2f} GiB a GPU ({given:,} KV tokens); loaded at start: "
            f"{loaded}{runtime}"
        )

    def slot_bytes(self, profile: ModelProfile, fmt: FormatProfile, tp: int) -> int:
        # vLLM's lora_dtype "auto" is the model's dtype: the format's activations.
        return lora_slot_bytes(
            profile, self.max_loras, self.max_lora_rank, tp, fmt.activation_bytes
        )


def demand(a: Adapter) -> float:
    return a.spec.workload.requests_per_s if a.spec.workload else 0.0


def eligible(model: Model, gpu_type: str) -> tuple[Adapter, ...]:
    """The adapters a server of `gpu_type` may load, most requested first (then by name)."""
    fit = [a for a in model.adapters if not a.gpu_types or gpu_type in a.gpu_types]
    return tuple(sorted(fit, key=lambda a: (-demand(a), a.name)))


def slots(model: Model, gpu_type: str) -> Slots | None:
    """LoRA for `model`'s servers on `gpu_type`; None where no adapter may load there.

    Without runtime loading every adapter the server may serve is loaded at start (a
    request for one it lacks would fail); with it, only the `max_loras` most requested,
    the rest loaded by name when asked. The rank is the smallest vLLM takes that holds the
    largest adapter; the CPU cache holds every adapter loaded at start."""
    fit = eligible(model, gpu_type)
    if not fit:
        return None
    spec = model.spec
    max_loras = spec.max_loras or min(len(fit), DEFAULT_MAX_LORAS)
    top = max(a.spec.rank for a in fit)
    rank = next(r for r in LORA_RANKS if r >= top)
    runtime = spec.adapters_runtime
    preloaded = fit[:max_loras] if runtime else fit
    return Slots(max_loras, rank, max(max_loras, len(preloaded)), preloaded, runtime)


def mix(model: Model, gpu_type: str, dtype_bytes: int) -> LoraMix | None:
    """The adapters a server of `model` on `gpu_type` runs, for its expected step
    (model/lora.py): each adapter it may load at its stated demand's share of the model's
    requests; the requests no stated demand accounts for spread evenly over the adapters
    without one (none left to the base model, the costlier guess), else the base model's;
    shares of the requests the server may take (the base model's and its adapters'). None
    where it runs no LoRA."""
    s = slots(model, gpu_type)
    if s is None:
        return None
    known = sum(demand(a) for a in model.adapters)
    w = model.spec.workload
    total = max(w.requests_per_s if w else 0.0, known) or 1.0
    unstated = [a for a in model.adapters if not demand(a)]
    rest = max(0.0, 1.0 - known / total)
    share = {a.name: demand(a) / total for a in model.adapters}
    for a in unstated:
        share[a.name] = rest / len(unstated)
    base = 0.0 if unstated else rest
    mine = [share[a.name] for a in eligible(model, gpu_type)]
    served = base + sum(mine)
    if served <= 0:
        return None
    return LoraMix.of((p / served for p in mine), s.max_loras, s.max_lora_rank, dtype_bytes)


def env_of(model: Model, gpu_type: str) -> dict[str, str]:
    """The variables the plan adds for LoRA to a server of `model` on `gpu_type`."""
    s = slots(model, gpu_type)
    return s.env() if s is not None else {}


def server(
    model: Model,
    gpu_type: str,
    slot_bytes: int,
    perf: EnginePerf,
    tail: list[str],
    env: dict[str, str],
    reasons: tuple[str, ...],
) -> tuple[list[str], tuple[str, ...]]:
    """A server's arguments and reasons with its LoRA flags, its environment (in place) with
    the runtime-loading variable where the plan wants it; as they were without adapters."""
    s = slots(model, gpu_type)
    if s is None:
        return tail, reasons
    env.update(s.env())
    return [*tail, *s.args()], (*reasons, s.reason(slot_bytes, perf))


def use(model: Model, gpu_type: str, fmt: FormatProfile, tp: int, kv_token_bytes: int) -> LoraUse:
    s = slots(model, gpu_type)
    assert s is not None
    per_gpu = s.slot_bytes(model.profile, fmt, tp)
    return LoraUse(
        gpu_type,
        s.max_loras,
        s.max_lora_rank,
        s.max_cpu_loras,
        per_gpu,
        per_gpu // kv_token_bytes if kv_token_bytes else 0,
        tuple(a.name for a in s.preloaded),
        s.runtime,
    )


NONE = Slots(0, 0, 0, (), False)
