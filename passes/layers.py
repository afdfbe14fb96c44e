"""Repeated-layer detection: identical layers share the solver's decision variables.

A layer is a module reached through a ModuleList/Sequential index (``blocks.3``). Two layers
of one list are identical when their nodes have the same ops, shapes, constant arguments,
parameter names and internal wiring, and what they read from outside has the same shapes;
the later layer's nodes are then mapped onto the first one's. The problem keeps one node per
representative weighted by its number of copies, so all copies take the same placements and
the cost of each copy is still counted (PyTorch autoparallel and Alpa's operator clustering
do the same).

>>> layer_of_path("blocks.3.attn.qkv")
'blocks.3'
"""

from __future__ import annotations

from collections import defaultdict

import torch

from autopar.passes.capture import Captured
from autopar.plan import layer_of_path



def _layer_of(node: torch.fx.Node, captured: Captured) -> tuple[str, str] | None:
    """(layer path, node's name inside the layer) or None for nodes outside repeated layers."""
    if node.op == "placeholder":
        fqn = captured.parameter_of.get(node.name) or captured.buffer_of.get(node.name)
        layer = layer_of_path(fqn) if fqn else None
        return (layer, fqn[len(layer) + 1:]) if layer else None
    if node.op != "call_function":
        return None
    for path, _cls in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        layer = layer_of_path(path)
        if layer:
            return layer, str(node.target)
    return None


def _members(captured: Captured) -> tuple[dict[str, list[torch.fx.Node]], dict[str, str]]:
    members: dict[str, list[torch.fx.Node]] = defaultdict(list)
    local: dict[str, str] = {}
    for node in captured.graph.nodes:
        found = _layer_of(node, captured)
        if found:
            members[found[0]].append(node)
            local[node.name] = found[1]
    return members, local


def layer_signatures(captured: Captured) -> dict[str, tuple]:
    """A hashable signature per layer: equal signatures, identical layers."""
    members, local = _members(captured)
    return {layer: _signature(nodes, local) for layer, nodes in members.items()}


def find_repeated_layers(captured: Captured) -> dict[str, str]:
    """Map each node of a repeated layer to the matching node of the first identical layer."""
    members, local = _members(captured)
    families: dict[str, list[str]] = defaultdict(list)
    for layer in members:
        families[layer.rsplit(".", 1)[0]].append(layer)
    same_as: dict[str, str] = {}
    for layers in families.values():
        signatures = {layer: _signature(members[layer], local) for layer in layers}
        for layer in layers[1:]:
            rep = next(r for r in layers if signatures[r] == signatures[layer])
            if rep != layer:
                same_as.update({a.name: b.name for a, b in zip(members[layer], members[rep])})
    return same_as


def _signature(nodes: list[torch.fx.Node], local: dict[str, str]) -> tuple:
    position = {n.name: k for k, n in enumerate(nodes)}

    def shape(n):
        v = n.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in vals)

    def argument(a):  # wiring inside the layer, shape of what comes from outside, constants
        if isinstance(a, torch.fx.Node):
            return ("in", position[a.name]) if a.name in position else ("outside", shape(a))
        return repr(a)

    return tuple((n.op, local[n.name], shape(n),
                  tuple(argument(a) for a in torch.utils._pytree.tree_flatten((n.args, n.kwargs))[0]))
                 for n in nodes)
