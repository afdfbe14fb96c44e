"""Fixed-size embedding bags as a lookup and a reduction, so they can be trained and sharded.

``nn.EmbeddingBag`` on a (batch, bag) index tensor exports as ``aten.embedding_bag`` with
offsets ``arange(0, batch·bag, bag)``. That op has no DTensor rule in torch 2.13, and its
core-ATen decomposition below autograd is ``_embedding_bag_forward_only`` — no backward at
all. With every bag the same size the op is exactly ``embedding`` (batch, bag, dim) followed
by a sum or a mean over the bag (per-sample weights multiply first), which DTensor shards
row-wise, column-wise or by batch, and which the sparse-exchange planning (passes.sparse)
treats like any other lookup. The price: the (batch, bag, dim) lookup result is materialised
once (EmbeddingBag fuses it away); it is not kept for backward.

Bags of varying size — the form DLRM and TorchRec use, ``bag(ids, offsets)`` with 1-D ids
and the offsets as an input — become the lookup of every id, ``(N, dim)``, summed into its bag
by ``autopar::pool_rows`` (passes.bag_pooling) with each id's bag number from
``repeat_interleave(lengths)`` (``output_size`` N, so every shape stays fixed), divided by the
bag's length for ``mean`` (an empty bag is zeros, as EmbeddingBag gives). The lookup is what
the sparse planning shards and exchanges; the pooling splits with it — the rows partial (a
row-wise table), pooled into partial bags then reduced or reduce-scattered by bag
(TorchRec's row-wise output), or the columns split. The ids are never split by position
(:func:`id_indexed`): their count changes with every batch. They split by bags instead, as
TorchRec's data-parallel input distribution splits them: each device takes an even share of
the bags and their ids, however many (:func:`bag_split_inputs`; lowered by
passes.bag_runtime), and its lookups, its touched rows (Parallax's sparse exchange) and its
pooled bags are its own. Costs treat such a split as an even one of the ids (each device 1/n of
the batch's lookups and their rows' memory); the device holding the most ids takes longer by
its excess, which the plan does not see (the touched rows, from the example ids, are counted
by bags: passes.sparse). ``max`` mode, ``padding_idx`` and ``scale_grad_by_freq`` stay as they
are (they run replicated and forward-only; a warning says so).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten

from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.graph_edit import call_with_value

log = logging.getLogger(__name__)

aten = torch.ops.aten
_BAGS = (aten.embedding_bag.default, aten.embedding_bag.padding_idx)
_SUM, _MEAN = 0, 1


def lower_fixed_bags(program: torch.export.ExportedProgram) -> int:
    """Rewrite every embedding bag of ``program``'s graph (fixed-size, or jagged with offsets)
    in place; returns how many."""
    graph = program.graph_module.graph
    vals = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    rewritten = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _BAGS:
            if fake_mode is not None and _plain_options(node) and _jagged(node):
                _rewrite_jagged(graph, node, fake_mode)
                rewritten += 1
                continue
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


def _plain_options(node: torch.fx.Node) -> bool:
    """Sum or mean, no padding row, no frequency scaling, and only the pooled bags used (not
    offset2bag or the bag sizes the op also returns)."""
    if (_argument(node, 3, "scale_grad_by_freq", False) or _argument(node, 4, "mode", 0) not in (_SUM, _MEAN)
            or _argument(node, 8, "padding_idx", None) not in (None, -1)):
        return False
    return not any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users if u.users)


def _jagged(node: torch.fx.Node) -> bool:
    """Offsets given as data (not ``arange``): bags of any sizes, 1-D ids."""
    indices, offsets = node.args[1:3]
    return (isinstance(offsets, torch.fx.Node) and offsets.target is not aten.arange.start_step
            and indices.meta["val"].dim() == 1 and offsets.meta["val"].dim() == 1)


def _fixed_bag_size(node: torch.fx.Node) -> int | None:
    """The bag size when offsets are ``arange(0, n, bag)`` and the options allow the rewrite."""
    weight, indices, offsets = node.args[:3]
    if not _plain_options(node) or _argument(node, 7, "include_last_offset", False):
        return None
    if not (isinstance(offsets, torch.fx.Node) and offsets.target is aten.arange.start_step):
        return None
    start, end, step = offsets.args[:3]
    n = indices.meta["val"].numel()
    if start != 0 or end != n or not isinstance(step, int) or step <= 0 or n % step:
        return None
    return step


def _adder(graph: torch.fx.Graph, node: torch.fx.Node, fake_mode):
    """Inserts ``target(*args, **kwargs)`` with its fake value and ``node``'s source metadata."""
    def add(target, *args, **kwargs):
        return call_with_value(graph, node, target, args, kwargs, fake_mode)
    return add


def _replace_pooled(graph: torch.fx.Graph, node: torch.fx.Node, pooled: torch.fx.Node) -> None:
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(pooled)
        graph.erase_node(user)
    graph.erase_node(node)


def _rewrite_jagged(graph: torch.fx.Graph, node: torch.fx.Node, fake_mode) -> None:
    """Bags given by offsets: every id looked up, then summed into its bag (see the module
    docstring). ``include_last_offset``: the offsets end with the id count."""
    weight, indices, offsets = node.args[:3]
    weights = _argument(node, 6, "per_sample_weights", None)
    n = indices.meta["val"].numel()
    last = _argument(node, 7, "include_last_offset", False)
    bags = offsets.meta["val"].numel() - (1 if last else 0)
    add = _adder(graph, node, fake_mode)
    with graph.inserting_before(node):
        rows = add(aten.embedding.default, weight, indices)  # (N, dim)
        if weights is not None:
            rows = add(aten.mul.Tensor, rows, add(aten.unsqueeze.default, weights, -1))
        starts = add(aten.slice.Tensor, offsets, 0, 0, bags)
        ends = add(aten.slice.Tensor, offsets, 0, 1, bags + 1) if last else add(
            aten.cat.default, [add(aten.slice.Tensor, offsets, 0, 1, bags),
                               add(aten.full.default, [1], n, dtype=offsets.meta["val"].dtype,
                                   device=offsets.meta["val"].device)])
        lengths = add(aten.sub.Tensor, ends, starts)  # (bags,): ids per bag, 0 for an empty one
        bag_of = add(aten.repeat_interleave.Tensor, lengths, output_size=n)  # (N,): each id's bag
        pooled = add(POOL_ROWS, rows, bag_of, bags)  # (bags, dim)
        if _argument(node, 4, "mode", 0) == _MEAN:
            count = add(aten.clamp_min.default, add(aten.unsqueeze.default, lengths, -1), 1)
            pooled = add(aten.div.Tensor, pooled, count)
    _replace_pooled(graph, node, pooled)


def id_indexed(graph: torch.fx.Graph) -> set[str]:
    """Nodes whose first dim runs over a batch's ids in bags of varying size: the ids and
    per-sample weights, what is computed from them id by id (their lookup, the weighted rows,
    each id's bag number) up to the pooling (``autopar::pool_rows``). That dim's size is the
    batch's id count, which changes from batch to batch; a plan that split it by position
    would hold only while the count divides over the devices (the next batch of 33 ids on 2
    devices fails), so strategies split it only by bags (:func:`bag_split_inputs`)."""
    return set().union(*(chain for _, chain in _chains(graph)))


@dataclass(frozen=True)
class BagInput:
    """How to give a device its own bags' share of an input of ids (or per-sample weights):
    the input holding the bags' offsets, how many bags, whether the offsets end with the id
    count (``include_last_offset``)."""

    offsets: str
    bags: int
    last: bool


def bag_split_inputs(graph: torch.fx.Graph) -> tuple[dict[str, BagInput], set[str]]:
    """The id-indexed inputs a plan may split by bags (each device its own bags' ids, the
    offsets telling where they start), and the id-indexed nodes that split with them. A pooling
    qualifies when its offsets are an input of the model (a device slices its ids from the
    offsets every rank holds); an input of ids read by poolings of different offsets, and every
    node of such a chain, stays whole."""
    inputs: dict[str, BagInput] = {}
    conflicting: set[str] = set()
    chains = _chains(graph)
    placeholders = {n.name for n in graph.nodes if n.op == "placeholder"}
    for pool, chain in chains:
        found = pooling_offsets(pool)
        for name in sorted(chain & placeholders):
            if found is None or inputs.setdefault(name, found) != found:
                conflicting.add(name)
    splittable: set[str] = set()
    for _, chain in chains:
        if not chain & conflicting and any(name in inputs for name in chain):
            splittable |= chain
    return {name: bag for name, bag in inputs.items() if name in splittable}, splittable


def _chains(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, set[str]]]:
    """Each pooling with the id-indexed nodes it reads: the walk goes back from its rows and bag
    numbers through nodes of that first-dim size; it does not cross into a lookup's table or
    from the bag numbers into the bags' lengths."""
    chains = []
    for pool in graph.nodes:
        if pool.op != "call_function" or pool.target is not POOL_ROWS:
            continue
        found: set[str] = set()
        count = pool.args[0].meta["val"].shape[0]
        stack = [pool.args[0], pool.args[1]]
        while stack:
            node = stack.pop()
            val = node.meta.get("val")
            if node.name in found or not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[0] != count:
                continue
            found.add(node.name)
            if node.target is aten.embedding.default:
                stack.append(node.args[1])  # the ids, not the table
            elif node.target is not aten.repeat_interleave.Tensor:  # its input counts bags
                stack.extend(node.all_input_nodes)
        chains.append((pool, found))
    return chains


def _bag_lengths(pool: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(ends, starts) of a pooling's bag lengths ``ends - starts`` as :func:`_rewrite_jagged`
    builds its bag numbers (``repeat_interleave`` of them), or None for another pooling."""
    bag_of = pool.args[1]
    if bag_of.target is not aten.repeat_interleave.Tensor or bag_of.args[0].target is not aten.sub.Tensor:
        return None
    ends, starts = bag_of.args[0].args[:2]
    return ends, starts


def pooling_offsets(pool: torch.fx.Node) -> BagInput | None:
    """The offsets input of a pooling as :func:`_rewrite_jagged` builds it (its bag numbers
    repeat the lengths ``ends - starts``, ``starts`` the offsets' first ``bags``), or None when
    they are computed inside the model."""
    lengths = _bag_lengths(pool)
    if lengths is None:
        return None
    ends, starts = lengths
    offsets = starts.args[0] if starts.target is aten.slice.Tensor else None
    if offsets is None or offsets.op != "placeholder":
        return None
    return BagInput(offsets.name, pool.args[2], ends.target is aten.slice.Tensor)


def id_count_constant(pool: torch.fx.Node) -> torch.fx.Node | None:
    """The constant holding the batch's id count in a pooling's bag lengths — the last bag's
    end when the offsets do not end with it (``full([1], n)``, :func:`_rewrite_jagged`) — or
    None (``include_last_offset``: the offsets hold it). Lowering reads the count from the
    ids instead (passes.bag_runtime.id_count), so one program serves every id count."""
    lengths = _bag_lengths(pool)
    if lengths is None:
        return None
    ends = lengths[0]
    if ends.target is aten.cat.default and ends.args[0][-1].target is aten.full.default:
        return ends.args[0][-1]
    return None


def poolings(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's poolings of bags of varying size (``autopar::pool_rows``), in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target is POOL_ROWS]


def pooling_ids(pool: torch.fx.Node) -> torch.fx.Node | None:
    """The input of ids whose lookup a pooling pools (through per-sample weights' multiply),
    or None when the ids are computed inside the model."""
    rows = pool.args[0]
    while rows.target is aten.mul.Tensor:
        rows = rows.args[0]
    if rows.target is not aten.embedding.default:
        return None
    ids = rows.args[1]
    return ids if ids.op == "placeholder" else None


def pooling_weights(pool: torch.fx.Node) -> tuple[bool, torch.fx.Node | None]:
    """(whether a pooling's rows are weighted, the input of per-sample weights when they are
    one): the rows multiplied by ``unsqueeze(weights, -1)`` (:func:`_rewrite_jagged`)."""
    rows = pool.args[0]
    if rows.target is not aten.mul.Tensor:
        return False, None
    scale = rows.args[1]
    if isinstance(scale, torch.fx.Node) and scale.target is aten.unsqueeze.default \
            and scale.args[0].op == "placeholder":
        return True, scale.args[0]
    return True, None


def count_free_inputs(graph: torch.fx.Graph) -> set[str]:
    """Inputs of ids (and their weights) whose count no node of the lowered program holds:
    read only by their bags' chains (:func:`id_indexed`), whose offsets are inputs and whose
    last end is read from the ids (:func:`id_count_constant`, :func:`pooling_ids`). A call
    with another id count runs the program lowered for the first (passes.relower)."""
    by_input, chains = bag_split_inputs(graph)
    pools = poolings(graph)
    for pool in pools:
        if pool.args[1].name in chains and pooling_ids(pool) is None:
            return set()  # the count is a constant nothing at run time can read
    return {node.name for node in graph.nodes
            if node.name in by_input and all(user.name in chains for user in node.users)}


def literals_but_id_counts(graph: torch.fx.Graph) -> list[tuple[str, tuple]]:
    """Every call's arguments that are not tensors (sizes, dims, constants), by node, but those
    lowering reads from the ids as they come (:func:`id_count_constant`, each id's bag
    number's ``output_size``). Two traces at other id counts that give the same list hold no
    id count anywhere else — e.g. no view or constant made from ``ids.numel()`` in the model's
    own code — so one lowered program serves both (passes.relower checks it once)."""
    pools = poolings(graph)
    skip = {pool.args[1].name for pool in pools}
    skip |= {c.name for c in map(id_count_constant, pools) if c is not None}
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.name not in skip:
            flat = [a for a in tree_flatten((node.args, node.kwargs))[0] if not isinstance(a, torch.fx.Node)]
            found.append((node.name, tuple(repr(a) for a in flat)))
    return found


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, bag: int, fake_mode) -> None:
    weight, indices = node.args[:2]
    weights = _argument(node, 6, "per_sample_weights", None)
    mode = _argument(node, 4, "mode", 0)
    n = indices.meta["val"].numel()
    add = _adder(graph, node, fake_mode)
    with graph.inserting_before(node):
        ids = add(aten.view.default, indices, [n // bag, bag])
        rows = add(aten.embedding.default, weight, ids)  # (bags, bag, dim)
        if weights is not None:
            scale = add(aten.unsqueeze.default, add(aten.view.default, weights, [n // bag, bag]), -1)
            rows = add(aten.mul.Tensor, rows, scale)
        reduced = add(aten.sum.dim_IntList if mode == _SUM else aten.mean.dim, rows, [1])
    _replace_pooled(graph, node, reduced)
