"""DTensor helpers that both analysis and the training runtime call, so that neither imports
the other: passes.strategies (analysis, on DTensor's private op schemas) and passes.runtime
(what the lowered graph calls while training) both name placements through here, and
passes.expert_order checks on real values the very relabelling op lowering then emits.
Public DTensor API only.

>>> parse_placement("S(1)"), placement_str(Replicate())
(Shard(dim=1), 'R')
>>> inverse_order([2, 0, 1])
[1, 2, 0]
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def placement_str(p) -> str | None:
    """DTensor placement -> short string; None for placements we do not plan with (strided)."""
    if type(p) is Replicate:
        return "R"
    if type(p) is Shard:
        return f"S({p.dim})"
    if isinstance(p, Partial):
        name = type(p).__name__
        if name == "Partial":
            return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
        return "P(mask)" if "Mask" in name else None
    return None


def parse_placement(s: str):
    """Inverse of :func:`placement_str` for the placements lowering constructs (R, S(d), P)."""
    if s == "R":
        return Replicate()
    if s.startswith("S("):
        return Shard(int(s[2:-1]))
    if s == "P":
        return Partial()
    raise ValueError(f"cannot construct placement {s!r}")


def inverse_order(order: list[int]) -> list[int]:
    """The slot of each expert: ``inverse_order(order)[order[j]] == j``."""
    slots = [0] * len(order)
    for j, e in enumerate(order):
        slots[e] = j
    return slots


def relabel_experts(x: torch.Tensor, slots: list[int], kind: str) -> torch.Tensor:
    """The router in slots instead of experts (passes.expert_order): ``kind`` "scores"
    permutes the last (expert) dim, ``x[..., slots]``; "ids" maps each chosen expert id to
    its slot, ``slots[x]``. A local op on each device's piece (a permutation commutes with
    partial sums and with splits of other dims); scores split on the expert dim are gathered
    on those mesh dims first and split again after."""
    if not isinstance(x, DTensor):
        return _relabel_local(x, slots, kind)
    placements_before = tuple(x.placements)
    if kind == "scores":
        expert_dim = x.dim() - 1
        whole = tuple(Replicate() if p.is_shard(expert_dim) else p for p in placements_before)
        if whole != placements_before:
            x = x.redistribute(x.device_mesh, whole)
    local = _relabel_local(x.to_local(), slots, kind)
    out = DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
    return out.redistribute(x.device_mesh, placements_before) if tuple(out.placements) != placements_before else out


def _relabel_local(x: torch.Tensor, slots: list[int], kind: str) -> torch.Tensor:
    table = torch.tensor(slots, device=x.device)
    return x.index_select(-1, table) if kind == "scores" else table[x].to(x.dtype)
