"""Functions the lowered graph calls. Thin wrappers over DTensor's public API.

They are plain module-level functions so ``print(pmodel.code)`` shows each collective
by name, e.g. ``redistribute(addmm, self._autopar_mesh, 'R,S(1)')``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._redistribute import Redistribute
from torch.utils._pytree import tree_map

from autopar.passes.strategies import parse_placement


def placements(spec: str) -> tuple:
    return tuple(parse_placement(p) for p in spec.split(","))


def distribute_input(x: torch.Tensor, mesh, spec: str) -> DTensor:
    """A full input that every rank holds -> DTensor; each rank slices its shard, no
    communication. Differentiable: a pipeline stage's input gets its gradient back."""
    replicated = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements(spec))


def redistribute(x: DTensor, mesh, spec: str) -> DTensor:
    """Reshard to the placements the consumer was planned with (a collective, or a local slice)."""
    target = placements(spec)
    if tuple(x.placements) == target:
        return x
    if any(p.is_partial() and p != q for p, q in zip(target, x.placements)):
        # Replicate→Partial (a replicated bias into a row-parallel matmul): public redistribute
        # refuses it ("internal use only"); the autograd function behind it supports it.
        dtype = x.dtype
        options = {"op_dtype": dtype, "out_dtype": dtype}
        return Redistribute.apply(x, mesh, target, False, {**options, "backward_options": dict(options)})
    return x.redistribute(mesh, target)


def replicate_constant(x, mesh):
    """Constants created inside forward (arange, masks) become replicated DTensors."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return x


def to_full(x):
    """Plan outputs are returned as plain full tensors on every rank (differentiable)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def local_call(op, mesh, *args, **kwargs):
    """Run an op DTensor has no rule for on replicated local tensors; outputs are replicated."""
    def unwrap(a):
        return a.to_local() if isinstance(a, DTensor) else a

    out = op(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    return tree_map(lambda t: replicate_constant(t, mesh), out)


def send_slice(x: torch.Tensor, lanes, dim: int) -> torch.Tensor:
    """A stage's full boundary output -> this lane's slice of ``dim`` (sent to the same lane of
    the next stage), so each value crosses the link between groups once. Backward gathers the
    gradient slices of every lane back into the full gradient."""
    whole = DTensor.from_local(x, lanes, [Replicate()], run_check=False)
    return whole.redistribute(lanes, [Shard(dim)]).to_local()


def receive_slice(x: torch.Tensor, lanes, dim: int) -> torch.Tensor:
    """The slice this lane received -> the full boundary input (an all-gather inside the
    receiving group). Backward keeps this lane's slice of the (replicated) gradient."""
    part = DTensor.from_local(x, lanes, [Shard(dim)], run_check=False)
    return part.redistribute(lanes, [Replicate()]).to_local()
