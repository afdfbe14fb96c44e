"""How much of a stage's training compute is weight gradients — what a zero-bubble pipeline
schedule (torch's ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``) splits off
each backward and runs later, in the bubbles.

An op that reads a weight (a matmul's ``W``, through views and dtype casts) costs its forward
FLOPs again for the weight's gradient; every op on the gradient path costs twice its forward
FLOPs in backward in all (``autopar.planning.throughput``'s 3× accounting). So the weight
gradients' share of a layer's compute is ``Σ F(ops reading a weight) / (3 · Σ F(ops on the
path))``: a third in a stack of matmuls, less where FLOPs go to ops without weights —
attention's own ``QKᵀ`` and ``PV`` grow with the sequence and have no weight gradient.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from autopar.passes.build_problem import gradient_path
from autopar.passes.capture import Captured
from autopar.passes.cost import COST_KEY
from autopar.passes.stages import node_layer, outside_layers

aten = torch.ops.aten
_CASTS = {aten._to_copy.default}  # mixed precision's compute copy of a weight is still the weight



def weight_gradient_flops(captured: Captured) -> dict[str, tuple[float, float]]:
    """Per layer (``blocks.3``; the ops before the first layer under passes.stages' ``FRONT``,
    the rest outside every layer under its ``BACK``): (the weight gradients' FLOPs, the training
    FLOPs of its ops on the gradient path)."""
    graph = captured.graph
    on_path = gradient_path(graph, captured)
    weights = set(captured.parameter_of) - captured.frozen  # a frozen weight gets no gradient
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    seen_layer = False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        cost = node.meta[COST_KEY]
        reads_weight = any(a.name in weights for a in node.all_input_nodes)
        if reads_weight and (cost.is_view or node.target in _CASTS):
            weights.add(node.name)
            continue
        layer = node_layer(node)
        seen_layer = seen_layer or layer is not None
        if node.name not in on_path:
            continue
        entry = sums[layer or outside_layers(seen_layer)]
        entry[0] += cost.flops if reads_weight else 0.0
        entry[1] += 3 * cost.flops
    return {layer: (w, total) for layer, (w, total) in sums.items()}


def weight_gradient_share(flops: dict[str, tuple[float, float]], layers: list[str]) -> float:
    """The weight gradients' share of the training FLOPs of ``layers`` (keys of
    :func:`weight_gradient_flops`); a third when they have none (nothing to weigh)."""
    weight = sum(flops.get(layer, (0.0, 0.0))[0] for layer in layers)
    total = sum(flops.get(layer, (0.0, 0.0))[1] for layer in layers)
    return weight / total if total > 0 else 1 / 3
