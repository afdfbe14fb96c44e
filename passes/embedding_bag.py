"""Fixed-size embedding bags as a lookup and a reduction, so they can be trained and sharded.

``nn.EmbeddingBag`` on a (batch, bag) index tensor exports as ``aten.embedding_bag`` with
offsets ``arange(0, batch·bag, bag)``. That op has no DTensor rule in torch 2.13, and its
core-ATen decomposition below autograd is ``_embedding_bag_forward_only`` — no backward at
all. With every bag the same size the op is exactly ``embedding`` (batch, bag, dim) followed
by a sum or a mean over the bag (per-sample weights multiply first), which DTensor shards
row-wise, column-wise or by batch, and which the sparse-exchange planning (passes.sparse)
treats like any other lookup. The price: the (batch, bag, dim) lookup result is materialised
once (EmbeddingBag fuses it away); it is not kept for backward.

Bags of varying size (explicit offsets), ``max`` mode, ``padding_idx`` and
``scale_grad_by_freq`` stay as they are (they run replicated and forward-only; a warning
says so).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._guards import detect_fake_mode

log = logging.getLogger(__name__)

aten = torch.ops.aten
_BAGS = (aten.embedding_bag.default, aten.embedding_bag.padding_idx)
_SUM, _MEAN = 0, 1


def lower_fixed_bags(program: torch.export.ExportedProgram) -> int:
    """Rewrite every fixed-size embedding bag of ``program``'s graph in place; returns how many."""
    graph = program.graph_module.graph
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    rewritten = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _BAGS:
            bag = _fixed_bag_size(node)
            if bag is None or fake_mode is None:
                log.warning("embedding bag %s has bags of varying size or an unsupported option (max mode, "
                            "padding_idx, scale_grad_by_freq): it runs replicated and is not trainable", node.name)
                continue
            _rewrite(graph, node, bag, fake_mode)
            rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return rewritten


def _argument(node: torch.fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _fixed_bag_size(node: torch.fx.Node) -> int | None:
    """The bag size when offsets are ``arange(0, n, bag)`` and the options allow the rewrite."""
    weight, indices, offsets = node.args[:3]
    if (_argument(node, 3, "scale_grad_by_freq", False) or _argument(node, 4, "mode", 0) not in (_SUM, _MEAN)
            or _argument(node, 7, "include_last_offset", False) or _argument(node, 8, "padding_idx", None)
            not in (None, -1)):
        return None
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users if u.users):
        return None  # offset2bag / bag sizes are used by something: keep the op
    if not (isinstance(offsets, torch.fx.Node) and offsets.target is aten.arange.start_step):
        return None
    start, end, step = offsets.args[:3]
    n = indices.meta["val"].numel()
    if start != 0 or end != n or not isinstance(step, int) or step <= 0 or n % step:
        return None
    return step


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, bag: int, fake_mode) -> None:
    weight, indices = node.args[:2]
    weights = _argument(node, 6, "per_sample_weights", None)
    mode = _argument(node, 4, "mode", 0)
    n = indices.meta["val"].numel()
    inherited = {k: node.meta[k] for k in ("nn_module_stack", "stack_trace", "source_fn_stack") if k in node.meta}

    def add(target, *args):
        new = graph.call_function(target, args)
        with fake_mode:
            new.meta["val"] = target(*torch.fx.node.map_arg(args, lambda a: a.meta["val"]))
        new.meta.update(inherited)
        return new

    with graph.inserting_before(node):
        ids = add(aten.view.default, indices, [n // bag, bag])
        rows = add(aten.embedding.default, weight, ids)  # (bags, bag, dim)
        if weights is not None:
            scale = add(aten.unsqueeze.default, add(aten.view.default, weights, [n // bag, bag]), -1)
            rows = add(aten.mul.Tensor, rows, scale)
        reduced = add(aten.sum.dim_IntList if mode == _SUM else aten.mean.dim, rows, [1])
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(reduced)
        graph.erase_node(user)
    graph.erase_node(node)
