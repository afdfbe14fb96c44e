"""Activation memory counts what autograd keeps for backward (hand-computed footprints)."""

from __future__ import annotations

import torch

import autopar
from autopar.passes.capture import capture
from autopar.passes.cost import COST_KEY, annotate_costs
from autopar.passes.memory import SAVED_KEY, annotate_saved
from models import MLP, Block


def _kept(model, inputs) -> list[tuple[str, tuple, torch.dtype]]:
    captured = capture(model, inputs)
    annotate_costs(captured.graph)
    annotate_saved(captured.graph)
    kept = []
    for node in captured.graph.nodes:
        if node.op == "call_function" and not node.meta[COST_KEY].is_view:
            vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
            kept += [(str(node.target).removeprefix("aten."), tuple(v.shape), v.dtype)
                     for v, keep in zip(vals, node.meta[SAVED_KEY]) if keep]
    return kept


def test_mlp_footprint_by_hand():
    """x → addmm → gelu → addmm: gelu keeps its input, the second addmm keeps gelu's output,
    the loss keeps the model output; the first addmm's output is not kept twice."""
    b = 8
    plan = autopar.plan(MLP(16, 32, 8, layers=1), (torch.randn(b, 16),), cluster="1xH100")
    expected = 4 * b * (16 + 32 + 32 + 8)  # input x, addmm out, gelu out, model output (fp32)
    assert plan.memory.activations_bytes == expected


def test_transformer_block_keeps_what_backward_needs():
    b, t, d, h = 2, 16, 32, 4  # head dim 8 ≠ t, so (B, H, T, T) tensors are unambiguous
    kept = _kept(Block(d, h), (torch.randn(b, t, d),))
    scores = [k for k in kept if k[1] == (b, h, t, t) and k[2] == torch.float32]
    # the softmax result (for softmax's backward) and the masked probabilities bmm saves;
    # not the raw scores, the mask-added scores, nor the comparisons on them
    assert [k[0] for k in scores] == ["_softmax.default", "where.self"]
    assert not any(k[2] == torch.bool and len(k[1]) == 4 and k[1][-1] == t for k in kept if k[0] != "where.self")
    by_op = {}
    for op, shape, _dtype in kept:
        by_op.setdefault(op, []).append(shape)
    assert by_op["native_layer_norm.default"] == [(b, t, d), (b, t, 1), (b, t, 1)] * 2  # out, mean, rstd ×2
    assert by_op["addmm.default"] == [(b * t, 3 * d), (b * t, 4 * d)]  # qkv (base of q, k, v) and fc (gelu's input)
    assert by_op["gelu.default"] == [(b, t, 4 * d)]  # the out projection's input
    assert (b, t, d) in by_op["add.Tensor"]  # the block's output, kept for the loss
