"""Nothing an inventory string holds can run on a node: hostile values go through validation,
the planner and the real node-side scripts over real SSH, under both supervisors, and the
server must receive exactly those values as data while a marker file proves nothing ran.

Hypothesis generates the values with a fixed seed and a small budget in CI; a longer local run:
FLEETCTL_FUZZ_EXAMPLES=300 python -m pytest tests/apply/test_node_injection.py
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fleetctl.apply.node import NodeAgent
from fleetctl.base.errors import UserError
from fleetctl.fleet.inventory import load_inventory
from fleetctl.fleet.ssh import SshOptions, SshSession, Target
from fleetctl.model.catalog import load_catalog
from fleetctl.planner import plan_fleet
from harness.sshhosts import TestHosts, require
from tests.conftest import TESTS

EXAMPLES = int(os.environ.get("FLEETCTL_FUZZ_EXAMPLES", "12"))
FAKE_SYSTEMD = TESTS / "fake_systemd.py"

# The node's `vllm`: records its argv and environment where it runs (its server folder), then
# stays up until apply stops it. argv is written last, by rename: its arrival is the event.
RECORDER = f"""#!/bin/sh
{sys.executable} -c 'import json, os, sys; json.dump(dict(os.environ), open("environ.json", "w"))'
printf '%s\\0' "$@" > argv.tmp && mv argv.tmp argv
exec sleep 300
"""


@pytest.fixture(scope="module")
def node():
    require()
    with TestHosts(1, names=["gpu-1"]) as hs:
        h = hs[0]
        hs.install(0, "vllm", RECORDER)
        for tool in ("systemd-run", "systemctl"):
            hs.install(0, tool, f'#!/bin/sh\nexec {sys.executable} {FAKE_SYSTEMD} {tool} "$@"\n')
        target = Target(h.name, h.address, user="root", identity_file=str(hs.client_key))
        with SshSession(target, SshOptions(known_hosts=hs.known_hosts)) as session:
            yield h, session


def payloads(mark: Path) -> st.SearchStrategy[str]:
    """Text that runs `touch mark` wherever a shell, sh's `.`, or systemd would interpret it."""
    m = str(mark)
    attacks = [
        f"$(touch {m})",
        f"`touch {m}`",
        f"; touch {m}",
        f"' ; touch {m} ; '",
        f'" ; touch {m} ; "',
        f"$(touch${{IFS}}{m})",
        f"\\'; touch {m}; \\'",
        "${HF_TOKEN}",
        "$HF_TOKEN",
        "$$",
        "%h %n %%",
        "\\",
        "'",
        '"',
        "--port",
        "-",
        "*",
        "~",
        "&",
        "|",
        " ",
    ]
    # No control characters: validation refuses them in every field (tested on its own).
    alphabet = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))
    return st.lists(
        st.one_of(st.sampled_from(attacks), st.text(alphabet, max_size=6)), min_size=1, max_size=5
    ).map("".join)


def inventory(tmp: Path, host: str, v: dict[str, str], supervisor: str) -> Path:
    doc = {
        "ssh": {"user": "root"},
        "nodes": [{"name": "gpu-1", "host": host, "gpus": {"type": "A100-SXM4-80GB"}}],
        "models": [
            {
                "name": "llama-3-8b",
                "profile": "llama-3-8b",
                "variants": {"bf16": {"source": "/models/" + v["source"]}},
                "max_context": 4096,
                "env": {v["env_key"]: v["env_value"]},
                "vllm_args": ["--chat-template", v["arg"]],
            }
        ],
        "apply": {
            "supervisor": supervisor,
            "secrets": ["HF_TOKEN"],
            "vllm_command": shlex.join(["vllm", v["command_word"]]),
        },
    }
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path


@pytest.mark.parametrize("supervisor", ["nohup", "systemd"])
def test_hostile_strings_reach_the_server_as_data(node, tmp_path_factory, supervisor):
    h, session = node
    mark = h.dir / "pwned"
    catalog = load_catalog()
    text = payloads(mark)
    env_keys = st.one_of(st.sampled_from(["MY_VAR", "VLLM_LOGGING_LEVEL", "_x1"]), text)

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(source=text, env_key=env_keys, env_value=text, arg=text, secret=text, word=text)
    def check(source, env_key, env_value, arg, secret, word):
        tmp = tmp_path_factory.mktemp("inv")
        values = {
            "source": source,
            "env_key": env_key,
            "env_value": env_value,
            "arg": arg,
            "command_word": word,
        }
        try:
            inv = load_inventory(inventory(tmp, h.address, values, supervisor), catalog)
        except UserError:
            assume(False)  # refused at the door: nothing reached a node
        [d] = plan_fleet(inv).deployments
        agent = NodeAgent(session, inv.spec.apply.vllm_command, timeout_s=30)
        sid, _ = agent.start(d, {"HF_TOKEN": secret}, "now", inv.spec.apply.supervisor)
        folder = h.dir / "home" / ".fleetctl" / "servers" / sid
        try:
            deadline = time.monotonic() + 30
            while not (folder / "argv").exists():
                assert time.monotonic() < deadline, (folder / "log").read_text()
                time.sleep(0.01)
            argv = (folder / "argv").read_bytes().decode().split("\0")[:-1]
            environ = json.loads((folder / "environ.json").read_text())
        finally:
            agent.stop([sid], grace_s=5)
        assert not mark.exists(), "a value ran as a command on the node"
        assert argv == [word, *d.vllm_args], "the server must get exactly the planned arguments"
        assert environ["HF_TOKEN"] == secret
        assert environ[env_key] == env_value
        reached.append(sid)

    reached: list[str] = []
    check()
    assert len(reached) >= EXAMPLES // 2, "most examples must get past validation to a node"
