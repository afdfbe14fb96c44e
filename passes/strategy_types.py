"""What a strategy is — the placements of a node's tensor outputs and inputs — and the
small helpers every pass that reads strategies shares (a node's tensor arguments in DTensor's
order, its output values, whether a placement splits a shape evenly). Kept apart from
passes.strategies (which enumerates them from DTensor's registry) so the passes that only read
strategies, and the bag-split rules of passes.bag_strategies, need not import the enumeration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from autopar import placements as pl


@dataclass(frozen=True)
class Strategy:
    """Placements (a spec, one placement per mesh dim, each) of a node's tensor outputs and
    tensor inputs."""

    outputs: tuple[pl.Spec | None, ...]
    inputs: tuple[pl.Spec, ...]
    # "" for DTensor's own rules; "sparse_allgather": a lookup that exchanges its table's
    # gradient as touched rows itself (passes.sparse), so the table's edge carries no gradient
    exchange: str = ""
    # a parameter's optimizer-state placement when it differs from how the parameter is used
    # (ZeRO-2: used replicated, fp32 master, gradient and states sharded); None: the same
    state: pl.Spec | None = None

    @property
    def stored(self) -> pl.Spec | None:
        """Where a parameter's master weight, gradient and optimizer states live."""
        return self.state if self.state is not None else self.outputs[0]


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued argument nodes in DTensor's flattening order (args, then kwargs)."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def output_vals(node: torch.fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


def evenly_sharded(shape, spec: pl.Spec, mesh_shape: tuple[int, ...], by_bags: bool = False) -> bool:
    """Whether every dim ``spec`` splits divides over its devices. ``by_bags``: the first dim
    holds a batch's ids, split by bags (unevenly, passes.embedding_bag): it need not divide."""
    parts = [1] * len(shape)
    for p, size in zip(spec, mesh_shape):
        if p.is_shard:
            parts[p.dim] *= size
    return all(s % k == 0 and s >= k for d, (s, k) in enumerate(zip(shape, parts))
               if k > 1 and not (by_bags and d == 0))
