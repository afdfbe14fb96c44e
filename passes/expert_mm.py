"""``autopar::expert_mm``: each row times its own expert's matrix, ``out[r] = x[r] @ w[ids[r]]``.

Grouped-GEMM mixture-of-experts layers (``torch._grouped_mm``, transformers' default
``grouped_mm`` experts) sort the (token, choice) rows by expert, multiply each expert's
contiguous block by its matrix (block bounds: the cumulative counts, ``offs``) and put the
rows back in their order. The sort mixes every row of the batch, so no planner can split the
rows over devices through it: DTensor replicates a sorted dim. Written per row, with the
expert of each row as an argument, the same product computes every row on its own — the rows
can be split by batch, or sent to the owners of their experts (passes.expert_dispatch) —
and sorting becomes an implementation detail of the kernel, done on whatever rows a device
holds. passes.grouped_experts rewrites captured graphs into this form.

The op runs one matrix product per expert on its rows (as transformers' own CPU fallback
does); its backward is ``expert_mm`` against the transposed matrices and
``expert_mm_weight_grad`` (each expert's ``x_rowsᵀ @ grad_rows``). Both carry DTensor sharding
rules (``register_sharding``) and FLOP formulas, so plans and lowered programs treat them as
any matmul: rows split (weights replicated, their gradient partial), the output features
split (weights ``Shard(2)``) or the input features split (weights ``Shard(1)``, output
partial).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding
from torch.utils.flop_counter import register_flop_formula



def _blocks(ids: torch.Tensor, experts: int):
    """The rows' order by expert (stable) and each expert's (start, end) in that order."""
    order = torch.argsort(ids, stable=True)
    ends = torch.cumsum(torch.bincount(ids, minlength=experts), 0).tolist()  # one host sync
    starts = [0, *ends[:-1]]
    return order, zip(starts, ends)


@torch.library.custom_op("autopar::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, in), ``w`` (experts, in, out), ``ids`` (rows,) → (rows, out)."""
    order, blocks = _blocks(ids, w.shape[0])
    sorted_x = x[order]
    out = x.new_empty((x.shape[0], w.shape[2]))
    sorted_out = torch.empty_like(out)
    for e, (start, end) in enumerate(blocks):
        if end > start:
            torch.mm(sorted_x[start:end], w[e], out=sorted_out[start:end])
    out[order] = sorted_out
    return out


@expert_mm.register_fake
def _(x, w, ids):
    torch._check(x.dim() == 2 and w.dim() == 3 and ids.dim() == 1, lambda: "expert_mm: x (rows, in), w (E, in, out), ids (rows,)")
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.custom_op("autopar::expert_mm_weight_grad", mutates_args=())
def expert_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """The gradient of ``expert_mm``'s weights: per expert, its rows' ``xᵀ @ grad``."""
    order, blocks = _blocks(ids, experts)
    sorted_x, sorted_grad = x[order], grad[order]
    out = x.new_zeros((experts, x.shape[1], grad.shape[1]))
    for e, (start, end) in enumerate(blocks):
        if end > start:
            torch.mm(sorted_x[start:end].t(), sorted_grad[start:end], out=out[e])
    return out


@expert_mm_weight_grad.register_fake
def _(x, grad, ids, experts):
    return x.new_empty((experts, x.shape[1], grad.shape[1]))


def _setup_context(ctx, inputs, output):
    x, w, ids = inputs
    ctx.save_for_backward(x, w, ids)


def _backward(ctx, grad):
    x, w, ids = ctx.saved_tensors
    grad_x = torch.ops.autopar.expert_mm(grad, w.transpose(1, 2), ids) if ctx.needs_input_grad[0] else None
    grad_w = torch.ops.autopar.expert_mm_weight_grad(x, grad, ids, w.shape[0]) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


expert_mm.register_autograd(_backward, setup_context=_setup_context)
EXPERT_MM = torch.ops.autopar.expert_mm.default  # the op as graphs hold it


@register_flop_formula(torch.ops.autopar.expert_mm)
def _expert_mm_flops(x_shape, w_shape, ids_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.autopar.expert_mm_weight_grad)
def _weight_grad_flops(x_shape, grad_shape, ids_shape, *args, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * grad_shape[1]


@register_sharding(torch.ops.autopar.expert_mm.default)
def _expert_mm_sharding(x, w, ids):
    """Per mesh dim, (output, (x, w, ids)): replicated; rows split; output features split
    (weights ``Shard(2)``); input features split (weights ``Shard(1)``, output partial)."""
    return [([Replicate()], [Replicate(), Replicate(), Replicate()]),
            ([Shard(0)], [Shard(0), Replicate(), Shard(0)]),
            ([Shard(1)], [Replicate(), Shard(2), Replicate()]),
            ([Partial()], [Shard(1), Shard(1), Replicate()])]


@register_sharding(torch.ops.autopar.expert_mm_weight_grad.default)
def _weight_grad_sharding(x, grad, ids, experts):
    """The matching rules of the weights' gradient (its ``(E, in, out)`` output first)."""
    return [([Replicate()], [Replicate(), Replicate(), Replicate(), None]),
            ([Partial()], [Shard(0), Shard(0), Shard(0), None]),
            ([Shard(2)], [Replicate(), Shard(1), Replicate(), None]),
            ([Shard(1)], [Shard(1), Replicate(), Replicate(), None])]
