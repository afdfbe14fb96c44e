"""Functions the lowered graph calls. Thin wrappers over DTensor's public API.

They are plain module-level functions so ``print(pmodel.code)`` shows each collective
by name, e.g. ``redistribute(addmm, self._autopar_mesh, 'R,S(1)')``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._redistribute import Redistribute
from torch.utils._pytree import tree_map

from autopar.passes.strategies import parse_placement


def placements(spec: str) -> tuple:
    return tuple(parse_placement(p) for p in spec.split(","))


def distribute_input(x: torch.Tensor, mesh, spec: str) -> DTensor:
    """A full input that every rank holds -> DTensor; each rank slices its shard, no communication."""
    return distribute_tensor(x, mesh, placements(spec), src_data_rank=None)


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
