"""Activation checkpointing of whole layers in the lowered program (``torch.utils.checkpoint``).

A plan that recomputes (``plan.recompute``: layer -> "full") keeps, of each such layer, only
what leaves it (the next layer's input) and runs the layer's forward again in backward — the
memory model of passes.build_problem; "selective" keeps the outputs of matmuls and attention
as well and recomputes only the cheap ops between them (torchtitan's op-level selective
checkpointing, through ``create_selective_checkpoint_contexts``). Here the lowered graph gets it: each layer's span of
nodes (its ops and the collectives lowering inserted among them) becomes a small GraphModule,
called through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Parameters
stay attributes of the lowered module (they enter the span as arguments), so their names and
the optimizer's view of them do not change.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.passes.stages import node_layer

SPAN_PREFIX = "_autopar_recompute_"
aten = torch.ops.aten
# what selective recomputation keeps: the ops of passes.build_problem.SAVED_CLASSES as they
# reach the dispatcher (the fused attention kernels of every device)
KEPT_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_attention_math.default}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(mode: str, layer: torch.nn.Module, *args):
    """``layer(*args)`` whose activations are recomputed in backward instead of kept: all of
    them (``mode`` "full") or all but matmul and attention outputs ("selective")."""
    if mode == "selective":
        return checkpoint(layer, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_matmuls))
    return checkpoint(layer, *args, use_reentrant=False)


def checkpoint_layers(gm: torch.fx.GraphModule, layers: dict[str, str]) -> None:
    """Wrap the span of every layer in ``layers`` (layer -> "full" | "selective"), in place."""
    graph = gm.graph
    order = list(graph.nodes)
    spans: dict[str, list[int]] = {}
    for k, node in enumerate(order):
        layer = node_layer(node) if node.op == "call_function" else None
        if layer in layers:
            spans.setdefault(layer, [k, k])[1] = k
    for count, (layer, (first, last)) in enumerate(spans.items()):
        region = [n for n in order[first:last + 1] if n.op in ("call_function", "call_method")]
        _wrap(gm, region, f"{SPAN_PREFIX}{count}", layers[layer])
    graph.lint()
    gm.recompile()


def _wrap(gm: torch.fx.GraphModule, region: list[torch.fx.Node], name: str, mode: str) -> None:
    members = set(region)
    inputs: list[torch.fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in region if any(user not in members for user in n.users)]
    sub = torch.fx.Graph()
    env = {arg: sub.placeholder(f"in_{k}") for k, arg in enumerate(inputs)}
    for node in region:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, torch.fx.GraphModule(torch.nn.Module(), sub))
    graph = gm.graph
    with graph.inserting_after(region[-1]):
        span = graph.get_attr(name)
    with graph.inserting_after(span):
        call = graph.call_function(checkpointed, (mode, span, *inputs))
    anchor = call
    for k, node in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, k))
        anchor.meta.update(node.meta)
        node.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in members)
    for node in reversed(region):
        graph.erase_node(node)
