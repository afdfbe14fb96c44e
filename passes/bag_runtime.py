"""Functions the lowered graph calls where a plan splits bags of varying size by bags.

A batch of bags given as 1-D ids with offsets (``nn.EmbeddingBag(ids, offsets)``,
passes.embedding_bag) is split as TorchRec's data-parallel input distribution splits it: each
device takes its own bags (an even share of the bags) and with them their ids, however many
that is. Its ids, their per-sample weights, lookups and bag numbers are then DTensors split on
their first dim *unevenly* — each device's piece is its bags' ids, and the global size is the
batch's id count — and only ops that work id by id touch them: the lookup, the weighting, and
the pooling into the device's own bags, which gives an even split of the pooled bags.
Strategies never reshard such a tensor on that dim (passes.problem_edges), so DTensor's even
chunking is never assumed for it.

Four calls do what DTensor's own rules cannot:
  * :func:`bag_input` gives a device its bags' ids (or weights) from the full input every rank
    holds, cut where the offsets say;
  * :func:`bag_numbers` numbers each of a device's ids by its bag, from the device's own first
    bag (``repeat_interleave`` of its bags' lengths);
  * :func:`pool_bags` pools a device's rows into its own bags;
  * :func:`id_count` reads the batch's id count (the last bag's end) from the ids as they
    come, where the traced graph holds it as a constant: one lowered program then serves
    batches of any id count (passes.relower).
Gradients flow through DTensor's ``to_local`` / ``from_local``, which keep the placements.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.passes.bag_pooling import pool_rows
from autopar.passes.runtime import placements


def own_bags(bags: int, mesh, spec: str) -> tuple[int, int]:
    """(first bag, how many) of this rank's share of ``bags`` under ``spec`` (DTensor's even
    chunking of the bags, as the pooled output is split)."""
    (count,), (first,) = compute_local_shape_and_global_offset((bags,), mesh, placements(spec))
    return first, count


def bag_input(x: torch.Tensor, offsets: torch.Tensor, mesh, spec: str, bags: int,
              dtype: torch.dtype | None = None) -> DTensor:
    """This rank's bags' share of ``x`` (ids, or per-sample weights) as a DTensor split by
    bags: the entries from its first bag's offset to the next rank's first bag's (or the end).
    Every rank holds the full ``x`` and ``offsets``; no communication. ``dtype`` (mixed
    precision): floating weights cast as every input is."""
    if dtype is not None and x.is_floating_point() and x.dtype != dtype:
        x = x.to(dtype)
    first, count = own_bags(bags, mesh, spec)
    offsets = offsets.to_local() if isinstance(offsets, DTensor) else offsets
    start = int(offsets[first]) if count else 0
    end = int(offsets[first + count]) if first + count < offsets.numel() else x.shape[0]
    piece = x[start:end] if count else x[:0]
    return DTensor.from_local(piece, mesh, placements(spec), run_check=False, shape=x.shape, stride=x.stride())


def bag_numbers(lengths: DTensor, mesh, spec: str, ids: torch.Tensor | int) -> DTensor:
    """Each of this rank's ids numbered by its bag (``repeat_interleave`` of its bags'
    lengths), counting from its own first bag. ``ids``: the full input of ids every rank
    holds, or their count where the model computes them (the global size). Replicated
    ``spec``: every id of the batch, numbered from bag 0."""
    local = lengths.to_local() if isinstance(lengths, DTensor) else lengths
    numbers = torch.repeat_interleave(local)
    count = ids.shape[0] if isinstance(ids, torch.Tensor) else ids
    return DTensor.from_local(numbers, mesh, placements(spec), run_check=False, shape=(count,), stride=(1,))


def pool_bags(rows: DTensor, bag_of: DTensor, bags: int, mesh, spec: str) -> DTensor:
    """This rank's rows pooled into its own bags (``autopar::pool_rows``), split by bags as
    ``spec`` says (columns too, where the rows are)."""
    shape = (bags, rows.shape[1])
    (count, _), _ = compute_local_shape_and_global_offset(shape, mesh, placements(spec))
    pooled = pool_rows(rows.to_local(), bag_of.to_local(), count)
    return DTensor.from_local(pooled, mesh, placements(spec), run_check=False, shape=shape,
                              stride=(rows.shape[1], 1))


def id_count(ids: torch.Tensor, mesh, dtype: torch.dtype) -> DTensor:
    """The number of ``ids`` (the full input every rank holds) as a replicated one-element
    tensor: the end of the last bag."""
    count = torch.tensor([ids.shape[0]], dtype=dtype, device=ids.device)
    return DTensor.from_local(count, mesh, [Replicate()] * mesh.ndim, run_check=False)
