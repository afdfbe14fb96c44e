"""The edges of the sharding problem: what resharding a tensor between its producer's and
its consumer's placement classes costs (passes.reshard_cost), with the parts overlap may hide,
and which arguments simply follow their producer (no pair variables off the diagonal).
passes.build_problem makes one per graph edge."""

from __future__ import annotations

import operator

import torch

from autopar import placements as pl
from autopar.comm import DDP_BUCKET_BYTES
from autopar.mesh import MeshSpec
from autopar.problem import Edge
from autopar.passes.cost import COST_KEY
from autopar.passes.reshard_cost import Parts, reshard_parts, unit_links
from autopar.passes.sparse import SPARSE_ALLGATHER, TABLE_WISE
from autopar.passes.bag_strategies import first_dim_split
from autopar.passes.strategy_types import Strategy, output_vals, tensor_args


def edge_args(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int]]:
    """(producer, which of its outputs) of each tensor ``node`` reads: a ``getitem`` reads
    one output of a multi-output op, every other op output 0 of its tensor arguments."""
    if node.target is operator.getitem:
        return [(node.args[0], node.args[1])]
    return [(a, 0) for a in tensor_args(node)]


def follows(node: torch.fx.Node, arg: int) -> bool:
    """Whether argument ``arg`` of ``node`` simply takes its producer's placement (no
    resharding on that edge): views, and single-input ops whose output is as large as their
    input (resharding after them costs what resharding before them would). Measured: no loss
    on the example GPT; extending it to the first same-size argument of binary ops lost 5%."""
    if node.meta[COST_KEY].is_view:
        return True
    args = tensor_args(node)
    outs = [v for v in output_vals(node) if isinstance(v, torch.Tensor)]
    return len(args) == 1 and len(outs) == 1 and outs[0].numel() == args[0].meta["val"].numel()


def tensor_index(node: torch.fx.Node, out_index: int) -> int:
    """Position of output ``out_index`` among the node's tensor outputs."""
    return sum(isinstance(v, torch.Tensor) for v in output_vals(node)[:out_index])


def make_edge(i, j, arg, out_index, src_options, dst_options, nbytes, needs_grad, regather, mesh, follow=False,
          sync_nbytes=None, group: int = -1, bucket_bytes: int = DDP_BUCKET_BYTES, by_bags_only: bool = False,
          held_layer: int = -1) -> Edge:
    """Resharding costs between placement classes. A ``follow`` edge only allows the consumer
    to take the producer's placement as is (when the consumer accepts it): this keeps the
    pair variables of the edge to the diagonal (coarsening, Alpa's "following").
    ``by_bags_only``: the tensor holds a batch's ids (passes.embedding_bag.id_indexed), whose
    first dim splits by bags, not by position, and unevenly: no reshard may split or gather
    that dim (pairs that change which mesh dims split it are forbidden). ``held_layer`` (a
    weight's edge): the run of ops whose gathered weights are held together
    (passes.build_problem); each pair that reshards the weight holds the result's bytes."""
    # a parameter's ZeRO-2 twin is its own class: same use, its gradient goes elsewhere
    src_keys = [(s.outputs[out_index], s.state or s.outputs[out_index]) for s in src_options]
    dst_keys = [(t.inputs[arg], _split_mask(t) if not (_syncs_table(t) and arg == 0) else ()) for t in dst_options]
    src_classes = sorted(set(src_keys))
    dst_classes = sorted(set(dst_keys))
    accepted = {v for v, _ in dst_classes}

    def parts(u: tuple, v: pl.Spec, split: tuple[bool, ...], on: MeshSpec) -> Parts | None:
        state = u[1] if u[1] != u[0] else None
        return reshard_parts(u[0], v, split, nbytes, needs_grad, on, regather, sync_nbytes, state, bucket_bytes)

    def time(u: tuple, v: pl.Spec, split: tuple[bool, ...], on: MeshSpec) -> float | None:
        found = parts(u, v, split, on)
        return None if found is None else found.total

    # each pair's reshard once: its total is the edge's cost, its parts what overlap may hide
    found = [[None if (follow and u[0] in accepted and v != u[0])
              or (by_bags_only and first_dim_split(u[0]) != first_dim_split(v)) else parts(u, v, split, mesh)
              for (v, split) in dst_classes] for u in src_classes]
    cost = [[None if p is None else p.total for p in row] for row in found]

    def volume(u: int, v: int) -> float:  # the same collectives on a link of 1 byte/s: their bytes
        return time(src_classes[u], dst_classes[v][0], dst_classes[v][1], unit_links(mesh)) or 0.0
    def unrestricted(u: int, v: int) -> float | None:
        if by_bags_only and first_dim_split(src_classes[u][0]) != first_dim_split(dst_classes[v][0]):
            return None
        return time(src_classes[u], dst_classes[v][0], dst_classes[v][1], mesh)
    overlappable = None
    if group >= 0:  # what of it can run beside compute (passes.reshard_cost.Parts)
        overlappable = [[None if p is None else tuple(p[1:]) for p in row] for row in found]
    held = None
    if held_layer >= 0:  # gathering a sharded weight makes a copy at the consumer's placement
        held = [[None if p is None else nbytes // pl.divided_over(v, mesh.shape) if _gathers(u[0], v, mesh.shape) else 0
                 for p, (v, _) in zip(row, dst_classes)] for row, u in zip(found, src_classes)]
    src_at = {k: n for n, k in enumerate(src_classes)}
    dst_at = {k: n for n, k in enumerate(dst_classes)}
    return Edge(i, j, [src_at[k] for k in src_keys], [dst_at[k] for k in dst_keys], cost,
                volume=volume, unrestricted=unrestricted if follow else None, group=group, parts=overlappable,
                held=held, layer=held_layer if held is not None else -1)


def _gathers(src: pl.Spec, dst: pl.Spec, mesh_shape: tuple[int, ...]) -> bool:
    """Whether resharding ``src`` to ``dst`` brings shards together on some mesh dim of two or
    more devices (an all-gather or all-to-all: a new tensor; splitting a replicated one is a
    slice)."""
    return any(a.is_shard and a != b and size > 1 for a, b, size in zip(src, dst, mesh_shape))


def _syncs_table(strategy: Strategy) -> bool:
    """A lookup twin that brings its table's gradient where it belongs itself."""
    return strategy.exchange in (SPARSE_ALLGATHER, TABLE_WISE)


def _split_mask(strategy: Strategy) -> tuple[bool, ...]:
    """Mesh dims the node's work is split on (a replicated input's gradient arrives partial
    there). A sparse-exchange lookup syncs its table's gradient itself: its table edge gets
    the empty mask, as if no dim were split."""
    first = next((p for p in strategy.outputs if p is not None), None)
    if first is None:
        return ()
    return tuple(p is not pl.R for p in first)
