"""Which ops compute each row of a tensor on its own: the rules passes.expert_dispatch (the
region an expert's owner runs) and passes.grouped_experts (the region a sort by expert
permutes) share. A row is dim 0; an op is row-wise when dim 0 stays the rows of its output
and nothing it does mixes rows (elementwise ops with broadcast or per-row operands, batched
or row-times-matrix products, reshapes and reductions over other dims)."""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

# ops that compute each row (dim 0) on its own when dim 0 stays the rows (dims checked by row_wise)
_ELEMENTWISE = {aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.neg.default,
                aten.silu.default, aten.sigmoid.default, aten.gelu.default, aten.relu.default, aten.tanh.default,
                aten.exp.default, aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.add.Scalar, aten.clone.default,
                aten._to_copy.default, aten.contiguous.default, aten.alias.default, aten.rsqrt.default,
                aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default}
_BATCHED = {aten.bmm.default, aten.baddbmm.default}
_SHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.split_with_sizes.default, aten.split.Tensor,
          aten.slice.Tensor, aten.transpose.int, aten.permute.default, aten._softmax.default,
          aten.sum.dim_IntList, aten.mean.dim, aten.expand.default, aten.mm.default}


def rows_of(node: torch.fx.Node, rows: int) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return bool(vals) and all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows for v in vals)


def row_wise(node: torch.fx.Node, rows: int) -> bool:
    """Whether ``node`` keeps one row per (token, choice) in dim 0 and computes each on its own."""
    if node.target is operator.getitem:
        return rows_of(node, rows)
    if not rows_of(node, rows):
        return False
    ins = [a.meta["val"] for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if node.target in _ELEMENTWISE:  # other operands broadcast (fewer dims, or dim 0 of 1) or are rows
        out = node.meta["val"].dim()
        return all(v.dim() < out or v.shape[0] in (1, rows) for v in ins)
    if node.target in _BATCHED or node.target is aten.index.Tensor:
        return all(v.shape[0] == rows for v in ins[:2])
    if node.target in _SHAPE:
        source = node.args[0].meta.get("val")
        if not isinstance(source, torch.Tensor) or source.dim() == 0 or source.shape[0] != rows:
            return False
        if node.target is aten.mm.default:  # rows @ a matrix
            return not rows_of(node.args[1], rows)
        if node.target is aten.unsqueeze.default:  # a new dim anywhere but in front of the rows
            return node.args[1] % node.meta["val"].dim() != 0
        dims = _dims_of(node)
        return dims is not None and 0 not in [d % source.dim() for d in dims]
    return False


def _dims_of(node: torch.fx.Node) -> list[int] | None:
    """The dims an op of _SHAPE works on (dim 0 must not be among them); [] for views that keep it."""
    t, args = node.target, node.args
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default):
        return []  # dim 0 kept (checked by the caller): a contiguous row stays one row
    if t in (aten.squeeze.dim, aten._softmax.default, aten.slice.Tensor):
        return [args[1] if len(args) > 1 else 0]
    if t in (aten.squeeze.dims, aten.sum.dim_IntList, aten.mean.dim):
        return list(args[1]) if args[1] else [0]
    if t in (aten.split_with_sizes.default, aten.split.Tensor):
        return [args[2] if len(args) > 2 else 0]
    if t is aten.transpose.int:
        return [args[1], args[2]]
    if t is aten.permute.default:
        return [0] if args[1][0] % len(args[1]) != 0 else []
    return None
