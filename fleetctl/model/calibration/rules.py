"""What counts as a measurement: the least evidence a figure needs, how far off the model a
figure may be before it is a broken server instead, the file's format, and its number checks."""

from __future__ import annotations

import math
from typing import Any

CALIBRATION_FORMAT = 1

# A fit from fewer windows or tokens than this is noise, not a measurement.
MIN_DECODE_WINDOWS = 3

MIN_DECODE_TOKENS = 100

MIN_PREFILL_REQUESTS = 3

# Timed windows for the clock's fit of three costs (fixed, per sequence, per prompt token).
MIN_TIMED_WINDOWS = 6

# A measured figure this many times off the model's is a broken server or a wrong key (another
# model behind the URL), not a calibration: kept and shown, never used.
IMPLAUSIBLE_RATIO = 10.0

KEEP_SAMPLES = 256  # the sliding window of decode/prefill samples an entry keeps, newest last

DEFAULT_CONTEXT = 512  # tokens per sequence for the model's step when the server gave no lengths


class CalibrationError(ValueError):
    """A calibration document that is not one: the message says which field and why."""


def is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def num(raw: dict[str, Any], name: str, where: str) -> float:
    v = raw.get(name)
    if not is_num(v):
        raise CalibrationError(f"{where}.{name}: not a number")
    return float(v)  # type: ignore[arg-type]
