"""fleetctl: plan, apply, route and simulate vLLM serving on heterogeneous GPU fleets."""

__version__ = "0.1.0"
