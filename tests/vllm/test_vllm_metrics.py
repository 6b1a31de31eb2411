"""One /metrics page read once: routing's gauges and calibration's counters from the same pass.

Sample: tests/data/vllm-0.32.0-cpu-metrics.txt, a real vLLM 0.32.0 (CPU) server's page after
five requests (captured for ../shared/captures).
"""

from __future__ import annotations

from dataclasses import fields

import pytest

from fleetctl.vllm.metrics import Scrape, parse_metrics
from tests.conftest import DATA

PAGE = (DATA / "vllm-0.32.0-cpu-metrics.txt").read_text()


def test_a_real_page_gives_routing_and_calibration_their_figures():
    m = parse_metrics(PAGE)
    # Routing's gauges and counters.
    assert (m.running, m.waiting, m.kv_usage, m.preemptions) == (0.0, 0.0, 0.0, 0.0)
    assert m.generation_tokens == 59.0
    assert m.kv_tokens == 2_097_152  # 16384 blocks x 128 tokens: its kv_cache_size_tokens
    assert m.gpu_memory_utilization == pytest.approx(0.92)
    # Calibration's histogram sums and counts, and counters.
    assert (m.itl_count, m.steps, m.step_tokens, m.prompt_tokens) == (54.0, 59.0, 86.0, 27.0)
    assert (m.prefill_count, m.ttft_count) == (5.0, 5.0)
    assert m.ttft_sum == pytest.approx(0.1211, abs=1e-4)


def test_engines_add_up_except_the_kv_usage_which_is_the_fullest():
    page = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 3.0
vllm:num_requests_running{engine="1"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.7
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
"""
    m = parse_metrics(page)
    assert (m.running, m.kv_usage, m.kv_tokens) == (6.0, 0.7, 3200)


def test_families_it_does_not_want_are_skipped_and_a_page_without_types_is_read_whole():
    # A sample under another family's TYPE line is not one of ours (the format puts a family's
    # samples after its own TYPE line), so the hop past it is safe.
    page = "# TYPE other_family gauge\nother_family 1\n# TYPE vllm:num_requests_waiting gauge\n"
    assert parse_metrics(page + "vllm:num_requests_waiting 4\n").waiting == 4.0
    bare = "vllm:num_requests_waiting 2\nvllm:num_preemptions_total 5\n"
    m = parse_metrics(bare)
    assert (m.waiting, m.preemptions) == (2.0, 5.0)
    # Counters typed with or without their _total suffix (client libraries differ).
    for family in ("vllm:num_preemptions", "vllm:num_preemptions_total"):
        typed = f"# TYPE {family} counter\nvllm:num_preemptions_total 7\n"
        assert parse_metrics(typed).preemptions == 7.0


def test_every_field_of_the_real_page_read_from_its_own_line():
    """Each expected value below is the sample's text on the captured page (grep it), so a
    series mapped to the wrong field, or missed, fails here."""
    assert parse_metrics(PAGE) == Scrape(
        # cache_config_info: num_gpu_blocks="16384" x block_size="128"; gpu_memory_utilization.
        kv_tokens=16384 * 128,
        block_size=128,
        gpu_memory_utilization=0.92,
        running=0.0,  # vllm:num_requests_running
        waiting=0.0,  # vllm:num_requests_waiting (not ..._by_reason)
        kv_usage=0.0,  # vllm:kv_cache_usage_perc
        read_bytes=0.0,  # vllm:estimated_read_bytes_per_gpu_total (not ..._created)
        preemptions=0.0,  # vllm:num_preemptions_total
        generation_tokens=59.0,  # vllm:generation_tokens_total
        itl_sum=0.3257084440000426,  # vllm:inter_token_latency_seconds_sum
        itl_count=54.0,
        steps=59.0,  # vllm:iteration_tokens_total_count
        step_tokens=86.0,  # vllm:iteration_tokens_total_sum
        prompt_tokens=27.0,  # vllm:prompt_tokens_total (not ..._by_source_total)
        prompt_cached=0.0,  # vllm:prompt_tokens_cached_total
        prefill_sum=0.04628350000007231,  # vllm:request_prefill_time_seconds_sum
        prefill_count=5.0,
        prefill_kv_tokens=27.0,  # vllm:request_prefill_kv_computed_tokens_sum
        prompt_sum=27.0,  # vllm:request_prompt_tokens_sum
        prompt_count=5.0,
        generation_sum=59.0,  # vllm:request_generation_tokens_sum
        generation_count=5.0,
        ttft_sum=0.12110018730163574,  # vllm:time_to_first_token_seconds_sum
        ttft_count=5.0,
        sleeping=False,  # vllm:engine_sleep_state{sleep_state="awake"} 1.0
        sleep_level=0,  # (no vllm:sleep_mode_operations_in_flight: no operation ran)
    )
    assert parse_metrics(PAGE).is_vllm


@pytest.mark.parametrize(
    ("awake", "offloaded", "discard", "sleeping", "level"),
    [
        ("1.0", "0.0", "0.0", False, 0),
        ("0.0", "1.0", "0.0", True, 1),
        ("0.0", "0.0", "1.0", True, 2),
    ],
)
def test_the_sleep_state_is_read_as_vllm_records_it(awake, offloaded, discard, sleeping, level):
    """vllm:engine_sleep_state as vLLM 0.32 sets it (v1/metrics/loggers.py,
    record_sleep_state), on the captured page with the values of each state."""
    name = "vllm:engine_sleep_state"
    page = PAGE
    for state, value in (
        ("awake", awake),
        ("weights_offloaded", offloaded),
        ("discard_all", discard),
    ):
        line = f'{name}{{engine="0",model_name="tiny-llama",sleep_state="{state}"}} '
        assert line in page
        page = page.replace(line + ("1.0" if state == "awake" else "0.0"), line + value)
    m = parse_metrics(page)
    assert (m.sleeping, m.sleep_level) == (sleeping, level)
    assert parse_metrics("vllm:num_requests_waiting 2\n").sleeping is None  # not reported


def test_every_series_is_read_with_or_without_type_lines():
    """One sample per series, values 1..N in _SERIES's order, on a page with TYPE lines (as
    vLLM writes them: histograms typed by family, counters by family without _total) and on
    the same page without them."""
    series = [
        ("vllm:num_requests_running", "vllm:num_requests_running", "running"),
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting", "waiting"),
        ("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "kv_usage"),
        (
            "vllm:estimated_read_bytes_per_gpu",
            "vllm:estimated_read_bytes_per_gpu_total",
            "read_bytes",
        ),
        ("vllm:num_preemptions", "vllm:num_preemptions_total", "preemptions"),
        ("vllm:generation_tokens", "vllm:generation_tokens_total", "generation_tokens"),
        ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_sum", "itl_sum"),
        ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count", "itl_count"),
        ("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count", "steps"),
        ("vllm:iteration_tokens_total", "vllm:iteration_tokens_total_sum", "step_tokens"),
        ("vllm:prompt_tokens", "vllm:prompt_tokens_total", "prompt_tokens"),
        ("vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total", "prompt_cached"),
        (
            "vllm:request_prefill_time_seconds",
            "vllm:request_prefill_time_seconds_sum",
            "prefill_sum",
        ),
        (
            "vllm:request_prefill_time_seconds",
            "vllm:request_prefill_time_seconds_count",
            "prefill_count",
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "vllm:request_prefill_kv_computed_tokens_sum",
            "prefill_kv_tokens",
        ),
        ("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum", "prompt_sum"),
        ("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_count", "prompt_count"),
        ("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum", "generation_sum"),
        (
            "vllm:request_generation_tokens",
            "vllm:request_generation_tokens_count",
            "generation_count",
        ),
        ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum", "ttft_sum"),
        (
            "vllm:time_to_first_token_seconds",
            "vllm:time_to_first_token_seconds_count",
            "ttft_count",
        ),
    ]
    typed, bare, want = [], [], {}
    for i, (family, sample, field) in enumerate(series, start=1):
        line = f'{sample}{{engine="0"}} {i}.0\n'
        if not typed or typed[-2] != f"# TYPE {family} x\n":
            typed += [f"# TYPE {family} x\n", line]
        else:
            typed.append(line)
        bare.append(line)
        want[field] = float(i)
    for page in ("".join(typed), "".join(bare)):
        m = parse_metrics(page)
        assert {f: getattr(m, f) for f in want} == want
        assert (m.kv_tokens, m.block_size, m.gpu_memory_utilization) == (None, None, None)
        assert m.is_vllm  # by its ITL count


def test_a_page_is_vllms_by_its_capacity_or_its_itl_count_alone():
    assert not parse_metrics("vllm:num_requests_running 1\n").is_vllm
    assert parse_metrics("vllm:inter_token_latency_seconds_count 0\n").is_vllm
    assert parse_metrics('vllm:cache_config_info{block_size="1",num_gpu_blocks="0"} 1\n').is_vllm


def test_the_older_kv_usage_name_is_read_and_engines_give_the_fullest():
    page = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{engine="0"} 0.9\n'
        'vllm:gpu_cache_usage_perc{engine="1"} 0.4\n'
    )
    assert parse_metrics(page).kv_usage == 0.9  # max(0.9, 0.4): the first one is the fullest


def test_counters_of_several_label_sets_add_up():
    page = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0"} 10.0\n'
        'vllm:generation_tokens_total{engine="1"} 4.0\n'
        'vllm:generation_tokens_total{engine="2"} 1.0\n'
    )
    assert parse_metrics(page).generation_tokens == 15.0  # 10 + 4 + 1


def test_cache_info_gives_capacity_block_size_and_utilization_of_each_engine():
    def info(**labels: str) -> str:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return f"vllm:cache_config_info{{{inner}}} 1.0\n"

    head = "# TYPE vllm:cache_config_info gauge\n"
    m = parse_metrics(head + info(block_size="16", num_gpu_blocks="10"))
    assert (m.kv_tokens, m.block_size, m.gpu_memory_utilization) == (160, 16, None)
    assert m.is_vllm  # a capacity alone makes it a vLLM page
    # Two engines: capacities add (16 x 10 + 16 x 20), the last utilization stands.
    two = info(block_size="16", num_gpu_blocks="10", gpu_memory_utilization="0.5") + info(
        block_size="16", num_gpu_blocks="20", gpu_memory_utilization="0.8"
    )
    m = parse_metrics(head + two)
    assert (m.kv_tokens, m.gpu_memory_utilization) == (480, 0.8)
    # Before profiling vLLM says num_gpu_blocks="None": no capacity, but the block size.
    m = parse_metrics(head + info(block_size="16", num_gpu_blocks="None"))
    assert (m.kv_tokens, m.block_size, m.gpu_memory_utilization) == (None, 16, None)
    assert not m.is_vllm
    # An engine not yet profiled does not hide the next one's capacity.
    m = parse_metrics(
        head
        + info(block_size="16", num_gpu_blocks="None", gpu_memory_utilization="0.5")
        + info(block_size="16", num_gpu_blocks="3", gpu_memory_utilization="0.9")
    )
    assert (m.kv_tokens, m.gpu_memory_utilization) == (48, 0.9)  # 3 blocks x 16 tokens
    m = parse_metrics(head + info(block_size="16"))
    assert (m.kv_tokens, m.block_size) == (None, 16)
    # A utilization that is not a number is unknown, not an error.
    m = parse_metrics(head + info(block_size="1", num_gpu_blocks="7", gpu_memory_utilization="x"))
    assert (m.kv_tokens, m.gpu_memory_utilization) == (7, None)


@pytest.mark.parametrize(
    ("raw", "size"),
    [("1", 1), ("9999999", 9999999), ("0", None), ("10000000", None), ("16k", None)],
)
def test_a_block_size_is_kept_only_from_1_to_under_ten_million(raw, size):
    page = f'vllm:cache_config_info{{block_size="{raw}",num_gpu_blocks="2"}} 1.0\n'
    assert parse_metrics(page).block_size == size


def test_a_label_value_may_hold_spaces_and_escaped_quotes():
    # The format allows any text in a label value; the value is after the last space.
    page = (
        'vllm:num_requests_running{model_name="my model"} 3.0\n'
        'vllm:cache_config_info{note="a \\"q\\" b",block_size="16",num_gpu_blocks="4"} 1.0\n'
    )
    m = parse_metrics(page)
    assert (m.running, m.kv_tokens, m.block_size) == (3.0, 64, 16)


def test_samples_that_cannot_be_read_are_skipped_not_fatal():
    page = (
        "vllm:num_requests_running{} NaN\n"  # not finite
        "vllm:num_requests_running{} +Inf\n"
        "vllm:num_requests_running{} -Inf\n"
        "vllm:num_requests_running{} 2.0\n"
        "vllm:num_requests_waiting{} many\n"  # not a number
        "vllm:num_requests_waiting{} 3.0\n"  # a good one after it still counts
        "vllm:num_preemptions_total{}\n"  # no value at all
    )
    m = parse_metrics(page)
    assert (m.running, m.waiting, m.preemptions) == (2.0, 3.0, None)


def test_only_whole_sample_names_at_a_line_start_count():
    page = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0\n'  # a longer name
        'other{x="vllm:num_requests_waiting 9"} 1.0\n'  # the name inside a label value
        "xvllm:num_requests_waiting 8.0\n"  # the name inside another name
        "vllm:num_requests_waiting 2.0"  # the real one, last, with no newline after it
    )
    assert parse_metrics(page).waiting == 2.0
    # The first line of a page without TYPE lines, and its last with no newline.
    assert parse_metrics("vllm:num_requests_waiting 5").waiting == 5.0
    assert parse_metrics("vllm:num_requests_waiting 6\nvllm:num_preemptions_total 1").waiting == 6


def test_a_page_that_ends_on_a_type_line_is_read_and_the_read_ends():
    """A page cut short after a TYPE line (no newline) made the parser search from the
    page's start again, for ever: a backend's broken /metrics froze route-serve's loop."""
    assert parse_metrics("# TYPE vllm:num_requests_waiting gauge").waiting is None
    assert parse_metrics("# TYPE vllm:num_requests_waiting gauge\n").waiting is None
    # The blocks before the last TYPE line are read; the cut one (no type word, no newline)
    # gives nothing.
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        "vllm:num_requests_running 4\n"
        "# TYPE vllm:num_requests_waiting"
    )
    assert (parse_metrics(page).running, parse_metrics(page).waiting) == (4.0, None)
    m = parse_metrics("")
    assert m == Scrape() and not m.is_vllm


def test_what_a_page_does_not_report_is_none():
    # None, not 0 or "": routing and calibration tell "not reported" from a zero by it.
    for page, reported in [
        ("", ()),
        ("# TYPE other gauge\nother 1\n", ()),
        ("vllm:num_requests_running 1\n", ("running",)),
    ]:
        m = parse_metrics(page)
        unset = {f.name: getattr(m, f.name) for f in fields(Scrape) if f.name not in reported}
        assert unset == dict.fromkeys(unset), page


def test_a_typed_page_reads_a_wanted_family_only_after_its_own_type_line():
    # The waiting sample sits in the block of a family nobody wants: skipped (the format
    # puts a family's samples after its own TYPE line), while the typed running one counts.
    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        "vllm:num_requests_running 1.0\n"
        "# TYPE vllm:something_else gauge\n"
        "vllm:num_requests_waiting 3.0\n"
    )
    m = parse_metrics(page)
    assert (m.running, m.waiting) == (1.0, None)


def test_a_wake_under_way_is_read_from_the_operations_in_flight():
    """vllm:sleep_mode_operations_in_flight (vllm/entrypoints/serve/dev/sleep/metrics.py):
    operation "wake" above 0 while a /wake_up is awaited; absent until the first one."""
    name = "vllm:sleep_mode_operations_in_flight"
    typed = f"# TYPE {name} gauge\n"
    assert parse_metrics(typed + f'{name}{{operation="wake"}} 1.0\n').waking is True
    assert parse_metrics(typed + f'{name}{{operation="wake"}} 0.0\n').waking is False
    assert parse_metrics(typed + f'{name}{{operation="sleep"}} 1.0\n').waking is None
    assert parse_metrics(PAGE).waking is None
