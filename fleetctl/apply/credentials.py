"""Secrets for the servers (HF_TOKEN, VLLM_API_KEY, ...): from the environment or a 0600 file.

The inventory lists only their names. Values are read here, go to each node on the SSH
channel's stdin into a 0600 file, and are never printed, logged, planned or recorded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fleetctl.base.errors import Location, UserError


def load_secrets(names: list[str], secrets_file: Path | None = None) -> dict[str, str]:
    """The value of every named secret; the file (KEY=VALUE lines) wins over the environment."""
    from_file: dict[str, str] = {}
    if secrets_file is not None:
        from_file = read_secrets_file(secrets_file)
    out: dict[str, str] = {}
    for name in names:
        value = from_file.get(name, os.environ.get(name))
        if not value:
            raise UserError(
                f"the secret {name} has no value",
                Location(path="apply.secrets"),
                f"export {name}=... or put {name}=... in a 0600 file given with --secrets-file",
            )
        out[name] = value
    return out


def read_secrets_file(path: Path) -> dict[str, str]:
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}", None, "check the path") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(
            f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):o})",
            None,
            f"chmod 600 {path}",
        )
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip():
            raise UserError(
                "not a KEY=VALUE line", Location(str(path), n), "write e.g. HF_TOKEN=hf_..."
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out
