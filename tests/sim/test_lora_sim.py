"""`fleetctl simulate` on a trace whose requests name LoRA adapters: the servers start with
the plan's slots and preloaded adapters, an adapter none has loads at runtime where
route-serve would load it, and the JSON reports each adapter's figures and the loads."""

from __future__ import annotations

import json

from tests.conftest import write

INVENTORY = """\
nodes:
  - name: a100-1
    host: 10.0.1.11
    gpus: {type: A100-SXM4-80GB, count: 1}
  - name: rtx-[1:2]
    host: 10.0.2.[21:22]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: llama-3-8b
    profile: llama-3-8b
    variants:
      bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}
    max_context: 8192
    workload: {requests_per_s: 5, mean_prompt_tokens: 500, mean_output_tokens: 60}
    slo: {ttft_p99_s: 2.0, tpot_p99_ms: 100}
    max_loras: 2
    adapters_runtime: true
    adapters:
      - {name: support-en, source: /srv/adapters/support-en, rank: 16, workload: {requests_per_s: 2, mean_prompt_tokens: 500, mean_output_tokens: 60}}
      - {name: legal-de, source: /srv/adapters/legal-de, rank: 16, workload: {requests_per_s: 1, mean_prompt_tokens: 500, mean_output_tokens: 60}}
      - {name: sql, source: /srv/adapters/sql, rank: 64}
"""


def trace_rows() -> list[dict[str, object]]:
    names = ["support-en", None, "legal-de", "support-en", "sql", None]
    rows = []
    for i in range(60):
        row: dict[str, object] = {
            "timestamp": i * 200,
            "input_length": 400 + 10 * (i % 7),
            "output_length": 40 + i % 5,
            "model": "llama-3-8b",
        }
        if names[i % len(names)] is not None:
            row["adapter"] = names[i % len(names)]
        rows.append(row)
    return rows


def test_simulate_replays_adapter_requests_and_reports_each_adapter(cli, tmp_path):
    inv = write(tmp_path, INVENTORY)
    trace = tmp_path / "adapters.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in trace_rows()))
    r = cli("simulate", inv, "--trace", trace, "--policies", "round-robin,hardware-aware", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    for name, figures in data["policies"].items():
        assert figures["completed"] == 60 and figures["rejected"] == 0, name
        lora = figures["lora"]
        each = lora["adapters"]
        assert {k: v["requests"] for k, v in each.items()} == {
            "(base)": 20,
            "support-en": 20,
            "legal-de": 10,
            "sql": 10,
        }
        # support-en and legal-de start loaded (the two most requested, --max-loras 2); sql
        # is loaded once at runtime, as route-serve would, and every adapter enters a slot.
        assert each["sql"]["runtime_loads"] == 1 and lora["runtime_loads"] == 1, name
        assert all(each[a]["slot_loads"] >= 1 for a in ("support-en", "legal-de", "sql"))
        assert each["(base)"]["slot_loads"] == 0
        assert lora["slot_loads"] == sum(v["slot_loads"] for v in each.values())
        assert lora["slot_loads_per_min"] > 0
        for v in each.values():
            assert v["ttft_p50_s"] is not None and v["ttft_p99_s"] >= v["ttft_p50_s"]
            assert 0 <= v["slo_attainment"] <= 1
