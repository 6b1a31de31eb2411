"""The commands as a user runs them: JSON schema, saved plans, examples, profiles, facts."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from tests.conftest import REPO, write

DEPLOYMENT_KEYS = {
    "node",
    "host",
    "gpu_type",
    "gpu_indices",
    "model",
    "variant",
    "source",
    "tensor_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_budget_bytes",
    "kv_budget_tokens",
    "weights_bytes",
    "port",
    "vllm_args",
    "predicted_decode_tok_s",
    "reasons",
}


def test_plan_json_schema(cli):
    r = cli("plan", "example:seed-multi-model", "--json")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    assert {"deployments", "unplaced", "warnings", "actions"} <= set(plan)
    for d in plan["deployments"]:
        assert set(d) >= DEPLOYMENT_KEYS
        assert d["reasons"] and all(isinstance(x, str) for x in d["reasons"])
    assert {a["op"] for a in plan["actions"]} == {"create"}
    assert len(plan["actions"]) == len(plan["deployments"]) == 12


def test_plan_table_and_explain(cli):
    r = cli("plan", REPO / "inventory" / "seed-mixed-8b.yaml", "--explain")
    assert r.code == 0, r.err
    assert "a100-[1:4]" in r.out and "rtx-[1:8]" in r.out
    assert "Plan: 12 to create, 0 to replace, 0 to delete, 0 unchanged." in r.out
    assert "KV budget" in r.out and "warning:" in r.out


def test_saved_plan_round_trips_and_diffs_against_state(cli, tmp_path):
    inv = write(tmp_path, (REPO / "inventory" / "seed-mixed-8b.yaml").read_text())
    out = tmp_path / "plan.json"
    r = cli("plan", inv, "-o", out)
    assert r.code == 0, r.err
    saved = json.loads(out.read_text())
    # Record it as applied state: the next plan keeps everything.
    from fleetctl.plan import Deployment
    from fleetctl.state import State
    from fleetctl.statedir import StateDir

    deployments = tuple(Deployment.from_json(d) for d in saved["deployments"])
    assert [d.to_json() for d in deployments] == saved["deployments"]
    StateDir(tmp_path / ".fleetctl").save_state(State(1, deployments))
    assert StateDir(tmp_path / ".fleetctl").load_state().deployments == deployments
    r = cli("plan", inv, "--json")
    assert {a["op"] for a in json.loads(r.out)["actions"]} == {"keep"}
    # Lowering the context length replaces every server.
    inv.write_text(inv.read_text().replace("max_context: 8192", "max_context: 4096"))
    actions = json.loads(cli("plan", inv, "--json").out)["actions"]
    assert {a["op"] for a in actions} == {"replace"}
    assert all("--max-model-len" in a["detail"] for a in actions)


def test_facts_override_declared_gpus_and_warn(cli, tmp_path):
    inv = write(tmp_path, (REPO / "inventory" / "seed-mixed-8b.yaml").read_text())
    facts = {
        "format": 1,
        "nodes": {
            "rtx-1": {"gpus": [{"index": 0, "name": "NVIDIA L40S", "memory_total_mib": 46068}]},
            "rtx-2": {"gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 4090"}]},
            "rtx-3": {"gpus": [{"index": 0, "name": "Mystery GPU"}]},
        },
    }
    f = tmp_path / "facts.json"
    f.write_text(json.dumps(facts))
    plan = json.loads(cli("plan", inv, "--facts", f, "--json").out)
    gpu_of = {d["node"]: d["gpu_type"] for d in plan["deployments"]}
    assert gpu_of["rtx-1"] == "L40S" and gpu_of["rtx-2"] == "RTX-4090"
    assert any(
        "rtx-1: inventory declares 1x RTX-4090, probed 1x L40S" in w for w in plan["warnings"]
    )
    assert any("rtx-3: probed GPU 'Mystery GPU' has no profile" in w for w in plan["warnings"])
    r = cli("plan", inv, "--facts", tmp_path / "none.json")
    assert r.code == 2 and "no such facts file" in r.err


def test_examples_and_profiles(cli):
    r = cli("examples")
    assert "example:seed-mixed-8b" in r.out and "example:large-mixed-fleet" in r.out
    r = cli("profiles", "list")
    assert r.code == 0 and "RTX-4090" in r.out and "mixtral-8x7b" in r.out and "gptq-int4" in r.out
    r = cli("profiles", "show", "NVIDIA GeForce RTX 4090")
    assert json.loads(r.out)["memory_mib"] == 24564
    r = cli("profiles", "show", "RTX-4900")
    assert r.code == 2 and "did you mean 'RTX-4090'" in r.err


def test_import_hf_config(cli, tmp_path):
    # Llama-3 8B's config.json fields (meta-llama/Meta-Llama-3-8B-Instruct).
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "profiles"
    r = cli("profiles", "import-hf-config", path, "--name", "my-llama", "--out", out)
    assert r.code == 0, r.err
    data = yaml.safe_load((out / "models" / "my-llama.yaml").read_text())
    assert data["params_total"] == 8030261248  # exactly the published count
    r = cli("profiles", "import-hf-config", path, "--name", "my-llama", "--out", out)
    assert r.code == 2 and "pass --force" in r.err
    # The new profile is usable by an inventory through --profiles.
    inv = write(
        tmp_path,
        (REPO / "inventory" / "seed-mixed-8b.yaml")
        .read_text()
        .replace("profile: llama-3-8b", "profile: my-llama"),
    )
    r = cli("plan", inv, "--profiles", out, "--json")
    assert r.code == 0, r.err
    assert len(json.loads(r.out)["deployments"]) == 12
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = cli("profiles", "import-hf-config", bad, "--name", "x", "--out", out)
    assert r.code == 2 and "hidden_size" in r.err


def test_console_script_has_no_traceback_and_help_is_fast(tmp_path):
    """The installed `fleetctl` script itself, in a fresh process."""
    exe = [sys.executable, "-m", "fleetctl"]
    r = subprocess.run(
        [*exe, "validate", tmp_path / "missing.yaml"], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = subprocess.run([*exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "plan" in r.stdout
    # --help must not import the heavy modules (pydantic, highspy, numpy).
    probe = (
        "import sys; sys.argv=['fleetctl','--help']\n"
        "from fleetctl.cli import main\n"
        "try:\n main()\nexcept SystemExit: pass\n"
        "heavy=[m for m in ('pydantic','highspy','numpy','yaml') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert "HEAVY []" in r.stdout, r.stdout


UNPLACEABLE = """\
nodes:
  - name: rtx-[1:2]
    gpus: {type: RTX-4090, count: 1}
models:
  - name: small
    profile: llama-3-8b
    variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}
    max_context: 4096
  - name: big
    profile: llama-3-70b
    variants: {bf16: {source: meta-llama/Meta-Llama-3-70B-Instruct}}
    max_context: 8192
"""


def test_plan_exits_3_when_a_model_cannot_be_placed(cli, tmp_path):
    inv = write(tmp_path, UNPLACEABLE)
    out = tmp_path / "plan.json"
    r = cli("plan", inv, "-o", out)
    assert r.code == 3, r.err
    assert "small" in r.out and "unplaced: big" in r.out  # the plan is still shown in full
    assert "plan incomplete: 1 model could not be placed (big)" in r.err
    saved = json.loads(out.read_text())  # and still saved
    assert [u["model"] for u in saved["unplaced"]] == ["big"] and saved["deployments"]
    r = cli("plan", inv, "--json")
    assert r.code == 3 and json.loads(r.out)["unplaced"][0]["model"] == "big"
    r = cli("plan", write(tmp_path, UNPLACEABLE.split("  - name: big")[0]))
    assert r.code == 0, r.err
