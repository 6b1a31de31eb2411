"""What counts as a measurement: the least evidence a figure needs, how far off the model a
figure may be before it is a broken server instead, the file's format, and its value types."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, PlainSerializer

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


# What the file holds beyond JSON types (fleetctl/base/documents.py reads and writes it by the
# dataclasses' field types). A name or timestamp is never empty: an entry keyed or dated by
# nothing is no measurement.
Name = Annotated[str, Field(min_length=1)]


def rounded(digits: int) -> PlainSerializer:
    """A float written to `digits` decimals, for figures whose noise is far larger than that:
    a fleet's file keeps thousands of samples."""
    return PlainSerializer(lambda v: round(v, digits))
