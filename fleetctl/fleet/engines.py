"""The calibrated engine of a planned or recorded server: its deployment, the inventory that
describes it and the calibration, through the model's one lookup (`calibrated`)."""

from __future__ import annotations

from fleetctl.fleet.inventory import Inventory
from fleetctl.fleet.plan import Deployment
from fleetctl.fleet.state import State
from fleetctl.model.calibration import Calibrated, Calibration, calibrated
from fleetctl.model.perf import EnginePerf


def deployment_engine(
    d: Deployment, inv: Inventory, calibration: Calibration | None
) -> Calibrated | None:
    """The calibrated engine of one planned or recorded server; None where the inventory no
    longer describes it (its model, format or GPU type is gone)."""
    model = next((m for m in inv.models if m.name == d.model), None)
    gpu = next((n.gpu for n in inv.nodes if n.gpu.name == d.gpu_type), None)
    fmt = (
        next((v.format for v in model.variants if v.format.name == d.variant), None)
        if model
        else None
    )
    if model is None or gpu is None or fmt is None:
        return None
    s = d.server
    perf = EnginePerf(gpu, model.profile, fmt, s.tensor_parallel_size, s.kv_cache_dtype)
    return calibrated(
        calibration,
        perf,
        s.kv_budget_tokens,
        vllm_version=inv.spec.apply.vllm_version,
        max_model_len=s.max_model_len,
        gpu_memory_utilization=s.gpu_memory_utilization,
    )


def server_engines(
    inv: Inventory, state: State, calibration: Calibration
) -> dict[tuple[str, tuple[int, ...]], Calibrated]:
    """Per recorded server (node, GPUs): its engine as the one calibrated model has it."""
    out = {}
    for d in state.deployments:
        engine = deployment_engine(d, inv, calibration)
        if engine is not None:
            out[(d.node, tuple(d.gpu_indices))] = engine
    return out
