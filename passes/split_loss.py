"""The training step's loss on outputs a plan leaves split along the batch (``plan.outputs``).

Each device computes the loss on its own rows, as DDP and FSDP do: no device gathers the
logits. For a loss that averages over the batch (the usual ``reduction="mean"``) with the rows
split evenly over n devices, the mean of the n local losses is the loss of the whole batch, and
backward from each local loss divided by n gives every row its whole-batch gradient; the
gradient reductions the plan already makes sum the rest. Whether ``loss_fn`` averages is
checked once, on a row and on the same row twice (equal for a mean, twice for a sum); a loss
that does not (a sum, a loss that is not a scalar) runs on the whole outputs instead, exactly as
before. DTensor's own loss rules are not used: some reduce by the local row count (mse_loss's
backward, torch 2.13), a silent n-fold gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_map

from autopar.plan_types import LOSS_SPLIT_DIMS


def batch_split(outputs, target) -> tuple[DTensor, list[int]] | None:
    """An output that sets the split, and the mesh dims it is split over (on its dim 0 or 1);
    None when the outputs are whole or ``target`` is not split alike (the same size on every
    split dim)."""
    split = [o for o in tree_flatten(outputs)[0] if isinstance(o, DTensor)]
    if not split or not isinstance(target, torch.Tensor) or isinstance(target, DTensor):
        return None
    like = split[0]
    dims = [d for d, p in enumerate(like.placements) if isinstance(p, Shard) and p.dim in LOSS_SPLIT_DIMS]
    if not dims or any(target.dim() <= p.dim or target.shape[p.dim] != like.shape[p.dim]
                       for p in (like.placements[d] for d in dims)):
        return None
    return like, dims


def split_tensor_dims(like: DTensor, dims: list[int]) -> list[int]:
    """The tensor dims ``like`` is split on over the mesh ``dims``."""
    return sorted({like.placements[d].dim for d in dims})


def local_outputs(outputs):
    """Each output's piece on this device (gradients flow back into the split outputs)."""
    return tree_map(lambda o: o.to_local() if isinstance(o, DTensor) else o, outputs)


def local_rows(target: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This device's rows of a whole ``target`` (each rank slices its own copy: no collective)."""
    return distribute_tensor(target.to(like.to_local().device), like.device_mesh, like.placements,
                             src_data_rank=None).to_local()


def averages_over_rows(loss_fn: Callable, outputs, target, dim: int = 0) -> bool:
    """Whether ``loss_fn`` is a mean over ``dim``: the loss of one slice along it equals the
    loss of that slice twice (a sum doubles). Run without gradients on the first slice only."""
    def one(t):
        return t.narrow(dim, 0, 1) if isinstance(t, torch.Tensor) and t.dim() > dim else t

    def twice(t):
        return torch.cat([one(t), one(t)], dim=dim) if isinstance(t, torch.Tensor) and t.dim() > dim else t
    with torch.no_grad():
        try:
            single = loss_fn(tree_map(one, outputs), one(target))
            double = loss_fn(tree_map(twice, outputs), twice(target))
        except (RuntimeError, ValueError, IndexError, TypeError):
            return False
    if not (isinstance(single, torch.Tensor) and single.numel() == 1 and isinstance(double, torch.Tensor)):
        return False
    return bool(torch.allclose(single.float(), double.float(), rtol=1e-3, atol=1e-6))


def local_loss(loss_fn: Callable, outputs, target, like: DTensor, dims: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(what to run backward from, the whole batch's loss to report): the loss of this device's
    rows divided by the devices the rows are split over, and the mean of every device's loss."""
    loss = loss_fn(local_outputs(outputs), local_rows(target, like))
    devices = math.prod(like.device_mesh.size(d) for d in dims)
    reported = loss.detach().clone()
    for d in dims:
        dist.all_reduce(reported, group=like.device_mesh.get_group(d))
    return loss / devices, reported / devices
