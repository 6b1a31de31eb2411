"""The calibration's users: what plan, route-serve, simulate and status take from an entry."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetctl.calibration import Entry, Figure, Key, Sample, entry_for, measured, speed_factor
from fleetctl.perf import EnginePerf

KEY = Key("RTX-4090", "llama-3-8b", "bf16", 1, None, 8192)
SERVERS = ["http://a:8000", "http://b:8000", "http://c:8000"]
AT = "2026-12-01T10:20:31+00:00"


@pytest.fixture(scope="module")
def perf(catalog):
    return EnginePerf(
        catalog.gpu("RTX-4090"), catalog.model("llama-3-8b"), catalog.format("bf16"), 1
    )


def servers_at(perf: EnginePerf, speed: float, batches=(2, 4, 8, 12)) -> list[Sample]:
    """Windows of servers whose GPU runs at `speed` times the model's, at 512-token contexts."""
    slow = replace(perf, speed=speed)
    return [
        Sample(batch=b, step_s=slow.step_time(b, b * 512), tokens=400, requests=4, context=512)
        for b in batches
    ]


def entry_of(perf: EnginePerf, samples: list[Sample], kv=(20_000,), util=0.9) -> Entry:
    return entry_for(KEY, SERVERS, samples, list(kv), AT, None, perf, 47_024, util)


def test_the_speed_factor_recovers_a_slower_gpu(perf):
    e = entry_of(perf, servers_at(perf, 0.7))
    assert speed_factor(e, perf) == pytest.approx(0.7, rel=0.05)
    assert speed_factor(entry_of(perf, servers_at(perf, 1.0)), perf) == pytest.approx(1, rel=0.02)
    # The factor scales the GPU work only: the model with it predicts the measured step.
    speed = speed_factor(e, perf)
    assert speed is not None
    fitted = replace(perf, speed=speed)
    assert e.step is not None
    assert fitted.step_time(8, 8 * 512) == pytest.approx(e.step.at(8), rel=0.03)


def test_measured_takes_only_trusted_figures_and_says_from_what(perf):
    e = entry_of(perf, servers_at(perf, 0.7))
    m = measured(e, perf, 0.9)
    assert m is not None
    assert m.kv_tokens == 20_000
    assert m.speed == pytest.approx(0.7, rel=0.05)
    assert m.provenance.startswith("calibrated from 3 servers, 2026-12-01 10:20 (KV 20,000")
    flagged = Figure(1.0, 2.0, False, "implausible")
    no_kv = measured(replace(e, kv_tokens=flagged), perf, 0.9)
    assert no_kv is not None and no_kv.kv_tokens is None and no_kv.speed == m.speed
    no_step = measured(replace(e, step_at_batch=flagged), perf, 0.9)
    assert no_step is not None and no_step.speed is None and no_step.kv_tokens == 20_000
    assert measured(replace(e, step_at_batch=flagged, kv_tokens=flagged), perf) is None
    # Too few windows: the fit is not trusted, so no speed.
    few = entry_of(perf, servers_at(perf, 0.7, (2, 6)))
    assert speed_factor(few, perf) is None


def test_measured_kv_moves_with_the_utilization(perf):
    e = entry_of(perf, servers_at(perf, 1.0))
    same, more = measured(e, perf, 0.9), measured(e, perf, 0.95)
    assert same is not None and more is not None
    assert same.kv_tokens == 20_000
    assert more.kv_tokens is not None and more.kv_tokens > 20_000
    assert more.provenance.endswith("; KV moved from gpu_memory_utilization 0.9 to 0.95")
