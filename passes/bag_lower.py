"""Lowering of bags of varying size (passes.embedding_bag), a helper of passes.lower.

Where a plan splits them by bags, lowering cuts each device's bags' ids (and per-sample
weights) from the full inputs, numbers them by its own bags and pools them into those
(passes.bag_runtime); wherever they run, the batch's id count the trace held as a constant is
read from the ids as they come, so one lowered program serves every id count. What lowering
needs of the graph is read once, before it rewrites the inputs' uses (:class:`BagLowering`).
"""

from __future__ import annotations

import torch

from autopar import placements as pl
from autopar.passes import bag_runtime
from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.embedding_bag import bag_split_inputs, id_count_constant, pooling_ids, poolings
from autopar.passes.bag_strategies import first_dim_split


class BagLowering:
    """The poolings of bags of varying size of a graph about to be lowered: which inputs may
    be cut by bags and from which offsets, which nodes split with them, each pooling's ids
    input and the constant holding their count."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.inputs, self.chains = bag_split_inputs(graph)
        self.placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        pools = poolings(graph)
        self.ids_of_numbers = {pool.args[1].name: pooling_ids(pool) for pool in pools}  # bag numbers -> ids input
        counts = [(id_count_constant(pool), pooling_ids(pool)) for pool in pools if pool.args[1].name in self.chains]
        self.id_counts = [(constant, ids) for constant, ids in counts if constant is not None and ids is not None]
        self.cuts: list[torch.fx.Node] = []

    def distribute(self, node: torch.fx.Node, mesh_node: torch.fx.Node, planned: str,
                   cast: torch.dtype | None) -> torch.fx.Node | None:
        """An input ``node`` planned split by bags, cut for each device (bag_runtime.bag_input)
        from the full offsets every rank holds: inserted after the last input, so the offsets
        are defined before it reads them, and every use of ``node`` reads the cut. None for
        any other input."""
        bag = self.inputs.get(node.name)
        if bag is None or not first_dim_split(pl.parse_spec(planned)):
            return None
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            cut = self.graph.call_function(bag_runtime.bag_input, (node, self.placeholders[bag.offsets], mesh_node,
                                                                   planned, bag.bags, cast))
        cut.meta["val"] = node.meta.get("val")
        for user in list(node.users):
            if user is not cut:
                user.replace_input_with(node, cut)
        self.cuts.append(cut)
        return cut

    def after_inputs(self, mesh_node: torch.fx.Node, replicated: str, produced: dict) -> None:
        """Once every input is distributed: the cuts read the full offsets again (distributing
        the offsets input re-pointed its uses), and each id count is read from its ids input as
        it comes (bag_runtime.id_count), placed ``replicated``."""
        for cut in self.cuts:
            cut.update_arg(1, self.placeholders[self.inputs[cut.args[0].name].offsets])
        for constant, ids in self.id_counts:
            dtype = constant.kwargs.get("dtype") or constant.meta["val"].dtype
            constant.args, constant.kwargs = (ids, mesh_node, dtype), {}
            constant.target = bag_runtime.id_count
            produced[constant.name] = replicated

    def rewrite(self, node: torch.fx.Node, output_spec: str, mesh_node: torch.fx.Node) -> bool:
        """Lower ``node`` if it is a chain's bag numbers (bag_runtime.bag_numbers: the global
        size from the ids input, else the traced count) or a pooling split by bags
        (bag_runtime.pool_bags); whether it was."""
        if node.target is torch.ops.aten.repeat_interleave.Tensor and node.name in self.chains:
            ids = self.ids_of_numbers.get(node.name) or node.meta["val"].shape[0]
            node.args, node.kwargs = (node.args[0], mesh_node, output_spec, ids), {}
            node.target = bag_runtime.bag_numbers
            return True
        if node.target is POOL_ROWS and first_dim_split(pl.parse_spec(output_spec)):
            node.args = (*node.args[:3], mesh_node, output_spec)
            node.target = bag_runtime.pool_bags
            return True
        return False
