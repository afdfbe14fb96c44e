"""Inserting nodes into a captured graph the way capture's rewrites need them: each new node
carries its fake value (later passes read ``meta["val"]`` for shapes and costs) and the
source metadata of the node it stands for (``nn_module_stack`` places it in its layer for
repeated-layer folding and stage cutting; ``stack_trace`` names the model's line in
messages). Shared by the rewrites of embedding bags, grouped experts, stacked experts and
the memoised decomposition, which each did it by hand before.
"""

from __future__ import annotations

import torch

# node.meta entries a node inserted in place of another inherits from it
INHERITED_META = ("nn_module_stack", "stack_trace", "torch_fn", "source_fn_stack", "from_node")


def inherited_meta(node: torch.fx.Node) -> dict:
    """``node``'s source metadata (:data:`INHERITED_META`), for a node standing in for it."""
    return {k: node.meta[k] for k in INHERITED_META if k in node.meta}


def call_with_value(graph: torch.fx.Graph, like: torch.fx.Node, target, args: tuple, kwargs: dict | None = None,
                    fake_mode=None) -> torch.fx.Node:
    """``target(*args, **kwargs)`` inserted at ``graph``'s insertion point, with its fake value
    (``target`` run on the arguments' values, under ``fake_mode`` when given — a factory op
    with no tensor argument needs it) and ``like``'s source metadata."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    if fake_mode is None:
        node.meta["val"] = target(*values[0], **values[1])
    else:
        with fake_mode:
            node.meta["val"] = target(*values[0], **values[1])
    node.meta.update(inherited_meta(like))
    return node
