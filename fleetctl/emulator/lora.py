"""LoRA adapters on an emulated server: --lora-modules, their /v1/models cards, the metric."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from fleetctl.base import names
from fleetctl.base.errors import UserError
from fleetctl.emulator.protocol import ApiError

# vLLM 0.32's defaults (vllm/config/lora.py): one adapter batched at once, rank up to 16.
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_RANK = 16
# vLLM keeps one series of vllm:lora_requests_info per (running, waiting) label set it has
# ever seen, each holding the time it was last true; a scraper takes the newest. The emulator
# keeps the newest few only, so a long run's /metrics stays bounded.
KEPT_SERIES = 32


@dataclass(frozen=True)
class LoraConfig:
    """--enable-lora's settings: slots, the largest rank, and the adapters loaded at start."""

    max_loras: int = DEFAULT_MAX_LORAS
    max_rank: int = DEFAULT_MAX_RANK
    modules: tuple[tuple[str, str], ...] = ()  # (name, path), in the order given
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    # are served; each load takes `load_s` emulated seconds (--lora-load-seconds), or, None,
    # the performance model's read from disk (model/lora.py).
    runtime: bool = False
    load_s: float | None = None
    max_cpu_loras: int | None = None  # --max-cpu-loras; None: vLLM's default, max_loras


def parse_module(text: str) -> tuple[str, str]:
    """One --lora-modules value as vLLM takes it: `name=path`, or JSON with name and path."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
            name, path = obj["name"], obj["path"]
        except (ValueError, KeyError, TypeError):
            name = path = None
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise UserError(
            f"emulate: --lora-modules {text!r} is not name=path",
            None,
            'write --lora-modules NAME=PATH or \'{"name": NAME, "path": PATH}\'',
        )
    names.model_name(name)  # it becomes a model name, a metric label and a routing key
    return name, path


def lora_config(
    enable: bool,
    max_loras: int | None,
    max_rank: int | None,
    modules: list[str],
    load_s: float | None = None,
    max_cpu_loras: int | None = None,
) -> LoraConfig | None:
    """The parsed flags, or None without --enable-lora (vLLM then serves no adapter)."""
    if not enable:
        if modules:
            raise UserError(
                "emulate: --lora-modules without --enable-lora", None, "add --enable-lora"
            )
        return None
    parsed = tuple(parse_module(m) for m in modules)
    # vllm/envs.py reads the variable so: "1" or "true", any case, spaces stripped.
    runtime = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower()
    return LoraConfig(
        max_loras or DEFAULT_MAX_LORAS,
        max_rank or DEFAULT_MAX_RANK,
        parsed,
        runtime in ("1", "true"),
        load_s,
        max_cpu_loras,
    )


@dataclass
class Adapters:
    """The adapters one server has loaded, and which of them requests run or wait on."""

    config: LoraConfig
    loaded: dict[str, str] = field(default_factory=dict)  # name -> path, in load order
    # (waiting, running) label values -> the time they were last true, oldest first.
    series: dict[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.loaded.update(self.config.modules)

    async def load(
        self, body: dict[str, Any], base_names: tuple[str, ...], scale: float, seconds: float
    ) -> str:
        """POST /v1/load_lora_adapter as vLLM 0.32 answers it (vllm/entrypoints/openai/
        models/serving.py, load_lora_adapter and its checks), after the load's `seconds`."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ApiError(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name in base_names:
            raise ApiError(
                400,
                f"The lora adapter '{name}' conflicts with a served base model.",
                "InvalidUserInput",
            )
        if not body.get("load_inplace") and name in self.loaded:
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        await asyncio.sleep(seconds / scale)  # emulated seconds, at the time scale
        self.loaded[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict[str, Any]) -> str:
        """POST /v1/unload_lora_adapter as vLLM 0.32 answers it."""
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                "InvalidUserInput",
            )
        if name not in self.loaded:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, parent: str, created: int, permission: dict[str, Any]) -> list[dict]:
        """vLLM's /v1/models card of each loaded adapter (vllm/entrypoints/openai/models/
        serving.py, OpenAIServingModels.show_available_models): id the adapter's name, root
        its path, parent the base model's served name, no max_model_len."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": parent,
                "max_model_len": None,
                "permission": [permission],
            }
            for name, path in self.loaded.items()
        ]

    def metric(self, running: list[str], waiting: list[str]) -> str:
        """vllm:lora_requests_info as vLLM 0.32 writes it (vllm/v1/metrics/loggers.py,
        PrometheusStatLogger): a gauge set to the current Unix time, labelled max_lora and the
        comma-joined names of the adapters with requests waiting and running (labels in its
        labelnames order); one series per label set seen, so the newest value is the current
        one."""
        key = (",".join(waiting), ",".join(running))
        self.series.pop(key, None)
        self.series[key] = time.time()
        while len(self.series) > KEPT_SERIES:
            del self.series[next(iter(self.series))]
        lines = [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
        ]
        for (w, r), at in self.series.items():
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{self.config.max_loras}",'
                f'waiting_lora_adapters="{w}",running_lora_adapters="{r}"}} {_go_float(at)}'
            )
        return "\n".join(lines) + "\n"


def _go_float(value: float) -> str:
    """prometheus_client's rendering of a large float (floatToGoString): 1.7e+09 style."""
    s = repr(value)
    dot = s.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s
