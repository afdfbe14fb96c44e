"""Grouped-GEMM experts rewritten per row, so their rows can be split and dispatched.

A grouped-GEMM MoE layer (transformers' default ``grouped_mm`` experts; ``torch._grouped_mm``
on GPUs, ``transformers::grouped_mm_fallback`` on CPU) computes, for the (token, choice) rows:

    ids_sorted, perm = sort(ids)                      # rows grouped by expert
    x = hidden[perm // k];  g = weights[perm]         # the rows in that order
    offs = cumsum(histc(ids_sorted, E))               # each expert's block
    y = grouped_mm(x, W1, offs) … act … grouped_mm(·, W2, offs) * g
    out = y[inverse(perm)]                            # back in the rows' own order

Everything between the permutation and its inverse computes each row on its own, so the
permutation changes nothing: with ``perm`` the identity and each ``grouped_mm`` written per
row (``autopar::expert_mm(x, W, ids)``, passes.expert_mm) the layer gives the same result —
and becomes the form passes.expert_dispatch sends to the experts' owners (the sort
happens inside the kernel, on the rows a device holds), while the data-parallel split of the
tokens runs through it unchanged. A sort DTensor would have to replicate.

:func:`ungroup_experts` checks that form node by node — only the permuted gathers, row-wise
ops (passes.expert_dispatch's rules), the grouped products, the offsets' chain and the
inverse permutation depend on the sort — and rewrites it; anything else is left as captured
(its experts then run replicated or split inside, as before).
"""

from __future__ import annotations

import logging
import operator

import torch

from autopar.passes.expert_mm import EXPERT_MM
from autopar.passes.graph_edit import call_with_value
from autopar.passes.row_ops import row_wise

log = logging.getLogger(__name__)
aten = torch.ops.aten
_GROUPED = {"aten::_grouped_mm", "transformers::grouped_mm_fallback"}
_SORTS = {aten.sort.default, aten.sort.stable}
_FLOOR_DIVS = {aten.div.Tensor_mode, aten.floor_divide.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_OFFSETS_CHAIN = {aten._to_copy.default, aten.histc.default, aten.bincount.default, aten.cumsum.default}


def _op_name(node: torch.fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else None


def _offsets(product: torch.fx.Node):
    """A grouped product's ``offs`` argument (positional or keyword; None when absent)."""
    return product.args[2] if len(product.args) > 2 else product.kwargs.get("offs")


def grouped_products(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The grouped matrix products (``grouped_mm`` with offsets, no bias, no output dtype)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or _op_name(node) not in _GROUPED:
            continue
        offs = _offsets(node)
        extras = [*node.args[3:], *(v for k, v in node.kwargs.items() if k != "offs")]
        if isinstance(offs, torch.fx.Node) and all(e is None for e in extras):
            found.append(node)
    return found


def _sorted_ids(offs: torch.fx.Node) -> torch.fx.Node | None:
    """The sorted ids an ``offs`` counts (``cumsum(histc(float(ids)))`` or
    ``cumsum(bincount(ids))``), or None."""
    node = offs
    while node.op == "call_function" and node.target in _OFFSETS_CHAIN:
        node = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 \
            and node.args[0].target in _SORTS:
        return node
    return None


def _is_sort_of_rows(sort: torch.fx.Node) -> bool:
    ids = sort.args[0].meta.get("val")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point:
        return False
    if sort.target is aten.sort.stable:
        dim, descending = sort.kwargs.get("dim", -1), sort.kwargs.get("descending", False)
    else:
        dim = sort.args[1] if len(sort.args) > 1 else sort.kwargs.get("dim", -1)
        descending = sort.args[2] if len(sort.args) > 2 else sort.kwargs.get("descending", False)
    return dim in (0, -1) and not descending


def _identity_arange(node, rows: int) -> bool:
    if not isinstance(node, torch.fx.Node) or node.target not in _ARANGES:
        return False
    args = list(node.args)
    if node.target is aten.arange.default:
        args = [0, *args]
    return args[:2] == [0, rows] and (len(args) < 3 or args[2] == 1)


class _Region:
    """What depends on one sort, classified; ``None`` from :meth:`of` when something does not fit."""

    def __init__(self, sort: torch.fx.Node) -> None:
        self.sort = sort
        self.rows = sort.args[0].meta["val"].shape[0]
        self.values = self.perm = None
        self.gathers: list[tuple[torch.fx.Node, torch.fx.Node, int]] = []  # (gather, source, repeat)
        self.restores: list[torch.fx.Node] = []  # y[inverse(perm)]
        self.products: list[torch.fx.Node] = []
        self.removed: set[torch.fx.Node] = set()  # the perm's arithmetic, the offsets, the inverse

    @classmethod
    def of(cls, graph: torch.fx.Graph, sort: torch.fx.Node, products: set) -> "_Region | None":
        region = cls(sort)
        return region if region._classify(graph, products) else None

    def _classify(self, graph, products: set) -> bool:
        for user in self.sort.users:
            if user.target is not operator.getitem:
                return False
            if user.args[1] == 0:
                self.values = user
            else:
                self.perm = user
        if self.values is None or self.perm is None:
            return False
        rows, dependent = set(), {self.sort, self.values, self.perm}
        inverse = None
        for node in graph.nodes:
            if node in dependent or node.op != "call_function" or not any(a in dependent for a in node.all_input_nodes):
                continue
            dependent.add(node)
            args = node.args
            if node.target in _OFFSETS_CHAIN and all(u.target in _OFFSETS_CHAIN or u in products for u in node.users):
                self.removed.add(node)  # the blocks' bounds, only read by grouped products
            elif node.target in _FLOOR_DIVS and args[0] is self.perm and isinstance(args[1], int) \
                    and node.kwargs.get("rounding_mode", "floor") == "floor" and self.rows % args[1] == 0:
                self.removed.add(node)
            elif node.target is aten.index.Tensor and len(args[1]) == 1 and args[0] not in dependent:
                index = args[1][0]
                if index is self.perm or index is self.values:  # x[perm], or a per-expert gather (a bias)
                    if index is self.perm:
                        self.gathers.append((node, args[0], 1))
                    rows.add(node)
                elif index in self.removed and index.target in _FLOOR_DIVS:
                    self.gathers.append((node, args[0], index.args[1]))
                    rows.add(node)
                else:
                    return False
            elif node.target is aten.index_put.default and len(args[1]) == 1 and args[1][0] is self.perm \
                    and inverse is None and _identity_arange(args[2], self.rows) and args[0] not in dependent:
                inverse = node
                self.removed.add(node)
            elif node.target is aten.index.Tensor and inverse is not None and args[1] == [inverse] and args[0] in rows:
                self.restores.append(node)
                dependent.discard(node)  # the rows' own order again: the region ends here
            elif node in products and node.args[0] in rows and node.args[1] not in dependent:
                self.products.append(node)
                rows.add(node)
            elif row_wise(node, self.rows) and all(a in rows or a not in dependent for a in node.all_input_nodes):
                rows.add(node)
            else:
                log.info("grouped experts after %s left as captured: %s (%s) reads the sorted rows and is "
                         "not one of the ops the rewrite knows", self.sort.name, node.name, node.target)
                return False
        offsets = {_offsets(p) for p in self.products}
        return bool(self.products) and bool(self.restores) and offsets <= self.removed \
            and all(_sorted_ids(o) is self.values for o in offsets)


def ungroup_experts(graph: torch.fx.Graph) -> int:
    """Rewrite every grouped-GEMM expert region of ``graph`` per row (module docstring);
    returns how many regions were rewritten. The caller recompiles the module."""
    products = grouped_products(graph)
    sorts = {}
    for product in products:
        values = _sorted_ids(_offsets(product))
        if values is not None and _is_sort_of_rows(values.args[0]):
            sorts.setdefault(values.args[0], set()).add(product)
    rewritten = 0
    for sort, grouped in sorts.items():
        region = _Region.of(graph, sort, grouped)
        if region is not None:
            _rewrite(graph, region)
            rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
    return rewritten


def _rewrite(graph: torch.fx.Graph, region: _Region) -> None:
    ids = region.sort.args[0]
    for product in region.products:
        with graph.inserting_before(product):
            per_row = graph.call_function(EXPERT_MM, (product.args[0], product.args[1], ids))
        per_row.meta = dict(product.meta)
        product.replace_all_uses_with(per_row)
        graph.erase_node(product)
    for gather, source, repeat in region.gathers:
        gather.replace_all_uses_with(source if repeat == 1 else _repeated_rows(graph, gather, source, repeat))
    for restore in region.restores:
        restore.replace_all_uses_with(restore.args[0])
    region.values.replace_all_uses_with(ids)  # per-expert gathers (a bias) read the rows' own ids


def _repeated_rows(graph: torch.fx.Graph, gather: torch.fx.Node, source: torch.fx.Node, repeat: int) -> torch.fx.Node:
    """``source`` with each row repeated ``repeat`` times in place (``source[arange // k]``),
    as views and a copy DTensor splits by rows."""
    val = source.meta["val"]
    steps = [(aten.unsqueeze.default, (1,)), (aten.expand.default, ([val.shape[0], repeat, *val.shape[1:]],)),
             (aten.clone.default, ()), (aten.view.default, ([val.shape[0] * repeat, *val.shape[1:]],))]
    node = source
    with graph.inserting_before(gather):
        for op, args in steps:
            node = call_with_value(graph, gather, op, (node, *args))
    return node
