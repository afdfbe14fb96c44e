"""FSDP2's forward prefetch for the lowered graph: a sharded weight's gather is moved a layer
(``prefetch_layers``) ahead, so its all-gather runs while the previous layer computes.

Lowering writes each gather (:meth:`passes.reshard.WeightGathers.gather`, issued
asynchronously) right before the op that reads the weight. Here the gathers of layer k move
to just before the first op of layer k − 1 (a weight read after the last layer — an LM head —
to before the last layer; layer 0's to the start of the graph), together with the views of the
parameter they read; the gathered tensor waits where it is first read (its local tensor is an
``AsyncCollectiveTensor``). One layer ahead, as FSDP2's default: the next layer's full weights
are held while the current one runs (the plan's memory counts them: passes.build_problem's
held windows, ``memory.gathered_bytes``). The planner costs the gather as
hidden behind compute (passes.build_problem, the forward phase of a parameter edge).

A gather read inside a layer that is recomputed is left where it is: moved out of the
checkpointed span it would become the span's input, and checkpointing keeps its inputs — the
full weight would live until backward.
"""

from __future__ import annotations

import torch

from autopar.passes.cost import is_view_op
from autopar.passes.stages import node_layer


def prefetch_gathers(graph: torch.fx.Graph, recomputed: set[str] = frozenset(), layers_ahead: int = 1) -> int:
    """Move every movable gather of ``graph`` ``layers_ahead`` layers ahead (in place; FSDP2's
    default is one); returns how many moved."""
    if layers_ahead < 1:
        return 0
    starts, segment_of = _segments(graph)
    layers = [layer for layer, _ in starts]
    order = {n: k for k, n in enumerate(graph.nodes)}  # moving gathers keeps the others' order
    moved = 0
    for node in list(graph.nodes):
        if node.op != "call_method" or node.target != "gather" or not node.users:
            continue
        k = _reader_segment(node, segment_of)
        if k is None or k == 0:
            continue
        ahead = [j for j in range(k - 1, -1, -1) if layers[j] is not None][:layers_ahead]
        target = ahead[-1] if ahead else 0
        inputs = _parameter_views(node)
        if layers[k] in recomputed or layers[target] in recomputed or inputs is None:
            continue
        anchor = starts[target][1]
        later = [n for n in [*inputs, node] if order[n] > order[anchor]]  # what already runs earlier stays
        for i, n in enumerate(later):  # each lands right before the anchor, so their order is kept
            anchor.prepend(n)
            order[n] = order[anchor] - 1 + (i + 1) / (len(later) + 1)
        moved += 1
    graph.lint()
    return moved


def _segments(graph: torch.fx.Graph) -> tuple[list[tuple[str | None, torch.fx.Node]], dict[torch.fx.Node, int]]:
    """The graph's runs of ops by layer (None: outside every layer), in order: each run's
    layer and first node; and the run of every op of the traced model. Views of parameters
    (which may move with a gather) are no op of a run: a run starts where one never moves."""
    starts: list[tuple[str | None, torch.fx.Node]] = []
    segment_of: dict[torch.fx.Node, int] = {}
    parameter_views: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "call_function" and is_view_op(node) and all(
                a.op == "get_attr" or a in parameter_views for a in node.all_input_nodes):
            parameter_views.add(node)
            continue
        if node.op != "call_function" or "nn_module_stack" not in node.meta:
            continue  # inserted by lowering, or no op of the model
        layer = node_layer(node)
        if not starts or starts[-1][0] != layer:
            starts.append((layer, node))
        segment_of[node] = len(starts) - 1
    return starts, segment_of


def _reader_segment(gather: torch.fx.Node, segment_of: dict[torch.fx.Node, int]) -> int | None:
    """The run of the first op of the model that reads the gathered weight (through the views
    and reshard lowering put between them)."""
    found: list[int] = []
    todo, seen = list(gather.users), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in segment_of:
            found.append(segment_of[node])
        else:
            todo.extend(node.users)
    return min(found, default=None)


def _parameter_views(gather: torch.fx.Node) -> list[torch.fx.Node] | None:
    """What the gather reads, in graph order, when that is only module attributes (the
    parameter, the mesh) and views of them (a transpose, a head split): those can run earlier.
    None when it reads anything computed."""
    found: dict[torch.fx.Node, None] = {}

    def visit(node: torch.fx.Node) -> bool:
        if node in found:
            return True
        if node.op != "get_attr" and not (node.op == "call_function" and is_view_op(node)
                                          and all(visit(arg) for arg in node.all_input_nodes)):
            return False
        found[node] = None
        return True

    if not all(visit(arg) for arg in gather.all_input_nodes):
        return None
    order = {n: k for k, n in enumerate(gather.graph.nodes)}
    return sorted(found, key=order.__getitem__)
