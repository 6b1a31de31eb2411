"""What routing decides over: a request, a backend snapshot, and a structured decision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleetctl.model.perf import EnginePerf
from fleetctl.routing.prefix import PromptBlocks

# Precision hints name a format or a family of formats.
# A disaggregated model's two phases: a Backend's role (else "both") and a Decision's kind.
PREFILL, DECODE = "prefill", "decode"
# A server's state as routing sees it (Backend.state): serving; asleep in vLLM's sleep mode
# (level 1 or 2); waking from it or starting, until `ready_at`; or draining before it sleeps
# or stops (what it runs finishes, nothing new goes there).
AWAKE, ASLEEP, WAKING, STARTING, DRAINING = "awake", "asleep", "waking", "starting", "draining"
STATES = (AWAKE, ASLEEP, WAKING, STARTING, DRAINING)
PRECISION_FAMILIES = {
    "int4": ("gptq-int4", "awq-int4"),
    "int8": ("int8",),
    "fp8": ("fp8",),
    "bf16": ("bf16",),
    "fp16": ("fp16",),
    "16bit": ("bf16", "fp16"),
}


def precision_matches(hint: str, variant: str) -> bool:
    """A hint names a format (`gptq-int4`), a family (`int4`), or a format's stem: `fp8`
    also matches `fp8-per-channel`."""
    hint = hint.lower()
    return (
        variant == hint
        or variant.startswith(hint + "-")
        or variant in PRECISION_FAMILIES.get(hint, ())
    )


@dataclass(slots=True)
class Request:
    """A request as routing sees it; times are seconds on the caller's clock."""

    id: int | str
    model: str
    prompt_tokens: int
    output_tokens: int  # max_tokens, or the model's estimate when the client gave none
    priority: int = 0  # as vLLM's `priority`: lower is more urgent; 0 is the top class
    session: str | None = None
    precision: str | None = None
    strict: bool = False
    arrival: float = 0.0
    boosted: bool = False  # aging raised it to the top class
    prompt_chars: int = 0  # characters of prompt text, to calibrate the token estimate
    # Backends (by name) a retry must avoid: the ones that already failed this request.
    exclude: frozenset[str] = frozenset()
    # What the client asked for as max_tokens (None: vLLM fills the context).
    max_tokens: int | None = None
    # The prompt as chained block hashes, when known: prefix-cache-aware policies match them.
    blocks: PromptBlocks | None = None
    # Prompt tokens its backend is expected to find cached (set when it is placed): the
    # backend's pending prefill counts only the rest.
    cached_tokens: int = 0
    # The LoRA adapter it names as its model ("" for the base model, which `model` names):
    # only servers of the base model with the adapter loaded may take it.
    adapter: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens its backend will compute."""
        return self.prompt_tokens - self.cached_tokens

    @property
    def context_needed(self) -> int:
        """The shortest max_model_len that accepts it: vLLM refuses prompt + max_tokens over
        it, and a prompt without max_tokens needs room for one token."""
        return self.prompt_tokens + (self.max_tokens or 1)


@dataclass(slots=True)
class Backend:
    """One vLLM server with what the router knows of it right now."""

    name: str
    node: str
    gpu_type: str
    model: str
    variant: str
    kv_tokens: int
    max_num_seqs: int = 256
    perf: EnginePerf | None = None
    max_model_len: int = 0  # its --max-model-len; 0: unknown (then length does not filter)
    healthy: bool = True
    # Scraped from the server's /metrics (or read from the simulated engine).
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    bandwidth_util: float = 0.0
    compute_util: float = 0.0
    # Kept by the router for what it sent there.
    outstanding: int = 0
    reserved_tokens: int = 0  # prompt + expected output of everything in flight
    # Prompt tokens the router expected it to find cached, over all it sent (a counter), and
    # the share of that it really found, learned from its vllm:prompt_tokens_cached_total.
    cached_sent: int = 0
    prefix_trust: float = 1.0
    pending_prefill: int = 0  # prompt tokens in flight that have not produced a token yet
    # Those prompts' modelled prefill seconds, each at its own length: attention makes a
    # 100K-token prompt's tokens three times dearer than a 2K chunk's (routing/goodput.py).
    pending_prefill_s: float = 0.0
    # Prompt tokens to compute sent here per second lately (scheduler.PREFILL_WINDOW_S), as
    # of `rate_at`: how much of its time the GPU will spend on prefill chunks.
    prefill_rate: float = 0.0
    rate_at: float = 0.0
    # Its --max-num-batched-tokens (the prefill tokens a step can carry); 0: unknown.
    max_num_batched_tokens: int = 0
    # Set for a node whose driver, CUDA or vLLM differs from its class (`fleetctl health`):
    # it then forms a class of its own, so sessions never mix it with the others.
    class_tag: str = ""
    # The GPU indices on its node, and that node's dcgm-exporter /metrics URL, when known:
    # DCGM then gives the measured memory-bandwidth utilization (fleetctl/daemon/live.py).
    gpus: tuple[int, ...] = ()
    dcgm_url: str = ""
    # The name its /v1/models lists when that is not `model` (a backends file's served_name):
    # the router renames a request's model to it on the way there.
    served_name: str = ""
    # The LoRA adapters it has loaded: its --lora-modules, then what its /v1/models lists
    # and its vllm:lora_requests_info names (fleetctl/daemon/adapters.py).
    adapters: frozenset[str] = frozenset()
    # Its newest vllm:lora_requests_info: adapters with requests running and waiting (in its
    # GPU slots), and its --max-loras; 0 when it reports none.
    lora_running: frozenset[str] = frozenset()
    lora_waiting: frozenset[str] = frozenset()
    lora_max: int = 0
    # Its --max-lora-rank, the rank its slots run at (model/lora.py); 0: unknown.
    lora_rank: int = 0
    # "both" (prefill and decode), or one phase of a disaggregated model: "prefill" or
    # "decode" (routing/phases.py).
    role: str = "both"
    # Its state (STATES): only an awake server takes requests at once; a waking or starting
    # one serves from `ready_at` (the router's clock), an asleep one after a wake of about
    # `wake_s` seconds (model/startup.wake_seconds for its class and `sleep_level`; None:
    # unknown), which may be asked of it only when `wakeable` (started with
    # --enable-sleep-mode). `healthy` stays whether it is reachable: a sleeper is healthy.
    state: str = AWAKE
    ready_at: float = 0.0
    wake_s: float | None = None
    sleep_level: int = 0
    wakeable: bool = False

    @property
    def node_class(self) -> str:
        """Servers of a class answer alike: same GPU type and same weight format."""
        base = f"{self.gpu_type}/{self.variant}"
        return f"{base}/{self.class_tag}" if self.class_tag else base


def can_serve(b: Backend) -> bool:
    """Whether `b` serves requests now or after a warm-up the router may wait for: awake,
    waking or starting, or asleep with sleep mode on (a wake may be asked). A draining one
    takes nothing new."""
    return b.state in (AWAKE, WAKING, STARTING) or (b.state == ASLEEP and b.wakeable)


def held_gpus(backends: Sequence[Backend]) -> dict[tuple[str, int], set[str]]:
    """Each (node, GPU index) held by a server (awake, waking, starting or draining), and the
    names of the servers holding it: a sleeper on one of them cannot wake (vLLM's wake takes
    back what sleep freed, and fails out of memory). Servers whose GPUs are unknown hold none.
    Built once per request, not once per sleeper: the router's hot path."""
    held: dict[tuple[str, int], set[str]] = {}
    for o in backends:
        if o.healthy and o.state != ASLEEP:
            for g in o.gpus:
                held.setdefault((o.node, g), set()).add(o.name)
    return held


def gpus_held(b: Backend, held: dict[tuple[str, int], set[str]]) -> bool:
    """Whether another server holds a GPU of sleeper `b` (`held`: held_gpus of the fleet)."""
    return any(held.get((b.node, g), set()) - {b.name} for g in b.gpus)


def warmup_s(b: Backend, now: float | None) -> float:
    """Seconds before `b` could start on a request sent now: 0 awake; what is left of a wake
    or start under way (`ready_at - now`; its expected wake without a clock); an asleep one's
    whole wake (`wake_s`; 0 where unknown)."""
    if b.state in (WAKING, STARTING):
        if now is None:
            return b.wake_s or 0.0
        return max(0.0, b.ready_at - now)
    if b.state == ASLEEP:
        return b.wake_s or 0.0
    return 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why, as fields. `label` is the bounded part (metrics count
    requests by it); `reason` renders every field for people."""

    backend: Backend | None
    kind: str  # the policy's name; "rejected" for a request that can never be served
    notes: tuple[str, ...] = ()  # bounded words, e.g. "affinity:class", "length:short"
    detail: str = ""  # a measured value, for people only, e.g. "(3)" outstanding requests
    ttft_s: float | None = None  # the policy's estimate of seconds to the first token
    tpot_s: float | None = None  # ... and of seconds per output token after it
    reject: bool = False  # the request cannot be served as asked (with `down`: not now)
    down: bool = False  # its model's servers are all out of routing: the router's fault, 503
    message: str = ""  # a rejection's explanation, for the client
    # What the policy learned of the request on the way, for `Policy.placed`: the prompt
    # tokens `backend` holds of it (when `looked_up`), and whether only some of its model's
    # classes could take it (the work it brings is exclusive to them).
    cached_tokens: int = 0
    looked_up: bool = False
    exclusive: bool = False

    @classmethod
    def rejected(cls, message: str, down: bool = False) -> Decision:
        return cls(None, "rejected", reject=True, message=message, down=down)

    @property
    def label(self) -> str:
        return " ".join((self.kind, *self.notes))

    @property
    def reason(self) -> str:
        if self.reject:
            return self.message
        parts = [self.label]
        if self.detail:
            parts.append(self.detail)
        if self.ttft_s is not None:
            parts.append(f"ttft~{self.ttft_s:.3f}s")
        if self.tpot_s is not None:
            parts.append(f"tpot~{self.tpot_s * 1000:.1f}ms")
        return " ".join(parts)


class OutputEstimator:
    """Expected output tokens per model for requests without max_tokens: starts from the
    inventory's workload and follows what the model really generates (moving average)."""

    DEFAULT = 256

    def __init__(self, initial: dict[str, int] | None = None, alpha: float = 0.02):
        self.means = {m: float(v) for m, v in (initial or {}).items()}
        self.alpha = alpha

    def estimate(self, model: str) -> int:
        return max(1, round(self.means.get(model, self.DEFAULT)))

    def observe(self, model: str, tokens: int) -> None:
        mean = self.means.get(model)
        self.means[model] = float(tokens) if mean is None else mean + self.alpha * (tokens - mean)
