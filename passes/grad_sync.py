"""Gradient synchronisation of a lowered module: each parameter's accumulated gradient is
brought to the parameter's own placement once per backward pass, the pending sums that only
need an all-reduce flattened into one buffer per mesh dims and dtype (DistributedDataParallel's
buckets), the rest redistributed one by one."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def sync_grad(param: nn.Parameter) -> None:
    """Bring an accumulated gradient (e.g. a partial sum) to the parameter's own placement."""
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _bucket_dims(param: nn.Parameter) -> tuple[int, ...] | None:
    """Mesh dims on which the gradient is a pending sum the parameter wants replicated, when
    that is all that differs (an all-reduce of the local tensor finishes it); else None."""
    grad = param.grad
    if not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return None
    dims = []
    for d, (have, want) in enumerate(zip(grad.placements, param.placements)):
        if have == want:
            continue
        if not (have.is_partial() and getattr(have, "reduce_op", None) == "sum" and want.is_replicate()):
            return None
        dims.append(d)
    return tuple(dims)


def sync_grads(params: list[nn.Parameter]) -> None:
    """:func:`sync_grad` for many parameters, with the pending sums that only need an
    all-reduce flattened into one buffer per (mesh, mesh dims, dtype) — DDP's buckets, so a
    step pays one collective latency instead of one per parameter. The rest (reduce-scatters
    into a sharded parameter) are redistributed one by one."""
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        dims = _bucket_dims(param)
        if dims is None:
            sync_grad(param)
        elif dims:
            buckets.setdefault((id(param.device_mesh), dims, param.grad.dtype), []).append(param)
    for (_, dims, _), members in buckets.items():
        mesh = members[0].device_mesh
        summed = all_reduce_flat([p.grad.to_local() for p in members], [mesh.get_group(d) for d in dims])
        for param, part in zip(members, summed):
            param.grad = DTensor.from_local(part, mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())


def all_reduce_flat(tensors: list[torch.Tensor], groups: list) -> list[torch.Tensor]:
    """Sum same-dtype ``tensors`` over each process group in turn with one all-reduce per
    group on a flat copy; returns views of the result shaped like the inputs."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    for group in groups:
        dist.all_reduce(flat, group=group)
    parts, offset = [], 0
    for t in tensors:
        parts.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return parts


class GradientSync:
    """Synchronises gradients once per backward pass: each parameter reports when its gradient
    is accumulated, and the first report queues :func:`sync_grads` to run when autograd's
    engine finishes the pass (the callback DistributedDataParallel uses for its buckets)."""

    def __init__(self) -> None:
        self.pending: list[nn.Parameter] = []

    def __call__(self, param: nn.Parameter) -> None:
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self.pending.append(param)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        sync_grads(pending)
