"""Which forward outputs autograd keeps for backward (the activation part of the memory model).

Writes ``node.meta["autopar.saved"] = (bool, ...)``, one flag per output of every
call_function node. An output is kept when a consumer's backward needs it; otherwise it is
freed once its consumers have run (a transient, not part of the steady footprint):

  * ops whose gradient needs no tensor values (add, sub, neg, cat, sum, mean, copies, views,
    embedding's weight side, padding) keep none of their inputs;
  * ops whose gradient is written in terms of their result (softmax, log-softmax, exp, tanh,
    sigmoid, sqrt, rsqrt) keep their output instead of their input;
  * ``where`` keeps its condition only, pooling rows into bags (``autopar::pool_rows``) each
    row's bag number; ops without a floating-point output (comparisons,
    masks, index arithmetic) have no gradient and keep nothing;
  * every other op keeps all its tensor inputs (conservative: mm, bmm, mul, div, gelu, norms…);
  * extra outputs of multi-output ops (a norm's mean and rstd, pooling indices) are saved
    by the op itself; the model's outputs are kept (the loss needs them).

A view keeps its base alive, so a kept view marks its producer kept. This is what lets the
decomposed attention count two (B, H, T, T) tensors per layer (the softmax result for its
own backward, the masked probabilities the second bmm saves) instead of every one of them. Fused attention keeps its
inputs and output, no (T, T) tensor. Not modelled yet: the peak of transients, recomputation
(activation checkpointing).
"""

from __future__ import annotations

import operator

import torch

from autopar.passes.cost import is_view_op
from autopar.passes.strategies import output_vals, tensor_args

SAVED_KEY = "autopar.saved"

_KEEPS_NOTHING = {
    "add", "sub", "rsub", "neg", "cat", "sum", "mean", "clone", "_to_copy", "copy", "expand", "slice",
    "select", "permute", "t", "transpose", "unsqueeze", "squeeze", "split", "split_with_sizes", "view",
    "reshape", "_unsafe_view", "alias", "full_like", "zeros_like", "ones_like", "constant_pad_nd",
    "embedding", "repeat", "flip", "roll", "lift_fresh_copy", "detach",
}
_KEEPS_OUTPUT = {"_softmax", "_log_softmax", "exp", "tanh", "sigmoid", "sqrt", "rsqrt"}
_KEEPS_ONE = {"where": 0, "pool_rows": 1}  # the condition; the rows' bag numbers (not the rows)
# fused attention saves its inputs, its output and the (B, H, L) log-sum-exp of the scores
# (not counted: 1/E of the output's elements); never the (L, S) scores themselves
_KEEPS_INPUTS_AND_OUTPUT = {"scaled_dot_product_attention"}


def _name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))


def annotate_saved(graph: torch.fx.Graph) -> None:
    kept: set[tuple[str, int]] = set()  # (node name, output index)

    def keep(arg: torch.fx.Node) -> None:
        if arg.op == "call_function" and arg.target is operator.getitem:
            kept.add((arg.args[0].name, arg.args[1]))
        kept.add((arg.name, 0))

    for node in graph.nodes:
        if node.op == "output":
            for arg in torch.utils._pytree.tree_flatten(node.args)[0]:
                if isinstance(arg, torch.fx.Node):
                    keep(arg)
            continue
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        name = _name(node)
        outputs = output_vals(node)
        for k in range(1, len(outputs)):
            kept.add((node.name, k))
        if not any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in outputs):
            continue  # comparisons, masks, index math: no gradient flows, nothing is saved
        if name in _KEEPS_OUTPUT:
            kept.add((node.name, 0))
        elif name in _KEEPS_INPUTS_AND_OUTPUT:
            kept.add((node.name, 0))
            for arg in tensor_args(node):
                keep(arg)
        elif name in _KEEPS_ONE:
            keep(tensor_args(node)[_KEEPS_ONE[name]])
        elif name not in _KEEPS_NOTHING and not is_view_op(node):
            for arg in tensor_args(node):
                keep(arg)
    for node in reversed(graph.nodes):  # a kept view keeps its base
        if (node.op == "call_function" and node.target is not operator.getitem and (node.name, 0) in kept
                and is_view_op(node)):
            for arg in tensor_args(node)[:1]:
                keep(arg)
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta[SAVED_KEY] = tuple((node.name, k) in kept for k in range(len(output_vals(node))))
