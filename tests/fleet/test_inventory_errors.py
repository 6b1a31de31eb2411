"""Bad inventories fail with one line naming file, line, field and fix, and exit code 2."""

from __future__ import annotations

import os

import pytest

from tests.conftest import write

GOOD = """\
ssh: {user: ubuntu, port: 22}
nodes:
  - name: a100-[1:2]
    host: 10.0.1.[11:12]
    gpus: {type: A100-SXM4-80GB, count: 2}
  - name: rtx-[1:2]
    host: 10.0.2.[21:22]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 1000, mean_output_tokens: 200}
"""


def bad(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


# (id, inventory text, line the error must name, words the message must contain)
CASES = [
    (
        "yaml-syntax",
        bad("gpus: {type: RTX-4090, count: 1}", "gpus: {type: RTX-4090, count: 1"),
        9,
        ["YAML syntax error"],
    ),
    (
        "tab-indent",
        bad("    host: 10.0.2.[21:22]", "\thost: 10.0.2.[21:22]"),
        7,
        ["a tab is used for indentation", "indent with spaces"],
    ),
    ("not-a-mapping", "- just\n- a list\n", 1, ["must be a mapping"]),
    ("unknown-top-key", GOOD + "nodez: []\n", 16, ["unknown key 'nodez'", "did you mean 'nodes'"]),
    (
        "unknown-node-key",
        bad(
            "    gpus: {type: RTX-4090, count: 1}",
            "    gpus: {type: RTX-4090, count: 1}\n    lables: {a: b}",
        ),
        9,
        ["unknown key 'lables'", "did you mean 'labels'"],
    ),
    (
        "unknown-gpus-key",
        bad("{type: RTX-4090, count: 1}", "{type: RTX-4090, cnt: 1}"),
        8,
        ["unknown key 'cnt'", "nodes[1].gpus.cnt"],
    ),
    ("missing-nodes", "models: []\n", 1, ["missing required key 'nodes'"]),
    (
        "missing-gpus",
        bad("    gpus: {type: RTX-4090, count: 1}\n", ""),
        6,
        ["missing required key 'gpus'", "nodes[1].gpus"],
    ),
    ("count-not-int", bad("count: 1}", "count: one}"), 8, ["expected a whole number", "'one'"]),
    ("count-zero", bad("count: 1}", "count: 0}"), 8, ["greater than or equal to 1"]),
    (
        "port-range",
        bad("ssh: {user: ubuntu, port: 22}", "ssh: {user: ubuntu, port: 70000}"),
        1,
        ["ssh.port", "less than or equal to 65535"],
    ),
    ("backwards-range", bad("name: rtx-[1:2]", "name: rtx-[2:1]"), 6, ["runs backwards", "[1:2]"]),
    ("malformed-range", bad("name: rtx-[1:2]", "name: rtx-[1-2]"), 6, ["malformed range"]),
    ("two-ranges", bad("name: rtx-[1:2]", "name: rtx-[1:2]-[1:2]"), 6, ["more than one range"]),
    (
        "range-length-mismatch",
        bad("host: 10.0.2.[21:22]", "host: 10.0.2.[21:23]"),
        7,
        ["expands to 2 nodes but host to 3"],
    ),
    (
        "duplicate-node-name",
        bad("name: rtx-[1:2]", "name: a100-[2:3]"),
        6,
        ["duplicate node name 'a100-2'"],
    ),
    (
        "duplicate-address",
        bad("host: 10.0.2.[21:22]", "host: 10.0.1.[12:13]"),
        7,
        ["duplicate address 10.0.1.12:22", "a100-2"],
    ),
    (
        # The same IPv6 address written two ways is one node, named as OpenSSH writes it.
        "duplicate-ipv6-address",
        bad("host: 10.0.1.[11:12]", "host: fd00:0::[11:12]").replace(
            "host: 10.0.2.[21:22]", "host: fd00::[12:13]"
        ),
        7,
        ["duplicate address [fd00::12]:22", "a100-2"],
    ),
    (
        "unknown-gpu",
        bad("type: RTX-4090", "type: RTX-4009"),
        8,
        ["unknown GPU type 'RTX-4009'", "did you mean 'RTX-4090'"],
    ),
    (
        "gpu-family-before-spelling",
        bad("type: RTX-4090", "type: A100"),
        8,
        [
            "unknown GPU type 'A100'",
            "did you mean one of 'A100-PCIE-80GB', 'A100-SXM4-40GB', 'A100-SXM4-80GB'?",
        ],
    ),
    (
        "gpu-family-h100",
        bad("type: RTX-4090", "type: H100"),
        8,
        ["unknown GPU type 'H100'", "did you mean one of 'H100-PCIE-80GB', 'H100-SXM-80GB'?"],
    ),
    (
        "unknown-model-profile",
        bad("profile: llama-3-8b", "profile: llama3-8b"),
        11,
        ["unknown model profile 'llama3-8b'", "did you mean 'llama-3-8b'"],
    ),
    (
        "unknown-format",
        bad("bf16: {source", "bf61: {source"),
        13,
        ["unknown quantization format 'bf61'", "did you mean 'bf16'"],
    ),
    (
        "format-family-before-spelling",
        bad("bf16: {source", "int4: {source"),
        13,
        ["unknown quantization format 'int4'", "did you mean one of 'awq-int4', 'gptq-int4'?"],
    ),
    (
        "slo-key-in-another-unit",
        bad("    workload:", "    slo: {ttft_p99_ms: 500}\n    workload:"),
        15,
        [
            "models[0].slo.ttft_p99_ms: unknown key 'ttft_p99_ms'",
            "did you mean 'ttft_p99_s' (seconds, not milliseconds)?",
        ],
    ),
    (
        "slo-key-in-another-unit-tpot",
        bad("    workload:", "    slo:\n      tpot_p99_s: 0.05\n    workload:"),
        16,
        [
            "models[0].slo.tpot_p99_s: unknown key 'tpot_p99_s'",
            "did you mean 'tpot_p99_ms' (milliseconds, not seconds)?",
        ],
    ),
    (
        "slo-key-without-its-unit",
        bad("    workload:", "    slo: {ttft_p99: 0.5}\n    workload:"),
        15,
        ["unknown key 'ttft_p99'", "did you mean 'ttft_p99_s' (seconds)?"],
    ),
    (
        "variant-no-source",
        bad("bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}", "bf16:"),
        13,
        ["variant 'bf16' has no source"],
    ),
    (
        "variant-empty-source",
        bad("{source: meta-llama/Meta-Llama-3-8B-Instruct}", "{source: ''}"),
        13,
        ["variants.bf16.source", "at least 1 character"],
    ),
    (
        "no-variants",
        bad(
            "    variants:\n      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}\n",
            "    variants: {}\n",
        ),
        12,
        ["models[0].variants", "at least 1 item"],
    ),
    (
        "context-too-long",
        bad("max_context: 8192", "max_context: 16384"),
        14,
        ["exceeds llama-3-8b's 8192", "at most 8192"],
    ),
    (
        "duplicate-model",
        GOOD
        + "  - name: llama-3-8b\n    profile: llama-3-8b\n    variants: {bf16: {source: x}}\n    max_context: 4096\n",
        16,
        ["duplicate model name 'llama-3-8b'"],
    ),
    (
        "bad-model-name",
        bad("  - name: llama-3-8b", "  - name: 'llama 3 8b'"),
        10,
        ["not a valid served model name"],
    ),
    (
        "workload-negative",
        bad("requests_per_s: 5", "requests_per_s: -5"),
        15,
        ["workload.requests_per_s", "greater than 0"],
    ),
    ("router-listen", GOOD + "router: {listen: localhost}\n", 16, ["not HOST:PORT"]),
    (
        "router-saturation",
        GOOD + "router: {bandwidth_saturation: 1.5}\n",
        16,
        ["router.bandwidth_saturation"],
    ),
    (
        "planner-util",
        GOOD + "planner: {gpu_memory_utilization: 1.2}\n",
        16,
        ["planner.gpu_memory_utilization"],
    ),
    (
        "duplicate-yaml-key",
        bad("    profile: llama-3-8b\n", "    profile: llama-3-8b\n    profile: llama-3-8b\n"),
        12,
        ["duplicate key 'profile'"],
    ),
    (
        "max-below-min",
        bad(
            "    max_context: 8192\n",
            "    max_context: 8192\n    min_replicas: 3\n    max_replicas: 2\n",
        ),
        16,
        ["max_replicas 2 is below min_replicas 3"],
    ),
    (
        "placement-gpu",
        bad(
            "    max_context: 8192\n", "    max_context: 8192\n    placement: {gpu_types: [H100]}\n"
        ),
        15,
        ["unknown GPU type 'H100'"],
    ),
    (
        "misspelt-required-key",
        bad("    max_context: 8192", "    max_contxt: 8192"),
        14,
        [
            "models[0]: missing required key 'max_context'",
            "(found 'max_contxt': did you mean 'max_context'?)",
        ],
    ),
    (
        "shortened-required-key",
        bad("{type: RTX-4090, count: 1}", "{typ: RTX-4090, count: 1}"),
        8,
        ["nodes[1].gpus: missing required key 'type' (found 'typ': did you mean 'type'?)"],
    ),
    ("nodes-not-list", "nodes: {a: 1}\n", 1, ["expected a list"]),
    ("empty-file", "", 1, ["must be a mapping"]),
]


@pytest.mark.parametrize(
    ("text", "line", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_inventory_is_one_clear_line(cli, tmp_path, text, line, words):
    path = write(tmp_path, text)
    assert_one_clear_line(cli("validate", path), path, line, words)


def assert_one_clear_line(r, path, line: int | None, words: list[str]) -> str:
    """Exit 2, nothing on stdout, one line on stderr: where (file:line), what, and a fix."""
    assert r.code == 2, (r.out, r.err)
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    msg = lines[0]
    assert msg.startswith(f"error: {path}:{line}:" if line else f"error: {path}"), msg
    for w in words:
        assert w in msg, (w, msg)
    assert "(" in msg and msg.endswith(")"), "every error says how to fix it"
    assert "Traceback" not in r.err and "internal error" not in r.err
    return msg


def test_good_inventory_validates(cli, tmp_path):
    r = cli("validate", write(tmp_path, GOOD))
    assert r.code == 0, r.err
    assert "6 nodes" not in r.out and "4 nodes, 6 GPUs, 1 model" in r.out


def test_missing_and_unreadable_files(cli, tmp_path):
    r = cli("validate", tmp_path / "nope.yaml")
    assert r.code == 2 and "no such inventory" in r.err and "nope.yaml" in r.err
    r = cli("validate", tmp_path)
    assert r.code == 2 and "is a directory" in r.err
    if os.geteuid() != 0:  # root reads anything
        p = write(tmp_path, GOOD, "locked.yaml")
        p.chmod(0)
        r = cli("validate", p)
        assert r.code == 2 and "permission denied" in r.err
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"nodes: [\xff]\n")
    r = cli("validate", p)
    assert r.code == 2 and "not UTF-8" in r.err


def test_debug_shows_the_traceback(cli, tmp_path):
    p = write(tmp_path, bad("type: RTX-4090", "type: RTX-4009"))
    with pytest.raises(Exception, match="unknown GPU type"):
        cli("--debug", "validate", p)


def test_unknown_example(cli):
    r = cli("plan", "example:nope")
    assert r.code == 2 and "no bundled example 'nope'" in r.err and "seed-mixed-8b" in r.err


def test_usage_error_exits_2(cli):
    """A usage mistake is exit 2 and says which argument is missing; nothing runs."""
    r = cli("plan")
    assert r.code == 2
    assert r.out == "" and "Missing argument 'INVENTORY'" in r.err, r.err


def test_a_misspelt_required_key_of_a_backends_file_is_named(cli, tmp_path):
    """The backends file shares the inventory's error wording: `gpu:` for `gpu_type:`."""
    inv = write(tmp_path, GOOD)
    entry = "backends:\n  - url: http://127.0.0.1:9\n    model: llama-3-8b\n"
    backends = write(tmp_path, entry + "    gpu: RTX-4090\n", "backends.yaml")
    r = cli("calibrate", inv, "--backends", backends, "--state-dir", tmp_path / "state")
    msg = assert_one_clear_line(r, backends, 4, ["backends[0]: missing required key 'gpu_type'"])
    assert msg.endswith("(found 'gpu': did you mean 'gpu_type'?)"), msg
