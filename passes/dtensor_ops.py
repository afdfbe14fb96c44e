"""DTensor helpers that both analysis and the training runtime call, so that neither imports
the other: passes.strategies (analysis, on DTensor's private op schemas) and passes.runtime
(what the lowered graph calls while training) both name placements through here, and
passes.expert_order checks on real values the very relabelling op lowering then emits.
Public DTensor API only.

>>> from autopar.placements import parse_spec
>>> dtensor_placements(parse_spec("S(1),R")), planned(Replicate())
((Shard(dim=1), Replicate()), R)
>>> inverse_order([2, 0, 1])
[1, 2, 0]
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar import placements as pl


def planned(p) -> pl.Placement | None:
    """DTensor placement -> the planner's value; None for placements we do not plan with
    (strided shards). DTensor's masked partial (a row-wise lookup) is ``Partial("mask")``."""
    if type(p) is Replicate:
        return pl.R
    if type(p) is Shard:
        return pl.Shard(p.dim)
    if isinstance(p, Partial):
        name = type(p).__name__
        if name == "Partial":
            return pl.Partial(p.reduce_op)
        return pl.Partial("mask") if "Mask" in name else None
    return None


def dtensor_placement(p: pl.Placement):
    """Inverse of :func:`planned` for the placements lowering constructs (R, S(d), P)."""
    if p is pl.R:
        return Replicate()
    if p.is_shard:
        return Shard(p.dim)
    if p is pl.P:
        return Partial()
    raise ValueError(f"cannot construct DTensor placement {p}")


def dtensor_placements(spec: pl.Spec) -> tuple:
    """A mesh-wide planned placement as DTensor placements."""
    return tuple(dtensor_placement(p) for p in spec)


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
