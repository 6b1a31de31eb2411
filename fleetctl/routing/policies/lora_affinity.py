"""`lora-affinity`: the Gateway API Inference Extension's LoRA-affinity scorer, as peers run it."""

from __future__ import annotations

from collections.abc import Sequence

from fleetctl.routing.policies.prefix_kv import PrefixKv
from fleetctl.routing.prefix import PrefixView
from fleetctl.routing.types import Backend, Request


class LoraAffinity(PrefixKv):
    """The Gateway API Inference Extension's endpoint picker (llm-d's too) with its LoRA
    affinity scorer, all four scorers at weight 1 and the max-score picker: the profile of
    its scheduler test (kubernetes-sigs/gateway-api-inference-extension,
    pkg/epp/scheduling/scheduler_test.go, TestSchedule), scorer in
    pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go.

    - lora affinity, from the newest vllm:lora_requests_info series (ActiveModels: running
      adapters, WaitingModels: waiting, MaxActiveModels: max_lora): 1.0 where the request's
      adapter runs; else 0.8 where running plus waiting adapters leave a slot free; else 0.6
      where it waits; else 0. A base-model request is scored the same way under the base
      model's name, so it too leans to servers with a free slot, as the peer's does.
    - queue, kv-cache utilization, prefix (whole blocks matched / the prompt's): as in
      `PrefixKv` (its approximate prefix scorer here reads the router's index).

    Every candidate already has the adapter loaded (Policy.eligible): the affinity tells a
    server whose GPU slots hold it from one that keeps it in CPU memory only.
    """

    name = "lora-affinity"
    LORA_WEIGHT = 1.0

    def __init__(self, seed: int = 0, prefix: PrefixView | None = None) -> None:
        super().__init__(seed, 1.0, 1.0, 1.0, prefix=prefix)

    def lora_score(self, req: Request, b: Backend) -> float:
        target = req.adapter or req.model
        if target in b.lora_running:
            return 1.0
        if len(b.lora_running) + len(b.lora_waiting) < b.lora_max:
            return 0.8
        if target in b.lora_waiting:
            return 0.6
        return 0.0

    def scores(self, req: Request, backends: Sequence[Backend]) -> dict[str, float]:
        out = super().scores(req, backends)
        for b in backends:
            out[b.name] += self.LORA_WEIGHT * self.lora_score(req, b)
        return out
