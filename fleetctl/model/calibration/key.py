"""The class key measurements are kept under (GPU, model, format, TP, vLLM version,
max_model_len, node) and the best match for a class."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Protocol, TypeVar

from pydantic import Field

from fleetctl.model.calibration.rules import Name


@dataclass(frozen=True, order=True)
class Key:
    """What an entry is for. `node` only for a node that differs from its class (health)."""

    gpu: Name
    model: Name
    format: Name
    tp: Annotated[int, Field(ge=1)]
    vllm_version: str | None = None
    max_model_len: int | None = None
    node: str | None = None

    @property
    def text(self) -> str:
        out = f"{self.model} {self.format} on {self.tp}x {self.gpu}"
        if self.vllm_version:
            out += f", vLLM {self.vllm_version}"
        if self.max_model_len:
            out += f", max_model_len {self.max_model_len:,}"
        return out + (f" (node {self.node})" if self.node else "")


class Keyed(Protocol):
    @property
    def key(self) -> Key: ...

    @property
    def measured_at(self) -> str: ...


K = TypeVar("K", bound=Keyed)


def best(
    items: Iterable[K],
    cls: tuple[str, str, str, int],
    vllm_version: str | None,
    max_model_len: int | None = None,
) -> K | None:
    """Of `items` for a class (GPU, model, format, TP): a class-wide one (not one node's),
    then the same vLLM version, then the same max_model_len, then the newest."""
    found = [i for i in items if (i.key.gpu, i.key.model, i.key.format, i.key.tp) == cls]
    if not found:
        return None
    return max(
        found,
        key=lambda i: (
            i.key.node is None,
            vllm_version is not None and i.key.vllm_version == vllm_version,
            max_model_len is not None and i.key.max_model_len == max_model_len,
            i.measured_at,
        ),
    )
