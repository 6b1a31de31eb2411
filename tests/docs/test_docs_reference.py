"""The generated reference pages (every command's options, the inventory schema, the public
traces) are committed as the code gives them, so they read whole in the repository and cannot
drift; and the schema states the bounds the validators hold, as the inventory page does."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from types import ModuleType

import pytest

from fleetctl.base import limits, names
from tests.conftest import REPO

HOOK = REPO / "docs" / "hooks" / "generated.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generated", HOOK)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("page", "part"),
    [("cli.md", "cli"), ("schema.md", "inventory-schema"), ("traces.md", "traces")],
)
def test_each_reference_page_holds_what_the_code_generates(page, part):
    """Read in the repository, the page holds its content, not a marker the build fills."""
    gen = generator()
    text = (REPO / "docs" / "reference" / page).read_text()
    start, end = f"<!-- generated: {part} -->\n", f"\n<!-- end generated: {part} -->"
    assert start in text and end in text, f"{page}: the generated {part} is not committed"
    committed = text.split(start, 1)[1].split(end, 1)[0]
    assert committed == gen.PARTS[part](), (
        f"docs/reference/{page} differs from the code: run `python docs/hooks/generated.py`"
    )


def test_the_generator_check_names_a_stale_page(tmp_path):
    """`python docs/hooks/generated.py --check` is what says which page to regenerate."""
    r = subprocess.run(
        [sys.executable, str(HOOK), "--check"], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0, r.stderr
    gen = generator()
    stale = "# x\n\n<!-- generated: traces -->\nold\n<!-- end generated: traces -->\n"
    assert gen.fill(stale) != stale and gen.fill(gen.fill(stale)) == gen.fill(stale)
    assert gen.fill("<!-- generated: traces -->\n") == gen.fill(stale).split("\n", 2)[2]


def schema_max(section: str, field: str) -> int:
    text = generator().inventory_schema()
    table = text.split(f"### {section}\n", 1)[1].split("\n### ", 1)[0]
    row = next(line for line in table.splitlines() if line.startswith(f"| `{field}` |"))
    return int(re.search(r"length <= (\d+)", row).group(1))


HOST_253 = ".".join(["a" * 63] * 3 + ["b" * 61])


@pytest.mark.parametrize(
    ("section", "field", "check", "longest"),
    [
        ("NodeSpec", "name", names.name, "n" * limits.MAX_NAME),
        ("ModelSpec", "name", names.model_name, "m" * limits.MAX_MODEL_NAME),
        ("NodeSpec", "user", names.user, "u" * limits.MAX_USER),
        ("SshSpec", "user", names.user, "u" * limits.MAX_USER),
        ("NodeSpec", "host", names.host, HOST_253),
    ],
)
def test_the_schema_states_the_longest_name_the_validator_takes(section, field, check, longest):
    """The generated schema said 4096 (any text's bound) for names held to 63 characters."""
    assert schema_max(section, field) == len(longest)
    check(longest)
    with pytest.raises(ValueError):
        check(longest + "x")


def test_the_inventory_page_and_the_schema_agree_on_names():
    page = (REPO / "docs" / "reference" / "inventory.md").read_text()
    assert f"at most {limits.MAX_NAME} characters" in page
    assert schema_max("NodeSpec", "name") == limits.MAX_NAME
    assert "max_num_batched_tokens" in page and "vLLM's default" in page
