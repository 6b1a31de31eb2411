"""A stand-in nvidia-smi for SSH test hosts: it replays recorded output, chosen by its
arguments (the recordings and where each came from: tests/data/nvidia/README.md)."""

from __future__ import annotations

from pathlib import Path

NVIDIA = Path(__file__).resolve().parent.parent / "tests" / "data" / "nvidia"
# Values read off the real RTX 4090 table capture (smi-rtx4090-x1-driver580.txt), in the
# probe's query format (see tests/data/nvidia/README.md: no real sample of that exists).
RTX_QUERY = (
    "0, NVIDIA GeForce RTX 4090, GPU-00000000-0000-4000-8000-000000004090, 24564, 232, 8.9, "
    "{driver}, [N/A], [N/A]\n"
)

FAKE_SMI = """#!/bin/sh
# Replays recorded nvidia-smi output, chosen by the arguments.
case "$*" in
  *--query-gpu=*) cat <<'EOF'
{query}EOF
  ;;
  *--query-compute-apps=*) ;;
  "topo -m") cat {topo} ;;
  *) cat {table} ;;
esac
"""


def fake_smi(query: str, table: str, topo: str) -> str:
    return FAKE_SMI.format(query=query, table=NVIDIA / table, topo=NVIDIA / topo)
