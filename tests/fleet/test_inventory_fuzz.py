"""Fuzzing the inventory loader: random and mutated documents, shaped by its schema, are
either an inventory or one UserError (exit code 2), never another exception, within bounded
time. Fixed seed and budget in CI; a longer local run:
FLEETCTL_FUZZ_EXAMPLES=20000 python -m pytest tests/fleet/test_inventory_fuzz.py
"""

from __future__ import annotations

import os
import time

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetctl.base.errors import UserError
from fleetctl.base.names import control_char
from fleetctl.fleet.inventory import load_inventory
from fleetctl.model.catalog import load_catalog
from tests.fleet.test_inventory_errors import GOOD

EXAMPLES = int(os.environ.get("FLEETCTL_FUZZ_EXAMPLES", "300"))
CATALOG = load_catalog()
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Characters that change what YAML means, plus the ones validation must refuse.
YAML_BITS = [
    *list(":-[]{},&*!|>#'\"%@`?\n\t \\"),
    "<<: *a",
    "&a ",
    "*a",
    "!!binary ",
    "!!python/object:os.system ",
    ".inf",
    ".nan",
    "---\n",
    "2024-01-01",
    "[1:99999]",
    "\r\n",
    "\x00",
    "\u2028",
    "\ufeff",
    "$(touch x)",
    "0x1f",
    "~",
    "1e400",
    "-1",
    "99999999999999999999",
    "'",
    "yes",
    "null",
]


def outcome(tmp_path, text: str | bytes) -> str:
    """Load `text` as an inventory file: 'ok' or 'refused'; anything else fails the test."""
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    t0 = time.monotonic()
    try:
        load_inventory(path, CATALOG)
        result = "ok"
    except UserError as e:
        line = e.line()
        # One line by every line break Python knows (\r, \x85, \u2028 too), and no control
        # character of the input echoed raw.
        assert len(line.splitlines()) == 1 and len(line) < 1200, line
        assert control_char(line) is None, line
        result = "refused"
    assert time.monotonic() - t0 < 10, "a document up to the size cap loads within bounds"
    return result


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """GOOD with a few edits at random places: inserts, deletions and replacements."""
    text = GOOD
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 8))
        new = draw(st.one_of(st.sampled_from(YAML_BITS), st.text(max_size=4)))
        text = text[:at] + new + text[at + cut :]
    return text


leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["RTX-4090", "llama-3-8b", "bf16", "a-[1:3]", "10.0.0.[1:3]", "--port"]),
)
value = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


def shaped() -> st.SearchStrategy[dict]:
    """Documents with the inventory's keys and random values at every level."""
    node = st.fixed_dictionaries(
        {
            "name": value,
            "gpus": st.one_of(value, st.fixed_dictionaries({"type": value, "count": value})),
        },
        optional={"host": value, "port": value, "user": value, "labels": value},
    )
    model = st.fixed_dictionaries(
        {"name": value, "profile": value, "variants": value, "max_context": value},
        optional={
            "env": st.dictionaries(st.text(max_size=10), value, max_size=2),
            "vllm_args": st.lists(st.one_of(st.text(max_size=10), leaf), max_size=4),
            "workload": value,
            "min_replicas": value,
            "placement": value,
        },
    )
    return st.fixed_dictionaries(
        {"nodes": st.lists(node, min_size=1, max_size=3)},
        optional={
            "models": st.lists(model, max_size=2),
            "ssh": st.dictionaries(
                st.sampled_from(["user", "port", "proxy_jump", "connect_timeout_s"]), value
            ),
            "router": value,
            "planner": value,
            "apply": value,
        },
    )


@FUZZ
@given(text=mutated())
def test_mutated_inventories_load_or_are_refused(tmp_path, text):
    outcome(tmp_path, text)


@FUZZ
@given(doc=shaped())
def test_schema_shaped_documents_load_or_are_refused(tmp_path, doc):
    outcome(tmp_path, yaml.safe_dump(doc, allow_unicode=True))


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_load_or_are_refused(tmp_path, data):
    outcome(tmp_path, GOOD.encode()[:120] + data)
