"""The bounds fleetctl puts on what it reads: sizes, expansion, counts, timeouts and names.

Each bound is a plain constant so messages and the README can name it; the few that a large
fleet may need to raise read an environment variable (documented in the README).
"""

from __future__ import annotations

import os


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        return default
    return value if value > 0 else default


# An inventory or profile file larger than this is refused before it is parsed.
# 1 MiB holds 10,000 nodes written out one per line (780 KB); ranges need far less.
MAX_FILE_BYTES = _env_int("FLEETCTL_MAX_INVENTORY_BYTES", 2**20)
# Scalars, mappings and lists a YAML document may hold once aliases are expanded: bounds
# "billion laughs" documents, which are tiny on disk and exponential once expanded.
MAX_YAML_VALUES = 150_000
MAX_YAML_DEPTH = 64
# Nesting of a state folder's JSON documents (state, facts, health, calibration): theirs is under
# ten levels; deeper is a damaged or hostile file, refused before anything recurses over it.
MAX_JSON_DEPTH = 64
# ... and their size: a calibration of a thousand classes is under 10 MB.
MAX_DOCUMENT_BYTES = 64 * 2**20
# GPUs one node may declare (`gpus.count`), so its GPU indices run from 0 to 63.
MAX_GPUS_PER_NODE = 64
# Nodes and GPUs after range expansion; checked before anything is expanded.
MAX_NODES = _env_int("FLEETCTL_MAX_NODES", 10_000)
MAX_GPUS = 8 * MAX_NODES
MAX_MODELS = 1_000
MAX_ADAPTERS = 1_000  # LoRA adapters of one model

MAX_NAME = 63  # node, label and variant names: one DNS label
MAX_MODEL_NAME = 128
MAX_HOST = 253  # a DNS name
MAX_USER = 64  # a login name
MAX_TEXT = 4096  # any other string field (paths, sources, env values, vllm_args items)
SHOWN = 80  # characters of a bad value quoted back in an error

# Ranges of the numbers an inventory holds, so a typo cannot become a hang or an overflow.
MAX_TIMEOUT_S = 86_400.0  # one day: the longest wait any command may be told to make
MAX_CONNECT_TIMEOUT_S = 300.0
MAX_TOKENS = 10_000_000  # context lengths and token counts
MAX_RATE = 1_000_000.0  # requests per second
MAX_REPLICAS = 100_000
MAX_NETWORK_GBPS = 3200.0  # a NIC's line rate: 8 x 400 Gb/s bonded is the most a node has
SURGE_PORT_OFFSET = 1000  # a replacement server's port: port_base + GPU index + this
