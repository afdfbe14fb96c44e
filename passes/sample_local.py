"""Ops that compute each sample (dim 0) on its own but have no DTensor sharding rule — group
norm, average pooling, adaptive max pooling: the norms and pools of convolutional and diffusion
models. Without a rule they ran replicated (their inputs gathered whole on every device), so a
data-parallel plan of a UNet gathered the activations at every group norm. Their rule here:
everything replicated, or the samples split (dim 0 of the input and of every output) with the
other inputs (weight, bias) replicated. Lowering runs a split one on each device's samples as a
plain op (runtime.sample_local_call): the replicated inputs' gradients are then partial sums
over the devices, reduced with the other gradients."""

from __future__ import annotations

import torch

from autopar import placements as pl
from autopar.passes.strategy_types import output_vals, tensor_args

aten = torch.ops.aten

# op -> the position of its batch-size argument (an int that must be each device's own), or None
SAMPLE_LOCAL: dict = {
    aten.native_group_norm.default: 3,  # (input, weight, bias, N, C, HxW, group, eps)
    aten.avg_pool2d.default: None,
    aten.avg_pool3d.default: None,
    aten.adaptive_max_pool2d.default: None,
    aten.adaptive_max_pool3d.default: None,
}


def sample_local_rules(node: torch.fx.Node) -> list[tuple[tuple, tuple]] | None:
    """(outputs, inputs) placements on one mesh dim: all replicated, and — where every tensor
    output has the input's samples in dim 0 — the samples split; None for other ops."""
    if node.target not in SAMPLE_LOCAL:
        return None
    ins, outs = tensor_args(node), output_vals(node)
    tensors = [v for v in outs if isinstance(v, torch.Tensor)]
    replicated = (tuple(pl.R if isinstance(v, torch.Tensor) else None for v in outs), (pl.R,) * len(ins))
    samples = ins[0].meta["val"].shape[0] if ins and ins[0].meta["val"].dim() else 0
    if samples < 2 or not tensors or any(v.dim() == 0 or v.shape[0] != samples for v in tensors):
        return [replicated]
    split = (tuple(pl.Shard(0) if isinstance(v, torch.Tensor) else None for v in outs),
             (pl.Shard(0), *(pl.R,) * (len(ins) - 1)))
    return [replicated, split]
