"""The commands as a user runs them: JSON schema, saved plans, examples, profiles, facts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, record_the_plan_as_applied, write

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


def cells(row: str) -> list[str]:
    """The cells of one table row as rendered (rich's vertical rules split them)."""
    return [c.strip() for c in row.split("\u2502") if c.strip()]


def test_plan_table_and_explain(cli):
    """README: per-group servers, KV tokens, capacity and `Plan: N to create`; the table
    shows the figures the plan holds (read from --json) and its capacity adds up."""
    inv = REPO / "inventory" / "seed-mixed-8b.yaml"
    r = cli("plan", inv, "--explain")
    assert r.code == 0, r.err
    plan = json.loads(cli("plan", inv, "--json").out)
    lines = r.out.splitlines()
    kv = {d["gpu_type"]: d["kv_budget_tokens"] for d in plan["deployments"]}
    per_gpu = {}
    # One row per group: 4 A100 nodes and 8 RTX-4090 nodes, one GPU each.
    for group, gpu, n in (("a100-[1:4]", "A100-SXM4-80GB", 4), ("rtx-[1:8]", "RTX-4090", 8)):
        (row,) = [ln for ln in lines if f"+ {group}" in ln]
        c = cells(row)
        assert c[1] == f"0 {gpu}" and c[6] == f"{kv[gpu]:,}", c  # GPU, then its KV tokens
        per_gpu[gpu] = (float(c[-1]), n)
        assert f"= {kv[gpu]:,} tokens" in r.out  # the explain line of the KV budget
    # The Capacity table: 12 replicas on 12 GPUs, about the sum of the rows' req/s (each
    # class's share of its own servers' goodput; the model's pools both classes, which a
    # router that knows the SLO balances, so it may be a little more), against 20 req/s.
    (model,) = plan["models"]
    (row,) = [ln for ln in lines if cells(ln)[:1] == ["llama-3-8b"]]
    c = cells(row)
    assert c[:3] == ["llama-3-8b", "12", "12"] and c[4] == "20", c
    assert float(c[3]) == pytest.approx(sum(rps * n for rps, n in per_gpu.values()), rel=0.02)
    assert float(c[3]) == pytest.approx(model["capacity_rps"], abs=0.005)
    assert "Plan: 12 to create, 0 to replace, 0 to delete, 0 unchanged." in r.out
    assert "warning:" in r.out


def test_saved_plan_round_trips_and_diffs_against_state(cli, tmp_path):
    inv = write(tmp_path, (REPO / "inventory" / "seed-mixed-8b.yaml").read_text())
    out = tmp_path / "plan.json"
    r = cli("plan", inv, "-o", out)
    assert r.code == 0, r.err
    saved = json.loads(out.read_text())
    # Record it as applied state: the next plan keeps everything.
    from fleetctl.fleet.plan import Deployment
    from fleetctl.fleet.state import State
    from fleetctl.fleet.statedir import StateDir

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
    # Tied embeddings count once: Llama-3.2 1B (meta-llama/Llama-3.2-1B), 1,235,814,400.
    tied = {
        **cfg,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    }
    (tmp_path / "tied.json").write_text(json.dumps(tied))
    r = cli("profiles", "import-hf-config", tmp_path / "tied.json", "--name", "one-b", "--out", out)
    assert r.code == 0, r.err
    one_b = yaml.safe_load((out / "models" / "one-b.yaml").read_text())
    assert one_b["params_total"] == 1235814400
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


def test_a_bundled_example_keeps_its_state_in_the_current_folder(cli, tmp_path, monkeypatch):
    """Not inside the installed package: the facts saved in ./.fleetctl are the ones used."""
    monkeypatch.chdir(tmp_path)
    facts = {"format": 2, "nodes": {"rtx-1": {"gpus": [{"index": 0, "name": "NVIDIA L40S"}]}}}
    (tmp_path / ".fleetctl").mkdir()
    (tmp_path / ".fleetctl" / "facts.json").write_text(json.dumps(facts))
    plan = json.loads(cli("plan", "example:seed-mixed-8b", "--json").out)
    assert any(
        "rtx-1: inventory declares 1x RTX-4090, probed 1x L40S" in w for w in plan["warnings"]
    )
    from fleetctl.base.resources import bundled

    assert not (bundled("inventory") / ".fleetctl").exists()


def test_examples_copy_writes_an_editable_inventory(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("examples", "copy", "seed-mixed-8b")
    assert r.code == 0, r.err
    copy = tmp_path / "seed-mixed-8b.yaml"
    assert copy.read_text() == (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
    r = cli("examples", "copy", "example:seed-mixed-8b")
    assert r.code == 2 and "pass --force" in r.err
    (tmp_path / "mine").mkdir()
    assert cli("examples", "copy", "seed-mixed-8b", tmp_path / "mine").code == 0
    mine = tmp_path / "mine" / "seed-mixed-8b.yaml"
    assert mine.read_text() == copy.read_text()
    # The copy is editable: an edit to it is what the next plan places.
    mine.write_text(mine.read_text().replace("max_context: 8192", "max_context: 4096"))
    r = cli("plan", mine, "--json")
    assert r.code == 0, r.err
    assert {d["max_model_len"] for d in json.loads(r.out)["deployments"]} == {4096}
    r = cli("examples", "copy", "nope")
    assert r.code == 2 and "choose one of" in r.err


@pytest.mark.parametrize("command", ["probe", "status", "health", "apply", "destroy"])
def test_a_command_that_connects_refuses_a_bundled_example_saying_copy_it(
    cli, tmp_path, monkeypatch, command
):
    """Before any connection, even with the example's identity file present (so the missing
    key no longer stops it): the line names the example and `fleetctl examples copy NAME`."""
    from fleetctl.fleet.ssh import SshSession

    tried = []
    monkeypatch.setattr(SshSession, "_open", lambda self, t, deadline: tried.append(t.host) / 0)
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_ed25519").write_text("not a key\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yes = ["--yes"] if command in ("apply", "destroy") else []
    r = cli(command, "example:seed-mixed-8b", *yes)
    assert r.code == 2 and tried == [], (r.err, tried)
    (line,) = r.err.splitlines()
    assert "example:seed-mixed-8b is a bundled example" in line
    assert "run `fleetctl examples copy seed-mixed-8b`" in line and "site-packages" not in line


def test_a_saved_plan_of_a_bundled_example_is_refused_too(cli, tmp_path, monkeypatch):
    """cost-mixed names no identity_file: only the example check stands before a connection."""
    from fleetctl.fleet.ssh import SshSession

    tried = []
    monkeypatch.setattr(SshSession, "_open", lambda self, t, deadline: tried.append(t.host) / 0)
    monkeypatch.chdir(tmp_path)
    assert cli("plan", "example:cost-mixed", "-o", "plan.json").code == 0
    for target in ("example:cost-mixed", "plan.json"):
        r = cli("apply", target, "--yes")
        assert r.code == 2 and tried == [], (r.err, tried)
        assert "run `fleetctl examples copy cost-mixed`" in r.err


def test_a_rate_is_shown_to_two_decimals(cli, tmp_path):
    """A workload rate like one derived from a trace (2.65395 req/s) reads 2.65 in the
    Capacity table and in an unplaced model's reason, not with six digits."""
    text = (REPO / "inventory" / "seed-mixed-8b.yaml").read_text()
    assert "requests_per_s: 20," in text
    inv = write(tmp_path, text.replace("requests_per_s: 20,", "requests_per_s: 2.65395,"))
    r = cli("plan", inv)
    assert r.code == 0, r.err
    (row,) = [ln for ln in r.out.splitlines() if cells(ln)[:1] == ["llama-3-8b"]]
    assert cells(row)[4] == "2.65" and "2.65395" not in r.out, row


def test_facts_named_on_the_command_line_may_come_through_a_pipe(tmp_path):
    """State files are read only when regular (a FIFO there would stop route-serve), but a
    path the user names, such as `--facts <(ssh host cat facts.json)`, may be a pipe."""
    import threading

    from fleetctl.fleet.statedir import StateDir

    facts = {"format": 1, "nodes": {"rtx-1": {"gpus": [{"index": 0, "name": "NVIDIA L40S"}]}}}
    fifo = tmp_path / "facts.pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=(json.dumps(facts),))
    writer.start()
    got = StateDir(tmp_path / ".fleetctl").load_facts(fifo)
    writer.join(10)
    assert got is not None and list(got.nodes) == ["rtx-1"]


def test_a_facts_file_that_is_not_usable_is_refused_with_where_and_why(cli, tmp_path):
    inv = write(tmp_path, (REPO / "inventory" / "seed-mixed-8b.yaml").read_text())
    f = tmp_path / "facts.json"
    f.write_text(json.dumps({"format": 9, "nodes": {}}))
    r = cli("plan", inv, "--facts", f)
    assert r.code == 2 and "written by a newer fleetctl" in r.err and "fleetctl probe" in r.err
    f.write_text(json.dumps({"format": 2, "nodes": {"rtx-1": {"gpus": [{"index": "zero"}]}}}))
    r = cli("plan", inv, "--facts", f)
    assert (
        r.code == 2
        and "nodes.rtx-1.gpus[0].index: input should be a valid integer, got a string" in r.err
    )
    # A facts file of the first format still reads (its keys did not change meaning), and is
    # used: its L40S replaces the RTX-4090 the inventory declares.
    one = {"rtx-1": {"gpus": [{"index": 0, "name": "NVIDIA L40S", "memory_total_mib": 46068}]}}
    f.write_text(json.dumps({"format": 1, "nodes": one}))
    r = cli("plan", inv, "--facts", f, "--json")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    assert {d["gpu_type"] for d in plan["deployments"] if d["node"] == "rtx-1"} == {"L40S"}
    assert any(
        w.startswith("rtx-1: inventory declares 1x RTX-4090, probed 1x L40S")
        for w in plan["warnings"]
    ), plan["warnings"]


def test_a_state_or_plan_file_that_is_not_usable_is_one_line_naming_the_field(cli, tmp_path):
    """state.json and a saved plan read through their schemas: a newer format, a field of the
    wrong type or a server without its --port are refused in one line that names the field,
    exit 2; what this release writes reads back the same."""
    inv = write(tmp_path, (REPO / "inventory" / "seed-mixed-8b.yaml").read_text())
    saved = tmp_path / "plan.json"
    assert cli("plan", inv, "-o", saved).code == 0
    plan = json.loads(saved.read_text())
    state = tmp_path / ".fleetctl" / "state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"format": 1, "serial": 4, "deployments": plan["deployments"]}))
    r = cli("plan", inv, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["state_serial"] == 4  # read back: every server kept
    assert all(a["op"] == "keep" for a in json.loads(r.out)["actions"])
    for doc, want in (
        ({"format": 2, "serial": 1, "deployments": []}, "written by a newer fleetctl"),
        (
            {"format": 1, "deployments": [{**plan["deployments"][0], "port": "8000"}]},
            "deployments[0].port: input should be a valid integer, got a string",
        ),
        (
            {"format": 1, "deployments": [{**plan["deployments"][0], "vllm_args": ["serve"]}]},
            "deployments[0]: vllm_args has no --host or --port",
        ),
    ):
        state.write_text(json.dumps(doc))
        r = cli("plan", inv)
        assert r.code == 2 and "state file is not usable" in r.err and want in r.err, r.err
        assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err
    state.unlink()
    bad = {**plan, "deployments": [{**plan["deployments"][0], "gpu_indices": "0"}]}
    saved.write_text(json.dumps(bad))
    r = cli("apply", saved, "--yes")
    assert (
        r.code == 2
        and "deployments[0].gpu_indices: input should be a valid array, got a string" in r.err
    )


def test_facts_round_trip_through_json():
    from fleetctl.fleet.facts import Facts

    doc = {
        "format": 2,
        "probed_at": "2026-12-01T00:00:00+00:00",
        "inventory": "inv.yaml",
        "nodes": {
            "a": {
                "host": "10.0.0.1",
                "gpus": [
                    {"index": 0, "name": "X", "processes": [{"pid": 5, "used_memory_mib": 9}]}
                ],
                "fleetctl_pids": [5],
                "gpu_error": None,
            },
            "b": {"host": "10.0.0.2", "error": {"kind": "timeout", "message": "m", "line": "l"}},
        },
    }
    facts = Facts.from_json(doc)
    assert Facts.from_json(facts.to_json()) == facts
    assert facts.nodes["a"].gpus[0].processes[0].pid == 5 and facts.nodes["b"].error.text == "l"


def test_version_flag_and_profiles_show_json(cli):
    from fleetctl import __version__

    assert cli("--version").out.strip() == f"fleetctl {__version__}"
    r = cli("profiles", "show", "RTX-4090", "--json")
    assert r.code == 0 and json.loads(r.out)["memory_mib"] == 24564


def test_help_has_readable_metavars(cli):
    for command in ("plan", "simulate", "route-serve", "apply", "status", "probe"):
        text = cli(command, "--help").out
        assert "list[" not in text and "<path>" not in text and "<float>" not in text, text


ONE_MODEL = (
    "models:\n  - {name: m, profile: llama-3-8b, max_context: 4096,\n"
    "     variants: {bf16: {source: meta-llama/Meta-Llama-3-8B-Instruct}}}\n"
)


@pytest.mark.parametrize("recorded", ["no state.json", "destroyed"])
def test_status_of_a_fleet_never_applied_answers_from_state_without_ssh(
    cli, tmp_path, monkeypatch, recorded
):
    """Nothing recorded, nothing to check: status says so at once and exits 0, where it used
    to spend the connect timeout on every node. The node is a loopback port that listens and
    is never accepted from, so a connection would wait in its backlog: none may."""
    import socket
    import time

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with socket.socket() as node:
        node.bind(("127.0.0.1", 0))
        node.listen(8)
        inv = write(
            tmp_path,
            "ssh: {connect_timeout_s: 3}\n"
            "apply: {secrets: [VLLM_API_KEY]}\n"
            "nodes:\n"
            f"  - {{name: n1, host: 127.0.0.1, port: {node.getsockname()[1]}, "
            "gpus: {type: RTX-4090, count: 1}}\n" + ONE_MODEL,
        )
        if recorded == "destroyed":
            record_the_plan_as_applied(inv, serial=2, servers=False)
        start = time.monotonic()
        r = cli("status", inv, "--known-hosts", tmp_path / "kh")
        took = time.monotonic() - start
        j = cli("status", inv, "--known-hosts", tmp_path / "kh", "--json")
        node.setblocking(False)
        with pytest.raises(BlockingIOError):
            node.accept()  # nothing connected
    assert r.code == 0, r.out + r.err
    text = " ".join(r.out.split())
    assert "Nothing applied" in text and "no node was contacted" in text, text
    assert f"Run `fleetctl apply {inv}` to start the plan" in text and took < 3, (text, took)
    doc = json.loads(j.out)
    assert j.code == 0 and doc["ok"] is True and doc["servers"] == [] and doc["nodes"] == 0
    assert doc["applied"] is False and doc["serial"] == (2 if recorded == "destroyed" else 0)


def test_status_and_destroy_ask_only_for_the_secrets_they_use(cli, tmp_path, monkeypatch):
    """HF_TOKEN is for starting servers: status and destroy go on without it (and reach the
    node or not: exit 1 here, on a loopback port nothing listens on), never exit 2 for it."""
    import socket

    with socket.socket() as s:  # a port that refuses: bound, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_TOKEN", raising=False)
    inv = write(
        tmp_path,
        "ssh: {connect_timeout_s: 5}\n"
        "apply: {secrets: [HF_TOKEN]}\n"
        "nodes:\n"
        f"  - {{name: rtx-1, host: 127.0.0.1, port: {port}, gpus: {{type: RTX-4090, count: 1}}}}\n"
        + ONE_MODEL,
    )
    record_the_plan_as_applied(inv)  # status asks the nodes only about servers recorded
    r = cli("apply", inv, "--yes", "--known-hosts", tmp_path / "kh")
    assert r.code == 2 and "the secret HF_TOKEN has no value" in r.err
    r = cli("status", inv, "--known-hosts", tmp_path / "kh")
    assert r.code == 1 and "HF_TOKEN" not in r.err, r.err
    r = cli("destroy", inv, "--yes", "--known-hosts", tmp_path / "kh")
    assert r.code == 1 and "HF_TOKEN" not in r.err, r.err
    # VLLM_API_KEY is the one status reads (for /v1/models): without it, exit 2 naming it;
    # destroy still needs none.
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    inv.write_text(inv.read_text().replace("[HF_TOKEN]", "[HF_TOKEN, VLLM_API_KEY]"))
    r = cli("status", inv, "--known-hosts", tmp_path / "kh")
    assert r.code == 2 and "the secret VLLM_API_KEY has no value" in r.err, r.err
    assert "HF_TOKEN" not in r.err, r.err
    r = cli("destroy", inv, "--yes", "--known-hosts", tmp_path / "kh")
    assert r.code == 1 and "has no value" not in r.err, r.err
