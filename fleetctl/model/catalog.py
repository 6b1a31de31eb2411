"""Hardware, model and quantization-format profiles: schemas, loading, and lookup by name."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fleetctl.base.errors import Location, UserError, shown, suggestion
from fleetctl.base.resources import bundled
from fleetctl.base.validation import Strict, validate
from fleetctl.base.yamlsrc import load_yaml
from fleetctl.vllm.flags import ServeFlags, parse_help

Architecture = Literal["volta", "turing", "ampere", "ada", "hopper", "blackwell"]
ComputeDtype = Literal["fp16", "bf16", "fp8", "int8"]


class Tflops(Strict):
    """Dense tensor-core throughput in TFLOPS (TOPS for int8); None where the GPU lacks it."""

    fp16: float
    bf16: float | None = None
    fp8: float | None = None
    int8: float | None = None


class GpuProfile(Strict):
    name: str
    aliases: tuple[str, ...] = ()
    vendor: Literal["nvidia"] = "nvidia"
    architecture: Architecture
    compute_capability: str
    memory_mib: int = Field(gt=0)
    # What CUDA reports as the card's total (cudaMemGetInfo: vLLM's total_gpu_memory), which
    # gpu_memory_utilization multiplies; unset: memory_mib less perf.CUDA_INVISIBLE_BYTES.
    cuda_total_mib: int | None = Field(None, gt=0)
    memory_type: str
    memory_bandwidth_gb_s: float = Field(gt=0)
    tflops: Tflops
    form_factor: Literal["sxm", "pcie"]
    interconnect: Literal["nvlink", "pcie"]
    nvlink_gb_s: float | None = Field(None, gt=0)
    pcie_gen: int
    tdp_w: int
    decode_efficiency: float = Field(gt=0, le=1)
    # Default price of one GPU per hour (USD, on-demand), used where a node's inventory entry
    # gives no cost_per_hour; its origin is named in `sources`. null: no default.
    cost_per_hour: float | None = Field(None, ge=0, le=1e5)
    sources: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _link(self) -> GpuProfile:
        # The TP all-reduce cost divides by it (perf._allreduce_per_token).
        if self.interconnect == "nvlink" and self.nvlink_gb_s is None:
            raise ValueError(
                "interconnect nvlink needs nvlink_gb_s | give the NVLink bandwidth in GB/s,"
                " or set interconnect: pcie"
            )
        return self

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 2**20

    @property
    def cuda_total_bytes(self) -> int | None:
        """The total CUDA reports, where the profile gives it."""
        return None if self.cuda_total_mib is None else self.cuda_total_mib * 2**20

    def peak_flops(self, dtype: ComputeDtype) -> float:
        """Peak dense FLOP/s for a compute dtype, falling back to fp16 where it is missing."""
        value = getattr(self.tflops, dtype) or self.tflops.fp16
        return value * 1e12


class ModelProfile(Strict):
    name: str
    hf_id: str | None = None
    architecture: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    max_context: int = Field(gt=0)
    params_total: int = Field(gt=0)
    params_active: int = Field(gt=0)
    num_experts: int | None = None
    experts_per_token: int | None = None
    torch_dtype: str = "bfloat16"
    sources: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> ModelProfile:
        if self.params_active > self.params_total:
            raise ValueError("params_active exceeds params_total | fix the parameter counts")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                "num_attention_heads is not a multiple of num_kv_heads | check config.json"
            )
        return self

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def embedding_params(self) -> int:
        """Input embeddings plus lm_head: kept in 16 bits by the weight-only formats."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


class VllmFlags(Strict):
    quantization: str | None = None
    quantization_by_architecture: dict[Architecture, str] = Field(default_factory=dict)
    # The first vLLM release that runs quantization_by_architecture's kernels (AWQ checkpoints
    # became Marlin in 0.5.3, vllm#6612; GPTQ in 0.4.2, vllm#3922). Before it, `quantization`'s
    # own kernel runs on every architecture. None: every release does.
    by_architecture_from: str | None = Field(None, pattern=r"^\d+\.\d+(\.\d+)?$")
    dtype: Literal["bfloat16", "float16", "auto"]


class FormatProfile(Strict):
    name: str
    description: str
    weight_bytes_per_param: float = Field(gt=0, le=4)
    activation_dtype: Literal["bfloat16", "float16"]
    compute: dict[Architecture, ComputeDtype]
    vllm: VllmFlags
    kernel_efficiency: dict[Architecture, float]
    # The efficiency of `vllm.quantization`'s own kernel where a release runs it in place of
    # quantization_by_architecture's (before vllm.by_architecture_from); unset: as above.
    plain_kernel_efficiency: dict[Architecture, float] = Field(default_factory=dict)
    sources: tuple[str, ...] = Field(min_length=1)

    @field_validator("kernel_efficiency", "plain_kernel_efficiency")
    @classmethod
    def _efficiency_range(cls, v: dict[str, float]) -> dict[str, float]:
        for arch, eff in v.items():
            if not 0 < eff <= 1.5:
                raise ValueError(f"kernel_efficiency for {arch} is {eff} | use a value in (0, 1.5]")
        return v

    @model_validator(mode="after")
    def _covers(self) -> FormatProfile:
        missing = set(self.compute) - set(self.kernel_efficiency)
        if missing:
            raise ValueError(
                f"no kernel_efficiency for {', '.join(sorted(missing))} | "
                "give one for every architecture in 'compute'"
            )
        return self

    @property
    def architectures(self) -> tuple[str, ...]:
        """Architectures that run this format: those with a compute dtype."""
        return tuple(self.compute)

    def runs_on(self, gpu: GpuProfile) -> bool:
        return gpu.architecture in self.compute

    def _by_architecture(self, vllm_version: str | None) -> bool:
        """Whether `vllm_version` (None: fleetctl's target) runs the by-architecture kernels."""
        first = self.vllm.by_architecture_from
        if first is None or vllm_version is None:
            return True
        from fleetctl.vllm.release import parse_version

        return parse_version(vllm_version) >= parse_version(first)

    def quantization_flag(self, gpu: GpuProfile, vllm_version: str | None = None) -> str | None:
        """The --quantization a release runs this format with on `gpu`."""
        if self._by_architecture(vllm_version):
            return self.vllm.quantization_by_architecture.get(
                gpu.architecture, self.vllm.quantization
            )
        return self.vllm.quantization

    def kernel_efficiency_on(
        self, architecture: Architecture, vllm_version: str | None = None
    ) -> float:
        """The weights' kernel efficiency on an architecture under a release: the plain
        kernel's where the release predates the by-architecture one (and the architecture has
        one), else `kernel_efficiency`'s."""
        plain = architecture in self.vllm.quantization_by_architecture and not (
            self._by_architecture(vllm_version)
        )
        if plain and architecture in self.plain_kernel_efficiency:
            return self.plain_kernel_efficiency[architecture]
        return self.kernel_efficiency.get(architecture, 1.0)

    @property
    def activation_bytes(self) -> int:
        return 2


KINDS: dict[str, type[Strict]] = {
    "gpus": GpuProfile,
    "models": ModelProfile,
    "formats": FormatProfile,
}


@dataclass(frozen=True)
class Catalog:
    """Every profile known to this run, by kind and canonical name."""

    gpus: dict[str, GpuProfile] = field(default_factory=dict)
    models: dict[str, ModelProfile] = field(default_factory=dict)
    formats: dict[str, FormatProfile] = field(default_factory=dict)
    origin: dict[tuple[str, str], Path] = field(default_factory=dict)
    # `vllm serve --help=all` of each vLLM release, by version (profiles/vllm/VERSION.txt).
    vllm_help: dict[str, Path] = field(default_factory=dict)

    @property
    def target_vllm_version(self) -> str | None:
        """The vLLM release fleetctl targets when nothing says otherwise: the newest it knows."""
        return max(self.vllm_help, key=_version_key) if self.vllm_help else None

    def serve_flags(self, version: str | None, where: Location | None = None) -> ServeFlags:
        """The flags of that release's `vllm serve` (default: the newest one known)."""
        if not self.vllm_help:
            raise UserError("no vLLM flag list found", where, "add profiles/vllm/VERSION.txt")
        if version is None:
            version = max(self.vllm_help, key=_version_key)
        path = self.vllm_help.get(version)
        if path is None:
            known = ", ".join(sorted(self.vllm_help, key=_version_key))
            raise UserError(
                f"no `vllm serve --help=all` for vLLM {shown(version)} (known: {known})",
                where,
                f"save it as profiles/vllm/{version}.txt in a --profiles folder, or pick a "
                "known version",
            )
        return _serve_flags(path, version)

    def gpu(self, name: str, where: Location | None = None) -> GpuProfile:
        """A GPU by profile name or by any alias (e.g. what nvidia-smi prints), any case."""
        found = self.find_gpu(name)
        if found is None:
            raise _unknown("GPU type", name, [*self.gpus], where, "a name from profiles/gpus")
        return found

    def find_gpu(self, name: str) -> GpuProfile | None:
        key = _norm(name)
        for gpu in self.gpus.values():
            if key in _names_of(gpu):
                return gpu
        return None

    def model(self, name: str, where: Location | None = None) -> ModelProfile:
        for key, m in self.models.items():
            if _norm(key) == _norm(name):
                return m
        raise _unknown("model profile", name, [*self.models], where, "a name from profiles/models")

    def format(self, name: str, where: Location | None = None) -> FormatProfile:
        for key, f in self.formats.items():
            if _norm(key) == _norm(name):
                return f
        raise _unknown("quantization format", name, [*self.formats], where, "one of")


@functools.lru_cache(maxsize=256)
def _names_of(gpu: GpuProfile) -> frozenset[str]:
    """Every normalised name a GPU answers to (asked once per node of a large inventory)."""
    return frozenset(_norm(n) for n in (gpu.name, *gpu.aliases))


@functools.lru_cache(maxsize=8)
def _serve_flags(path: Path, version: str) -> ServeFlags:
    return parse_help(path.read_text(encoding="utf-8"), version)


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    """0.32.0 < 0.32.1 < 0.33.0; a part that is not a number sorts as text."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.+-]", version))


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _unknown(kind: str, name: str, known: list[str], where: Location | None, fix: str) -> UserError:
    hint = suggestion(name, known)
    if hint:
        return UserError(f"unknown {kind} '{name}'", where, hint)
    listed = ", ".join(sorted(known))
    return UserError(f"unknown {kind} '{name}'", where, f"use {fix}: {listed}")


def profile_dirs(extra: list[Path] | None = None) -> list[Path]:
    """Bundled profiles first, then FLEETCTL_PROFILES (os.pathsep-separated), then --profiles."""
    dirs = [bundled("profiles")]
    env = os.environ.get("FLEETCTL_PROFILES")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs += list(extra or [])
    return dirs


def load_catalog(extra: list[Path] | None = None) -> Catalog:
    """Load every profile; a later folder overrides an earlier one's profile of the same name."""
    cat = Catalog()
    for folder in profile_dirs(extra):
        if not folder.is_dir():
            raise UserError("profiles folder not found", Location(str(folder)), "check the path")
        for kind, cls in KINDS.items():
            table = getattr(cat, kind)
            for path in sorted((folder / kind).glob("*.yaml")):
                src = load_yaml(path, "profile")
                profile: Any = validate(cls, src)
                for same in [k for k in table if _norm(k) == _norm(profile.name)]:
                    del table[same]  # a user's profile overrides a bundled one by name
                table[profile.name] = profile
                cat.origin[(kind, profile.name)] = path
        for path in sorted((folder / "vllm").glob("*.txt")):
            cat.vllm_help[path.stem] = path
    # Aliases must point at one GPU only, or nvidia-smi names would be ambiguous.
    seen: dict[str, str] = {}
    for gpu in cat.gpus.values():
        for alias in (gpu.name, *gpu.aliases):
            other = seen.setdefault(_norm(alias), gpu.name)
            if other != gpu.name:
                raise UserError(
                    f"GPU alias '{alias}' names both {other} and {gpu.name}",
                    Location(str(cat.origin[("gpus", gpu.name)])),
                    "remove it from one of them",
                )
    return cat
