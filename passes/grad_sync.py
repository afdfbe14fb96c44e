"""Gradient synchronisation of a lowered module: each parameter's accumulated gradient is
brought to the parameter's own placement once per backward pass, the pending sums that only
need an all-reduce flattened into buckets per mesh dims and dtype (DistributedDataParallel's)
and all-reduced asynchronously while the backward pass goes on (:class:`GradientSync`), the
rest redistributed one by one."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from autopar.comm import DDP_BUCKET_BYTES



def sync_grad(param: nn.Parameter) -> None:
    """Bring an accumulated gradient (e.g. a partial sum) to the parameter's own placement."""
    settle(param)
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def reducing(param: nn.Parameter) -> bool:
    """Whether the parameter's gradient is a collective still in flight (the async
    reduce-scatter of a gathered weight's backward, passes.reshard)."""
    return isinstance(param.grad, DTensor) and isinstance(param.grad._local_tensor, AsyncCollectiveTensor)


def settle(param: nn.Parameter) -> None:
    """Wait for the parameter's gradient when its collective is still in flight."""
    if reducing(param):
        grad = param.grad
        param.grad = DTensor.from_local(grad._local_tensor.wait(), grad.device_mesh, grad.placements,
                                        run_check=False, shape=grad.shape, stride=grad.stride())


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
        settle(param)
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
    return unflatten(flat, tensors)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``like``, in order (the inverse of a flat concat)."""
    parts, offset = [], 0
    for t in like:
        parts.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return parts


class GradientSync:
    """Synchronises gradients during the backward pass, as DistributedDataParallel and FSDP2
    do: each parameter reports when its gradient is accumulated. A gradient that only needs
    an all-reduce joins the bucket of its (mesh dims, dtype), and a bucket holding
    ``bucket_bytes`` is all-reduced at once, asynchronously (``async_op=True``: the collective
    runs while autograd computes the earlier layers' gradients). A gathered weight's gradient
    arrives already being reduce-scattered (passes.reshard issues it async); at most
    ``bucket_bytes`` of those stay in flight — the oldest is waited for beyond that, as FSDP2
    bounds its reduce-scatters — so the full-size gradients they read are freed as backward
    goes. The first report queues :meth:`flush` for when autograd's engine finishes the pass:
    it launches the partly filled buckets, waits for every collective (``Work.wait``), writes
    the sums back as the gradients, and redistributes the rest (experts on their owners'
    sub-meshes) one by one. ``mesh``: the module's mesh — only its parameters' buckets go
    early (every rank reports them in the same order, so the collectives match).
    ``overlap`` off (a plan made with ``overlap=False``): every bucket waits for the end of
    backward, as the cost model then assumes."""

    def __init__(self, mesh=None, bucket_bytes: int = DDP_BUCKET_BYTES, overlap: bool = True) -> None:
        self.mesh = mesh
        self.bucket_bytes = bucket_bytes
        self.overlap = overlap
        self.pending: list[nn.Parameter] = []  # synchronised at the end of the pass
        # (mesh dims, dtype) -> bucket being filled, its bytes so far
        self.filling: dict[tuple, tuple[list[nn.Parameter], int]] = {}
        self.in_flight: list[_Bucket] = []
        self.scattering: list[tuple[nn.Parameter, int]] = []  # gradients being reduce-scattered, their bytes
        self.scattering_bytes = 0
        self.started = False

    def __call__(self, param: nn.Parameter) -> None:
        if not self.started:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
            self.started = True
        if reducing(param):
            self._bound(param)
        dims = _bucket_dims(param) if self.mesh is not None and param.device_mesh is self.mesh else None
        if not dims:
            self.pending.append(param)
            return
        key = (dims, param.grad.dtype)
        members, nbytes = self.filling.get(key, ([], 0))
        members.append(param)
        self.filling[key] = (members, nbytes + param.grad.to_local().nbytes)
        if self.overlap and self.filling[key][1] >= self.bucket_bytes:
            self._launch(key)

    def _bound(self, param: nn.Parameter) -> None:
        """Track an in-flight reduce-scatter; wait for the oldest while more than a bucket's
        worth of (full-size) gradients is being reduced."""
        nbytes = param.numel() * param.grad.element_size()
        self.scattering.append((param, nbytes))
        self.scattering_bytes += nbytes
        while len(self.scattering) > 1 and self.scattering_bytes > self.bucket_bytes:
            oldest, nbytes = self.scattering.pop(0)
            self.scattering_bytes -= nbytes
            settle(oldest)

    def _launch(self, key: tuple) -> None:
        members, _ = self.filling.pop(key)
        groups = [self.mesh.get_group(d) for d in key[0]]
        flat = torch.cat([p.grad.to_local().reshape(-1) for p in members])
        work = dist.all_reduce(flat, group=groups[0], async_op=True)
        self.in_flight.append(_Bucket(members, flat, work, groups[1:]))

    def flush(self) -> None:
        for key in list(self.filling):
            self._launch(key)
        in_flight, self.in_flight = self.in_flight, []
        pending, self.pending = self.pending, []
        self.scattering.clear()
        self.scattering_bytes = 0
        self.started = False
        for bucket in in_flight:
            bucket.work.wait()
            for group in bucket.later_groups:  # a gradient pending on several mesh dims: one after the other
                dist.all_reduce(bucket.flat, group=group)
            for param, part in zip(bucket.members, unflatten(bucket.flat, [p.grad.to_local() for p in bucket.members])):
                param.grad = DTensor.from_local(part, self.mesh, param.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
        sync_grads(pending)


@dataclass
class _Bucket:
    """One all-reduce in flight: its parameters, their gradients flattened, the collective."""

    members: list[nn.Parameter]
    flat: torch.Tensor
    work: dist.Work
    later_groups: list  # the other mesh dims' groups, reduced once the first is done
