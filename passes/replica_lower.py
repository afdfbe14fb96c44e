"""Lowering a heterogeneous data-parallel plan: every group runs the whole model, lowered on
its own mesh, on its rows of the global batch.

Group ``g`` takes rows ``[offset_g, offset_g + b_g)`` of every input (and target), weights its
loss by ``b_g / B``, and after backward each lane (the k-th device of every group) sums its
gradient shards over the groups, so the gradients equal one device's on the whole batch —
in one flat all-reduce, except sparse tables the plan sends as their touched rows.
Evaluation gathers every group's outputs in batch order.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.passes.capture import capture, compute_dtype_of
from autopar.passes.grad_sync import all_reduce_flat
from autopar.passes.lower import lower_module
from autopar.passes.place_state import group_meshes, owner_submeshes
from autopar.passes.recompute import checkpoint_layers
from autopar.passes.runtime import sum_touched_rows
from autopar.passes.sparse import SPARSE_ALLGATHER


class ReplicaRuntime:
    """This rank's group: which rows it takes, and the lane it sums gradients over."""

    def __init__(self, module: torch.fx.GraphModule, plan: Plan, index: int, lane: dist.ProcessGroup,
                 loss_fn: Callable | None) -> None:
        self.module, self.lane, self.loss_fn = module, lane, loss_fn
        rows = [r.batch for r in plan.replicas]
        self.start, self.rows, self.total = sum(rows[:index]), rows[index], sum(rows)
        # sparse tables whose touched rows cross between groups instead of the dense all-reduce
        self.sparse = {fqn for fqn, table in plan.sparse.items() if table.get("between_groups") == SPARSE_ALLGATHER}
        # the next step times its gradients' all-reduce between the groups (armed by the link
        # watcher, planning.watch): (bytes each rank all-reduced, seconds), then disarmed
        self.time_sync = False
        self.timed_sync: tuple[int, float] | None = None

    def _mine(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.start:self.start + self.rows]

    def train_step(self, inputs: tuple, target) -> torch.Tensor:
        loss = self.loss_fn(self.module(*(self._mine(x) for x in inputs)), self._mine(target)) * (self.rows / self.total)
        loss.backward()
        with torch.no_grad():  # sum over groups: one flat all-reduce per dtype, sparse tables by their rows
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for name, param in self.module.named_parameters():
                if param.grad is None:  # unused, or an expert weight held by another rank of the group
                    continue  # (the k-th ranks of every group hold the same experts: one plan, one mesh shape)
                if name in self.sparse:
                    param.grad = _like(param.grad, sum_touched_rows(_local(param.grad), self.lane))
                else:
                    by_dtype.setdefault(param.grad.dtype, []).append(param)
            timing, nbytes = self.time_sync, 0
            if timing:  # every rank starts together: a group still in backward is not a slow link
                dist.barrier(group=self.lane)
                start = time.perf_counter()
            for members in by_dtype.values():
                grads = [p.grad for p in members]
                summed = all_reduce_flat([_local(g) for g in grads], [self.lane])
                nbytes += sum(part.numel() * part.element_size() for part in summed)
                for param, grad, part in zip(members, grads, summed):
                    param.grad = _like(grad, part)
            if timing:
                if loss.device.type == "cuda":  # NCCL's calls return once queued: wait for the data
                    torch.cuda.synchronize(loss.device)
                self.timed_sync, self.time_sync = (nbytes, time.perf_counter() - start), False
            total = loss.detach().clone()
            dist.all_reduce(total, group=self.lane)
        return total

    def evaluate(self, inputs: tuple):
        out = self.module(*(self._mine(x) for x in inputs))
        parts = [None] * dist.get_world_size(self.lane)
        dist.all_gather_object(parts, out.detach(), group=self.lane)
        return torch.cat(parts, dim=0)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``t``'s place: the same DTensor layout, or the plain tensor."""
    if not isinstance(t, DTensor):
        return local
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def lower_replicas(model: nn.Module, plan: Plan, loss_fn: Callable | None, device_type: str
                   ) -> tuple[torch.fx.GraphModule, ReplicaRuntime]:
    meshes, lanes, g, lane = group_meshes(plan.replicas, device_type)
    replica = plan.replicas[g]
    # the graph is captured on inputs where the weights are: a model built on meta (autopar.reshard's
    # stand-in, a model too large to build) is captured on meta inputs
    devices = [p.device for p in model.parameters()]
    device = next((d for d in devices if d.type != "meta"), devices[0] if devices else torch.device("cpu"))
    inputs = tuple(torch.zeros((replica.batch, *spec.shape[1:]), dtype=getattr(torch, spec.dtype), device=device)
                   for spec in plan.inputs)
    captured = capture(model, inputs, compute_dtype_of(plan))
    if captured.fingerprint != replica.fingerprint:
        raise AutoparError(ErrorKind.BAD_PLAN,
                           f"plan was made for a different graph (replica {replica.group}: fingerprint "
                           f"{replica.fingerprint}, this model captures as {captured.fingerprint}); re-plan this model")
    module = captured.program.module()
    owner_meshes = owner_submeshes(plan, meshes)  # every rank, every group's, in order
    lower_module(module, [spec.name for spec in plan.inputs], plan, meshes[g], model, captured,
                 owner_meshes=owner_meshes[g])
    if plan.recompute:  # torch.utils.checkpoint around each layer (passes.recompute)
        checkpoint_layers(module, plan.recompute)
    return module, ReplicaRuntime(module, plan, g, lanes[lane], loss_fn)
