"""Calibration from the live fleet: what running vLLM servers measure, fitted and kept per class.

Pure core: parse one /metrics page into the counters that matter, turn two scrapes of a server
into one window sample, fit the decode step model `step = fixed_s + per_seq_s x running` over
the samples, and check each figure against the performance model's for the same server. The
store (`Calibration`) is what `.fleetctl/calibration.json` holds; `fleetctl calibrate` writes it
and `fleetctl estimate` reads it (fleet/statedir.py owns the file). `measured` turns an entry
into what plan, route-serve, simulate and status use in place of the model's figures.

The package, by what each part owns: `rules` (what counts as a measurement), `window` (two
scrapes, one sample), `fit` (the step model), `figures` (each figure beside the model's),
`key` (class keys and the best match), `store` (the file's entries and start-ups), `startup`
(start-up times), `apply` (what users take from an entry), `reading` (the command's table).

Metric names are vLLM 0.32's, checked against a real server's page
(shared/captures/vllm-0.32.0-cpu-metrics.txt). Latency histograms are observed when a request
finishes (prefill time, prompt tokens) or as tokens stream out (inter-token latency), so the
figures are deltas of `_sum`/`_count` between two scrapes, never the totals since start-up.
"""

from __future__ import annotations

from fleetctl.model.calibration.apply import (
    REFERENCE_BATCHES,
    Calibrated,
    EngineFit,
    Measured,
    beside_model,
    beside_model_text,
    calibrated,
    engine_fit,
    measured,
    speed_factor,
)
from fleetctl.model.calibration.figures import Figure, Figures, measure
from fleetctl.model.calibration.fit import StepModel, fit_step
from fleetctl.model.calibration.key import Key
from fleetctl.model.calibration.reading import ServerReading
from fleetctl.model.calibration.rules import (
    CALIBRATION_FORMAT,
    DEFAULT_CONTEXT,
    IMPLAUSIBLE_RATIO,
    KEEP_SAMPLES,
    MIN_DECODE_TOKENS,
    MIN_DECODE_WINDOWS,
    MIN_PREFILL_REQUESTS,
    MIN_TIMED_WINDOWS,
    CalibrationError,
)
from fleetctl.model.calibration.startup import KEEP_STARTUPS, Startup, parse_startup_log
from fleetctl.model.calibration.store import (
    Calibration,
    Entry,
    entry_for,
    find_startup,
    record_startup,
)
from fleetctl.model.calibration.window import Sample, window, windows

__all__ = [
    "CALIBRATION_FORMAT",
    "DEFAULT_CONTEXT",
    "IMPLAUSIBLE_RATIO",
    "KEEP_SAMPLES",
    "KEEP_STARTUPS",
    "MIN_DECODE_TOKENS",
    "MIN_DECODE_WINDOWS",
    "MIN_PREFILL_REQUESTS",
    "MIN_TIMED_WINDOWS",
    "REFERENCE_BATCHES",
    "Calibrated",
    "Calibration",
    "CalibrationError",
    "EngineFit",
    "Entry",
    "Figure",
    "Figures",
    "Key",
    "Measured",
    "Sample",
    "ServerReading",
    "Startup",
    "StepModel",
    "beside_model",
    "beside_model_text",
    "calibrated",
    "engine_fit",
    "entry_for",
    "find_startup",
    "fit_step",
    "measure",
    "measured",
    "parse_startup_log",
    "record_startup",
    "speed_factor",
    "window",
    "windows",
]
