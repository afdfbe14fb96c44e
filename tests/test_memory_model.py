"""Activation memory counts what autograd keeps for backward (hand-computed footprints)."""

from __future__ import annotations

import torch

import autopar
from autopar.passes.capture import capture
from autopar.passes.cost import COST_KEY, annotate_costs
from autopar.passes.memory import SAVED_KEY, annotate_saved
from models import MLP, Block, ExplicitAttentionBlock


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
    the loss keeps the model output and a copy of it (cross-entropy's log-softmax), backward
    starts from its gradient; the first addmm's output is not kept twice."""
    b = 8
    plan = autopar.plan(MLP(16, 32, 8, layers=1), (torch.randn(b, 16),), cluster="1xH100")
    # input x, addmm out, gelu out, model output, the loss's copy of it, its gradient (fp32)
    expected = 4 * b * (16 + 32 + 32 + 8 + 8 + 8)
    assert plan.memory.activations_bytes == expected


def test_fused_attention_keeps_no_score_matrix():
    """F.scaled_dot_product_attention stays one op: it keeps q, k, v (views of the qkv
    projection, which is kept) and its output — never a (B, H, T, T) tensor."""
    b, t, d, h = 2, 16, 32, 4
    kept = _kept(Block(d, h), (torch.randn(b, t, d),))
    assert not [k for k in kept if len(k[1]) == 4 and k[1][-2:] == (t, t)], kept
    by_op = {}
    for op, shape, _dtype in kept:
        by_op.setdefault(op, []).append(shape)
    assert by_op["scaled_dot_product_attention.default"] == [(b, h, t, d // h)]
    assert by_op["addmm.default"] == [(b * t, 3 * d), (b * t, 4 * d)]  # qkv (base of q, k, v) and fc
    fused = autopar.plan(Block(d, h), (torch.randn(b, t, d),), cluster="1xH100")
    explicit = autopar.plan(ExplicitAttentionBlock(d, h), (torch.randn(b, t, d),), cluster="1xH100")
    scores = 4 * b * h * t * t  # the softmax result alone, fp32
    assert explicit.memory.activations_bytes - fused.memory.activations_bytes >= scores


def test_transformer_block_keeps_what_backward_needs():
    b, t, d, h = 2, 16, 32, 4  # head dim 8 ≠ t, so (B, H, T, T) tensors are unambiguous
    kept = _kept(ExplicitAttentionBlock(d, h), (torch.randn(b, t, d),))
    scores = [k for k in kept if k[1] == (b, h, t, t) and k[2] == torch.float32]
    # the softmax result (for softmax's backward, and the product with v saves it too); not the
    # raw scores, the scaled ones, the masked ones, nor the comparisons on them
    assert [k[0] for k in scores] == ["_softmax.default"]
    assert [k for k in kept if k[2] == torch.bool] == [("bitwise_not.default", (t, t), torch.bool)]  # where's condition
    by_op = {}
    for op, shape, _dtype in kept:
        by_op.setdefault(op, []).append(shape)
    assert by_op["native_layer_norm.default"] == [(b, t, d), (b, t, 1), (b, t, 1)] * 2  # out, mean, rstd ×2
    # fc (gelu's input); q, k and v reach the matmuls as contiguous copies, kept instead of qkv's output
    assert by_op["addmm.default"] == [(b * t, 4 * d)]
    assert sorted(by_op["clone.default"])[:3] == [(b, h, d // h, t), (b, h, t, d // h), (b, h, t, d // h)]
    assert by_op["gelu.default"] == [(b, t, 4 * d)]  # the out projection's input
    assert (b, t, d) in by_op["add.Tensor"]  # the block's output, kept for the loss
