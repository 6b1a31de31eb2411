"""The asyncio task that owns the Engine and runs it in real time, waking each request's stream.

Emulated time is (monotonic - t0) x time_scale. The loop sleeps until the engine's next event,
applies it, and then, once the emulated clock has reached the end of the applied step (a mixed
step is applied at its start but its tokens exist only at its end), pushes every running
request's new tokens (Engine.generated) to that request's queue. Latencies are measured on the
engine's clock, so they describe the modelled GPU, not the event loop's punctuality.

With a KV event publisher, each engine step's prefix cache changes (the pool's `events`) are
handed to it as one batch (fleetctl/emulator/kv_publisher.py).

Sleep mode pauses the driver (fleetctl/emulator/sleep.py): requests in flight are aborted,
as vLLM's default pause mode does, and new ones are parked with their arrival time until the
server wakes, so their first token counts the wait, as vLLM's TTFT does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetctl.emulator.kv_publisher import BlockNames, KvEventPublisher
from fleetctl.emulator.metrics import Recorder
from fleetctl.routing.prefix import PromptBlocks
from fleetctl.sim.engine import DONE, WAITING, Engine, Seq

# What a request's queue carries: (choice index, tokens generated so far), or ABORTED as
# the count when the engine dropped the sequence (the server went to sleep).
Update = tuple[int, int]
ABORTED = -1


@dataclass(eq=False)
class Job:
    """One sequence the server is waiting on (one choice of one HTTP request)."""

    seq: Seq
    index: int
    queue: asyncio.Queue[Update]
    arrival: float
    sent: int = 0  # tokens already pushed to the queue
    scheduled_at: float | None = None
    last_token_at: float = 0.0
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return self.aborted or self.seq.state == DONE


@dataclass
class Driver:
    """Runs `engine` against the wall clock, `time_scale` times faster than real time."""

    engine: Engine
    time_scale: float = 1.0
    recorder: Recorder = field(default_factory=lambda: Recorder(8192))
    t0: float = field(default_factory=time.monotonic)
    # Where the engine's KV events go (the engine must record them: Engine.kv_events).
    publisher: KvEventPublisher | None = None

    def __post_init__(self) -> None:
        self.jobs: dict[Seq, Job] = {}
        self.queued: list[Job] = []  # not yet scheduled once
        self.finished: list[Seq] = []  # finished in the engine, not yet published
        self._wake = asyncio.Event()
        self.names = BlockNames(self.engine.block_size) if self.publisher is not None else None
        self.paused = False
        self.parked: list[tuple[Job, Sequence[int] | None]] = []  # arrived while paused
        # Requests that arrived, by whether the engine was paused then (parked) or not.
        self.arrivals = {"awake": 0, "parked": 0}

    def now(self) -> float:
        """Emulated seconds since start."""
        return (time.monotonic() - self.t0) * self.time_scale

    # --- requests --------------------------------------------------------------------------

    def submit(
        self,
        prompt: int,
        output: int,
        queue: asyncio.Queue[Update],
        index: int,
        blocks: PromptBlocks | None = None,
        ids: Sequence[int] | None = None,
        external: int = 0,
        adapter: str | None = None,
    ) -> Job:
        """Add a sequence at the current emulated time; its tokens will arrive on `queue`.
        `blocks` name its prompt for the prefix cache; `ids` are its token ids, if known;
        `external` prompt tokens arrived as KV from a prefill server (not computed here);
        `adapter` the LoRA adapter it runs (taken at the slots' rank)."""
        now = self.now()
        self._step_until(now)
        seq = Seq(None, prompt, output, blocks)
        seq.external = external
        if adapter is not None and self.engine.lora is not None:
            seq.adapter, seq.rank = adapter, self.engine.lora.max_rank
        job = Job(seq, index, queue, now, last_token_at=now)
        seq.req = job
        self.arrivals["parked" if self.paused else "awake"] += 1
        if self.paused:
            self.parked.append((job, ids))
        else:
            self._admit(job, ids, now)
        return job

    def _admit(self, job: Job, ids: Sequence[int] | None, now: float) -> None:
        seq = job.seq
        self.finished += self.engine.add(seq, now)
        if self.names is not None and seq.keys:
            self.names.describe(seq.keys, ids, self.engine.pool.cached)
        self.jobs[seq] = job
        self.queued.append(job)
        self._wake.set()

    # --- sleep mode --------------------------------------------------------------------------

    def pause(self, clear_cache: bool) -> int:
        """Stop serving: abort every request in the engine (their queues get ABORTED), then
        drop the prefix cache when `clear_cache` (sleep level 1 and 2). Returns how many
        sequences were aborted; requests that arrive from now on are parked."""
        now = self.now()
        self._step_until(now)
        self.finished += self.engine.sync(now)
        self._publish()
        victims = [job for job in self.jobs.values() if not job.finished]
        for job in victims:
            self.abort(job)
            job.queue.put_nowait((job.index, ABORTED))
        self.paused = True
        if clear_cache:
            self.engine.reset_prefix_cache()
            self._flush_events()
        return len(victims)

    def resume(self) -> None:
        """Serve again: parked requests join the engine now, keeping their arrival times."""
        self.paused = False
        now = self.now()
        self._step_until(now)
        parked, self.parked = self.parked, []
        for job, ids in parked:
            if not job.aborted:
                self._admit(job, ids, now)

    def abort(self, job: Job) -> None:
        """The client went away: free the sequence's KV at the next step boundary, as vLLM does.

        Engine has no abort of its own, so this takes the sequence out of its queues here.
        """
        if job.finished:
            return
        if any(job is j for j, _ in self.parked):  # never reached the engine
            self.parked = [(j, i) for j, i in self.parked if j is not job]
            job.aborted = True
            self.recorder.success["abort"] += 1
            return
        now = self.now()
        self._step_until(now)
        self.finished += self.engine.sync(now)
        self._flush_events()
        if job.seq.state != DONE:
            self.engine.abort(job.seq)
        job.aborted = True
        self.jobs.pop(job.seq, None)
        if job in self.queued:
            self.queued.remove(job)
        self.recorder.success["abort"] += 1
        self._wake.set()

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        e = self.engine
        while True:
            self._wake.clear()
            now = self.now()
            if e.clock > now:  # the last applied step's tokens do not exist yet
                await self._sleep(e.clock - now)
                continue
            self._publish()
            t = e.next_event()
            if t is None:
                await self._wake.wait()
            elif t > now:
                await self._sleep(t - now)
            else:
                self._step_until(now)

    async def _sleep(self, emulated: float) -> None:
        """Sleep `emulated` seconds of engine time, or until a request arrives or leaves."""
        try:
            async with asyncio.timeout(emulated / self.time_scale):
                await self._wake.wait()
        except TimeoutError:
            pass

    def _step_until(self, now: float) -> None:
        """Apply every engine event due by `now`, noting when waiting sequences get scheduled."""
        e = self.engine
        while (t := e.next_event()) is not None and t <= now:
            start = e.clock
            self.finished += e.advance(t)
            self._flush_events()
            if self.queued:
                self._note_scheduled(start)
            if e.clock == start and e.next_event() == t:
                break  # a step that changed nothing; do not spin on it

    def _flush_events(self) -> None:
        """Hand the step's prefix cache changes to the publisher as one batch."""
        events = self.engine.pool.events
        if events:
            if self.publisher is not None and self.names is not None:
                self.publisher.publish(self.names.events(events))
            events.clear()

    def _note_scheduled(self, at: float) -> None:
        still = []
        for job in self.queued:
            if job.seq.state == WAITING:
                still.append(job)
            else:
                job.scheduled_at = at
        self.queued = still

    def _publish(self) -> None:
        """Push the new tokens of every running or just finished sequence; record the latter.

        Only those can have new tokens: waiting ones have not started or were preempted.
        """
        at = self.engine.clock
        for seq in (*self.engine.running, *self.finished):
            job = self.jobs.get(seq)
            n = self.engine.generated(seq)
            if job is not None and n > job.sent:
                self._record_tokens(job, n, at)
                job.sent = n
                job.queue.put_nowait((job.index, n))
        for seq in self.finished:
            if seq in self.jobs:
                self._record_finish(self.jobs.pop(seq))
        self.finished.clear()

    # --- metrics ---------------------------------------------------------------------------

    def _record_tokens(self, job: Job, n: int, at: float) -> None:
        rec = self.recorder
        new = n - job.sent
        if job.sent == 0:
            first = job.seq.first_token_at if job.seq.first_token_at is not None else at
            rec.observe("time_to_first_token_seconds", first - job.arrival)
            job.last_token_at = first
            new -= 1
        if new > 0:
            # A run of decode steps delivered `new` tokens since the last one: spread evenly.
            rec.observe("inter_token_latency_seconds", (at - job.last_token_at) / new, new)
            job.last_token_at = at

    def _record_finish(self, job: Job) -> None:
        rec, seq = self.recorder, job.seq
        end = seq.finished_at if seq.finished_at is not None else self.engine.clock
        first = seq.first_token_at if seq.first_token_at is not None else end
        scheduled = job.scheduled_at if job.scheduled_at is not None else job.arrival
        rec.success["length"] += 1
        rec.observe("e2e_request_latency_seconds", end - job.arrival)
        rec.observe("request_queue_time_seconds", scheduled - job.arrival)
        rec.observe("request_prefill_time_seconds", first - scheduled)
        rec.observe("request_decode_time_seconds", end - first)
        rec.observe("request_inference_time_seconds", end - scheduled)
        if seq.output > 1:
            rec.observe("request_time_per_output_token_seconds", (end - first) / (seq.output - 1))
        rec.observe("request_prompt_tokens", seq.prompt)
        rec.observe("request_generation_tokens", seq.output)
        rec.observe("request_num_preemptions", seq.preemptions)
        # vLLM: "new KV tokens computed during prefill (excluding cached tokens)". Counting
        # the prefix-cache hits here made calibrate read 8.6x the GPU's prefill speed.
        rec.observe("request_prefill_kv_computed_tokens", seq.prompt - seq.cached)
