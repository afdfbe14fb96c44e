"""``autopar::pool_rows``: rows summed into their bags, ``out[b] = Σ rows[i] for bag_of[i] = b``.

Bags of varying size (``nn.EmbeddingBag(ids, offsets)``, DLRM's and TorchRec's input form)
become every id's lookup followed by this pooling (passes.embedding_bag). Written as
``index_add`` into zeros it has no DTensor rule, so it ran replicated: every device held
every looked-up row. As its own op it carries the rules of a pooling (registered with
``register_sharding``; a custom op, so no rule of an aten op changes for anyone else):

  * the rows split by position (the ids of a batch split evenly over devices, whatever bags
    they fall in): each device pools its rows into every bag — a partial sum, reduced (or
    reduce-scattered by bags) afterwards, as TorchRec's row-wise sharding reduce-scatters its
    pooled embeddings. The planner reads this rule as a split by bags instead (each device's
    rows are its own bags': its pooled bags are its share of the output,
    passes.strategies.pooled_by_bags, lowered by passes.bag_runtime.pool_bags), since a batch's
    id count changes from batch to batch (passes.embedding_bag.id_indexed);
  * the columns split (a column-wise sharded table): each device pools its columns;
  * replicated.

Backward hands each row its bag's gradient (``pool_rows_backward``, rules to match). FLOPs:
one add per pooled element.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("autopar::pool_rows", mutates_args=())
def pool_rows(rows: torch.Tensor, bag_of: torch.Tensor, bags: int) -> torch.Tensor:
    """``rows`` (N, dim), ``bag_of`` (N,) each row's bag → (bags, dim); an empty bag is zeros."""
    return rows.new_zeros((bags, rows.shape[1])).index_add_(0, bag_of, rows)


@pool_rows.register_fake
def _(rows, bag_of, bags):
    return rows.new_empty((bags, rows.shape[1]))


@torch.library.custom_op("autopar::pool_rows_backward", mutates_args=())
def pool_rows_backward(grad: torch.Tensor, bag_of: torch.Tensor) -> torch.Tensor:
    """Each row's gradient: its bag's."""
    return grad.index_select(0, bag_of)


@pool_rows_backward.register_fake
def _(grad, bag_of):
    return grad.new_empty((bag_of.shape[0], grad.shape[1]))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad):
    (bag_of,) = ctx.saved_tensors
    return torch.ops.autopar.pool_rows_backward(grad, bag_of), None, None


pool_rows.register_autograd(_backward, setup_context=_setup_context)
POOL_ROWS = torch.ops.autopar.pool_rows.default  # the op as graphs hold it


@register_flop_formula(torch.ops.autopar.pool_rows)
def _pool_flops(rows_shape, *args, **kwargs) -> int:
    return rows_shape[0] * rows_shape[1]


@register_sharding(POOL_ROWS)
def _pool_sharding(rows, bag_of, bags):
    """Per mesh dim, (output, (rows, bag_of, bags)): replicated; rows split (partial bags);
    columns split."""
    return [([Replicate()], [Replicate(), Replicate(), None]),
            ([Partial()], [Shard(0), Shard(0), None]),
            ([Shard(1)], [Shard(1), Replicate(), None])]


@register_sharding(torch.ops.autopar.pool_rows_backward.default)
def _pool_backward_sharding(grad, bag_of):
    """(rows' gradient, (bags' gradient, bag_of)): replicated; rows split; columns split."""
    return [([Replicate()], [Replicate(), Replicate()]),
            ([Shard(0)], [Replicate(), Shard(0)]),
            ([Shard(1)], [Shard(1), Replicate()])]
