"""The one JSON printer every command's `--json` goes through."""

from __future__ import annotations

import json
import sys
from typing import Any


def dump_json(data: Any) -> str:
    """Indented JSON, except that list items print one per line: as readable for small
    documents and ~10x faster for plans with thousands of deployments (indent=N makes the
    json module fall back to pure Python)."""
    if not isinstance(data, dict):
        return json.dumps(data, indent=2)
    lines = ["{"]
    for i, (key, value) in enumerate(data.items()):
        comma = "," if i < len(data) - 1 else ""
        if isinstance(value, list) and value:
            items = ",\n    ".join(json.dumps(v, separators=(", ", ": ")) for v in value)
            lines.append(f"  {json.dumps(key)}: [\n    {items}\n  ]{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines)


def print_json(data: Any) -> None:
    sys.stdout.write(dump_json(data) + "\n")
