"""Strategies of a batch split by bags (passes.embedding_bag): an id-indexed tensor — a batch's
ids, their rows, their bag numbers — splits its first dim only as whole bags do, unevenly (a
device's ids are its own bags'), so its strategies are filtered and converted here rather than
taken as DTensor's even positional splits."""

from __future__ import annotations

import itertools
import operator

import torch

from autopar import placements as pl
from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.strategy_types import Strategy, evenly_sharded, output_vals, tensor_args


def split_ids_by_bags_only(node: torch.fx.Node, strategies: list[Strategy], counts: set[str],
                           by_bags: set[str]) -> list[Strategy]:
    """``strategies`` of ``node`` (an op, or an input's placements) that split the first dim of
    its id-indexed tensors (passes.embedding_bag.id_indexed) only as a split by bags does: where
    the node's chain may split by bags (``by_bags``: passes.embedding_bag.bag_split_inputs), and
    then every id-indexed tensor of the strategy on the same mesh dims (a device's ids, their
    rows and bag numbers are its own bags'). A pooling whose rows split so pools its own bags
    (:func:`pooled_by_bags`). The replicated strategy always remains."""
    getitem = node.target is operator.getitem
    args = [node.args[0]] if getitem else tensor_args(node)
    outputs = [node.name in counts] * len(output_vals(node))
    inputs = outputs if getitem else [a.name in counts for a in args]
    if not any(outputs) and not any(inputs):
        return strategies
    if node.target is POOL_ROWS:
        strategies = pooled_by_bags(strategies)
    allowed = node.name in by_bags if any(outputs) else all(a.name in by_bags for a, w in zip(args, inputs) if w)
    kept = []
    for strategy in strategies:
        specs = zip((*outputs, *inputs), (*strategy.outputs, *strategy.inputs))
        splits = {first_dim_split(spec) for whole, spec in specs if whole and spec is not None}
        if splits <= {()} or (allowed and len(splits) == 1):
            kept.append(strategy)
    return kept


def first_dim_split(spec: pl.Spec) -> tuple[int, ...]:
    """The mesh dims that split a tensor's first dim."""
    return tuple(m for m, d in pl.sharded_dims(spec) if d == 0)


def pooled_by_bags(strategies: list[Strategy]) -> list[Strategy]:
    """A pooling (``autopar::pool_rows``) whose rows and bag numbers split by bags pools each
    device's own bags: its output splits by bags on those mesh dims. (The op's registered rule
    for rows split by position gives partial bags; the planner splits ids by bags only.)"""
    converted = []
    for strategy in strategies:
        out, rows = strategy.outputs[0], strategy.inputs[0]
        by_bags = [m for m, p in enumerate(rows) if p == pl.Shard(0)]
        if by_bags:
            out = tuple(pl.Shard(0) if m in by_bags else p for m, p in enumerate(out))
            strategy = Strategy((out,), strategy.inputs, strategy.exchange, strategy.state)
        converted.append(strategy)
    return converted


def bag_number_strategies(node: torch.fx.Node, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """Each id's bag number (``repeat_interleave(lengths)``, passes.embedding_bag) replicated,
    or split by bags with the bags' lengths: a device repeats its own bags' lengths and numbers
    its ids from its first bag (passes.bag_runtime.bag_numbers). No DTensor rule exists."""
    lengths = node.args[0].meta["val"]
    options = []
    for combo in itertools.product([pl.R, pl.Shard(0)], repeat=len(mesh_shape)):
        if evenly_sharded(lengths.shape, combo, mesh_shape):
            options.append(Strategy((tuple(combo),), (tuple(combo),)))
    return options
