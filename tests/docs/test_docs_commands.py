"""Every `fleetctl` command the README and the docs show names a command and options that
exist: a renamed flag or command fails here, not in a reader's terminal.

The tutorial's commands are also run, whole (test_tutorial.py); the others are read against
the CLI's own definitions (typer's commands and options; `emulate` takes vLLM's flags too).
"""

from __future__ import annotations

import re
import shlex

import pytest
import typer

from fleetctl.cli import app
from tests.conftest import REPO

PAGES = [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]
FENCE = re.compile(r"^```(?:sh|bash|console)[^\n]*\n(.*?)^```", re.S | re.M)


def documented() -> list[tuple[str, str]]:
    """(page, command line) for every `fleetctl ...` line in a shell block."""
    out = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            text = re.sub(r"\\\n\s*", " ", block)  # continued lines joined
            for line in text.splitlines():
                line = line.split(" #", 1)[0].strip().rstrip("&").strip()
                line = line.removeprefix("$ ")
                if line.startswith("fleetctl "):
                    out.append((str(page.relative_to(REPO)), line))
    return out


INLINE = re.compile(r"`(fleetctl [^`]+)`")


def inline() -> list[tuple[str, str]]:
    """(page, span) for every inline `fleetctl ...` code span outside shell blocks."""
    out = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        out += [(str(page.relative_to(REPO)), m) for m in INLINE.findall(text.replace("\\|", "|"))]
    return out


ROOT = typer.main.get_command(app)  # the click tree `fleetctl --help` prints


def command_at(path: list[str]):  # type: ignore[no-untyped-def]
    """The command `fleetctl PATH...`."""
    cmd = ROOT
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


def options_of(path: list[str]) -> tuple[set[str], bool]:
    """The options the command at `path` takes, and whether it takes others too."""
    if path == ["emulate"]:
        from fleetctl.emulator.args import _parser

        flags = {s for a in _parser()._actions for s in a.option_strings}
        return flags, True  # `vllm serve` flags are accepted (ignored with a warning)
    params = command_at(path).params
    flags = {o for p in params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    return flags | {"--help", "--debug"}, False


def command_path(words: list[str], strict: bool = True) -> list[str]:
    """The subcommand names at the start of `words` (`traces get`, `profiles show`); with
    `strict`, a word where a subcommand must stand has to name one."""
    cmd = ROOT
    path: list[str] = []
    for w in words:
        subs = getattr(cmd, "commands", None)
        if not subs or (not strict and w not in subs):
            break
        assert w in subs, f"no command `fleetctl {' '.join([*path, w])}`"
        path.append(w)
        cmd = subs[w]
    return path


def test_the_docs_show_commands() -> None:
    assert len(documented()) >= 20, "the docs' commands were not found"
    assert len(inline()) >= 40, "the docs' inline commands were not found"


@pytest.mark.parametrize(("page", "span"), inline())
def test_inline_command_names_real_options(page: str, span: str) -> None:
    """A span in prose or a table (`fleetctl plan INVENTORY [--json] ...`): its command
    exists and every --flag it names is that command's."""
    words = [w for w in re.split(r"[\s\[\]()|]+", span)[1:] if w]
    path = command_path(words, strict=False)
    known, open_ended = options_of(path)
    # `profiles list | show NAME | import-hf-config ... --name X`: alternatives share a span
    parent = path[:-1]
    siblings = command_at(parent)
    for w in words:
        if parent and w != path[-1] and w in getattr(siblings, "commands", {}):
            known |= options_of([*parent, w])[0]
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
        assert flag in known or open_ended, (
            f"{page}: `{span}` names {flag}, which `fleetctl {' '.join(path)}` does not take"
        )


@pytest.mark.parametrize(("page", "line"), documented())
def test_documented_command_exists(page: str, line: str) -> None:
    words = shlex.split(line)[1:]
    words = [w for w in words if w != "--debug"]
    path = command_path(words)
    known, open_ended = options_of(path)
    for word in words[len(path) :]:
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        assert flag in known or open_ended, (
            f"{page}: `{line}` uses {flag}, which `fleetctl {' '.join(path)}` does not take"
        )
