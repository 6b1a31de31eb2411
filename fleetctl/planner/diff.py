"""Terraform-like actions: what to create, replace, delete or keep to go from state to plan."""

from __future__ import annotations

from collections.abc import Sequence

from fleetctl.base.names import natural_key
from fleetctl.fleet.plan import Action, Deployment


def diff(desired: Sequence[Deployment], current: Sequence[Deployment]) -> tuple[Action, ...]:
    """Actions keyed by (node, GPUs): same slot and same flags is keep, other flags replace."""
    have = {d.key: d for d in current}
    want = {d.key: d for d in desired}
    out: list[Action] = []
    for key, d in want.items():
        old = have.get(key)
        if old is None:
            out.append(Action("create", d.node, d.gpu_indices, d.model, d.variant))
        elif old.args_hash == d.args_hash:
            out.append(Action("keep", d.node, d.gpu_indices, d.model, d.variant))
        else:
            detail = _what_changed(old, d)
            out.append(Action("replace", d.node, d.gpu_indices, d.model, d.variant, detail))
    for key, old in have.items():
        if key not in want:
            out.append(Action("delete", old.node, old.gpu_indices, old.model, old.variant))
    if have:  # with no state the actions already follow the plan's (sorted) order
        out.sort(key=lambda a: (natural_key(a.node), a.gpu_indices, a.op))
    return tuple(out)


def _what_changed(old: Deployment, new: Deployment) -> str:
    if (old.model, old.variant) != (new.model, new.variant):
        return f"was {old.model} {old.variant}"
    before, after = parse_flags(old.vllm_args), parse_flags(new.vllm_args)
    roles = [f"role {old.server.role} -> {new.server.role}"]
    changes = roles * (old.server.role != new.server.role) + [
        f"{flag} {before.get(flag, '(unset)')} -> {after.get(flag, '(unset)')}"
        for flag in sorted(before.keys() | after.keys())
        if before.get(flag) != after.get(flag)
    ]
    if dict(old.env) != dict(new.env):
        changes.append("environment")
    return "; ".join(changes[:4]) if changes else "arguments reordered"


def parse_flags(args: Sequence[str]) -> dict[str, str]:
    """`--flag value` pairs (a bare flag maps to ''), plus the positional arguments."""
    out: dict[str, str] = {}
    positional = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            out[arg] = args[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            positional.append(arg)
            i += 1
    out["(arguments)"] = " ".join(positional)
    return out
