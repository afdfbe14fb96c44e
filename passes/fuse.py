"""Regions of the lowered graph that become one runtime call each (passes.lower's helpers):
a dispatched MoE segment (experts gathered per token whose rows go to their owners,
passes.expert_dispatch) -> ``expert_runtime.dispatch_experts``; table-wise lookups and their bag
pooling (bags of one size, or of varying size with their weights' multiply) ->
``runtime.table_wise_lookups``, one fused exchange per run of them."""

from __future__ import annotations

import operator
import warnings

import torch

from autopar import placements as pl
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.passes import bag_runtime, expert_runtime, runtime
from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.embedding_bag import pooling_offsets, pooling_weights
from autopar.passes.expert_dispatch import Dispatch, gathered_weight, segment_module, weight_position
from autopar.passes.sparse import POOLS


def fuse_dispatches(gm: torch.fx.GraphModule, plan: Plan, mesh_node: torch.fx.Node, produced: dict) -> None:
    """Replace each MoE layer's dispatched segment (experts gathered per token whose rows go to
    their owners, passes.expert_dispatch) by one ``expert_runtime.dispatch_experts`` call: the
    segment becomes a submodule the call runs on the owners."""
    graph = gm.graph
    for k, (module, layer) in enumerate(sorted(plan.experts.items())):
        entry = layer.get("dispatch")
        if not entry:
            continue
        by_name = {n.name: n for n in graph.nodes}
        present = [name for name in entry["segment"] if name in by_name]
        if not present:
            continue  # a pipeline stage without this layer
        if len(present) != len(entry["segment"]) or entry["ids"] not in by_name:
            raise AutoparError(ErrorKind.BAD_PLAN, f"MoE layer {module}: the nodes its experts' rows run through on "
                               "their owners are not all in this graph (a pipeline stage cut between them?); "
                               "re-plan this model")
        dispatch = Dispatch.from_plan(entry)
        segment = segment_module(graph, dispatch)
        attr = f"_autopar_dispatch_{k}"
        setattr(gm, attr, segment)
        ids, inputs = by_name[dispatch.ids], [by_name[name] for name in dispatch.inputs]
        weights = [gathered_weight(by_name[g]) for g in dispatch.gathers]
        position = {n: i for i, n in enumerate(graph.nodes)}
        last = max([ids, *inputs, *weights], key=position.get)
        row_spec = pl.format_spec(pl.Shard(0) if p is pl.D else p for p in plan.nodes[dispatch.ids].output_spec())
        out_specs = [plan.nodes[name].outputs[0] for name in dispatch.outputs]
        with graph.inserting_after(last), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            segment_node = graph.get_attr(attr)
        with graph.inserting_after(segment_node):
            fused = graph.call_function(expert_runtime.dispatch_experts, (
                segment_node, mesh_node, entry["dim"], dispatch.experts, ids, inputs, list(dispatch.row_inputs),
                weights, [plan.nodes[g].inputs[weight_position(by_name[g])] for g in dispatch.gathers], row_spec,
                out_specs))
        anchor = fused
        for t, name in enumerate(dispatch.outputs):
            with graph.inserting_after(anchor):
                result = graph.call_function(operator.getitem, (fused, t))
            result.meta["val"] = by_name[name].meta.get("val")
            by_name[name].replace_all_uses_with(result)
            produced[result.name] = out_specs[t]
            anchor = result
        for name in reversed(dispatch.segment):
            graph.erase_node(by_name[name])


def fuse_table_wise(graph: torch.fx.Graph, plan: Plan, mesh_node: torch.fx.Node, lookups: list[torch.fx.Node],
                    bags: dict[str, tuple] | None = None) -> None:
    """Replace table-wise lookups and their bag pooling by ``runtime.table_wise_lookups``
    calls, one per run of lookups (same mesh dim, same dtype) whose tables and ids all exist
    before any pooled result is used — in a DLRM, one for all tables. ``bags``: the poolings
    of bags of varying size (:func:`bag_pools`)."""
    position = {n: k for k, n in enumerate(graph.nodes)}
    pending: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    for lookup in sorted(lookups, key=position.get):
        pool = _pool_after(lookup)
        if pool is None:
            raise AutoparError(ErrorKind.BAD_PLAN, f"lookup {lookup.name} is planned table-wise, but no bag sum or "
                               "mean alone reads its rows in this model; re-plan this model")
        run = pending + [(lookup, pool)]
        ready = max(position[a] for lk, _ in run for a in lk.args[:2])
        first_use = min(position[u] for _, p in run for u in p.users)
        same = len({(plan.nodes[lk.name].inputs[0], plan.nodes[lk.name].outputs[0], lk.meta["val"].dtype)
                    for lk, _ in run}) == 1  # one mesh dim, one batch split, one dtype
        if pending and not (ready < first_use and same):
            _emit_table_wise(graph, plan, mesh_node, pending, bags or {})
            run = [(lookup, pool)]
        pending = run
    if pending:
        _emit_table_wise(graph, plan, mesh_node, pending, bags or {})


def _pool_after(lookup: torch.fx.Node) -> torch.fx.Node | None:
    """The bag's sum/mean reading ``lookup`` (through the redistribute lowering may have put
    between), or the pooling of bags of varying size (through the per-sample weights' multiply)."""
    node = lookup
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is runtime.redistribute or (user.target is torch.ops.aten.mul.Tensor and user.args[0] is node):
            node = user
            continue
        return user if user.target in POOLS or user.target in _BAG_POOLS else None
    return None


_BAG_POOLS = (POOL_ROWS, bag_runtime.pool_bags)  # a pooling of bags of varying size, as planned or lowered


def bag_pools(graph: torch.fx.Graph) -> dict[str, tuple]:
    """What a table's owner pools each pooling of bags of varying size from, by pooling
    (runtime.table_wise_lookups): ("bags", the full offsets input, the full per-sample weights
    input or None, include_last_offset). Read from the graph as traced, before lowering
    rewrites the inputs' uses (passes.embedding_bag)."""
    found = {}
    for pool in graph.nodes:
        if pool.op == "call_function" and pool.target is POOL_ROWS:
            bag = pooling_offsets(pool)
            _, weights = pooling_weights(pool)
            if bag is not None:
                offsets = next(n for n in graph.nodes if n.op == "placeholder" and n.name == bag.offsets)
                found[pool.name] = ("bags", offsets, weights, bag.last)
    return found


def _erase_unused(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase the calls among ``nodes`` no node reads any more, and then their inputs that
    became unread, down to the graph's inputs."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.op == "call_function" and not node.users and node.graph is graph:
            inputs = node.all_input_nodes
            graph.erase_node(node)
            stack.extend(inputs)


def _emit_table_wise(graph: torch.fx.Graph, plan: Plan, mesh_node: torch.fx.Node,
                     run: list[tuple[torch.fx.Node, torch.fx.Node]], bags: dict[str, tuple]) -> None:
    position = {n: k for k, n in enumerate(graph.nodes)}
    specs = [plan.nodes[lookup.name].outputs[0] for lookup, _ in run]  # pooled: the lookup's batch split
    pools = [bags[pool.name] if pool.target in _BAG_POOLS
             else (tuple(pool.args[1]), pool.target is torch.ops.aten.mean.dim) for _, pool in run]
    read = [a for lookup, _ in run for a in lookup.args[:2]]  # and the offsets and weights bags pool from
    read += [a for p in pools for a in p if isinstance(a, torch.fx.Node)]
    last_input = max(read, key=position.get)
    args = ([lookup.args[0] for lookup, _ in run], [lookup.args[1] for lookup, _ in run], mesh_node,
            pl.owned_dim(plan.nodes[run[0][0].name].input_spec(0)), pools,
            [tuple(pool.meta["val"].shape[1:]) for _, pool in run], specs)
    with graph.inserting_after(last_input):
        fused = graph.call_function(runtime.table_wise_lookups, args)
    anchor = fused
    for t, (lookup, pool) in enumerate(run):
        with graph.inserting_after(anchor):
            result = graph.call_function(operator.getitem, (fused, t))
        result.meta["val"] = pool.meta["val"]
        anchor = result
        wanted = plan.nodes[pool.name].outputs[0]
        if wanted != specs[t]:  # the pooled rows where the plan wants them
            with graph.inserting_after(anchor):
                result = graph.call_function(runtime.redistribute, (result, mesh_node, wanted))
            result.meta["val"] = pool.meta["val"]
            anchor = result
        pool.replace_all_uses_with(result)
        dead = [pool]
        node = pool.args[0]
        while node is not lookup:
            dead.append(node)
            node = node.args[0]
        left = [a for node in dead for a in node.all_input_nodes if a not in dead and a is not lookup]
        for node in [*dead, lookup]:
            graph.erase_node(node)
        _erase_unused(graph, left)  # bags of varying size: each id's bag number, the weights cut by bags
