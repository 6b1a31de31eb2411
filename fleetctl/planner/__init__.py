"""Planning: which model, format and TP size runs on which GPUs, explained, and its diff.

candidates.py evaluates each model x format x TP option on each node class (KV cache, speed,
capacity, SLO check); optimize.py chooses how many servers of each (a MILP, HiGHS);
expand.py puts them on nodes, keeping what runs where it is; place.py drives them and builds
the plan; explain.py writes why; diff.py compares the plan with the state. make.py, a layer
above (it runs the simulator), plans a fleet from its facts, calibration and state, as `plan`
and `apply` do.
"""

from fleetctl.planner.place import plan_fleet

__all__ = ["plan_fleet"]
