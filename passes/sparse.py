"""Sparse parameters (embedding tables) and how their gradients are exchanged — Parallax-style.

A table read only through ``aten.embedding`` gets a gradient with nonzero rows only where the
step's indices point. Parallax (Kim et al., EuroSys 2019) showed that exchanging only those
rows beats all-reducing the dense gradient by a wide margin when the access density α is
small. Per device and step, for a table of ``w`` bytes over ``n`` data-parallel devices
(ring all-reduce; all-gather of the rows each device touched):

    dense all-reduce      2·(n−1)/n · w
    sparse all-gather     (n−1) · u · (row bytes + 8)      u = rows one device touches (α·rows)
    row-wise sharded      no gradient exchange: lookups are routed to the owner of each row
                          (DTensor's ``Shard(0)`` rule: the lookup result is a masked partial
                          sum, reduced where it is used; its cost is on those edges)
    table-wise            no gradient exchange: the whole table on one device, which pools the
                          bags of the whole batch; one all-to-all for all such tables gives each
                          device its batch shard: 2·(n−1)/n² · p per table (p = pooled bags'
                          bytes), forward and backward, when the tables spread evenly

Row-wise sharding is one of DTensor's own embedding strategies, so the ILP already weighs it.
This pass adds the sparse all-gather: every data-parallel strategy of a lookup (table
replicated, indices sharded) gets a twin whose table gradient is exchanged sparsely by the
op itself (``Strategy.exchange``), with the all-gather on the node and no partial gradient
on the table's edge; and every pooled lookup (an embedding bag) twins that place its table
table-wise (:func:`add_table_wise`; owners are chosen after the solve, greedily by traffic,
and lowering fuses the lookups into one exchange). The solver picks per table under the same
memory limits (a table-wise table counts 1/n on each device of its dim, and the planner checks
the busiest owner; passes.strategy_exchanges.table_wise_by_owners).

The number of rows one device touches comes from, in order: the user (``sparsity={fqn: α}``,
α = fraction of the table's rows one device touches per step); the example inputs (the index
computation is evaluated on the real values, split like the batch, and the busiest device
counts, since an all-gather waits for the largest piece); else uniform random access
(expected distinct rows of k draws from R: R·(1 − (1 − 1/R)^k)).

Writes ``node.meta["autopar.lookup"] = Lookup(...)`` on lookup nodes of sparse tables.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from autopar import placements as pl
from autopar.cluster import Link
from autopar.comm import all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import MeshSpec
from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.capture import Captured
from autopar.passes.embedding_bag import pooling_ids, pooling_offsets, pooling_weights
from autopar.passes.strategies import STRATEGIES_KEY, Strategy, evenly_sharded
from autopar.passes.values import evaluate, real_values

LOOKUP_KEY = "autopar.lookup"
SPARSE_ALLGATHER = "sparse_allgather"
TABLE_WISE = "table_wise"
INDEX_BYTES = 8  # int64 row ids travel with the rows
UNIT_LINK = Link(bandwidth_Bps=1.0, latency_s=0.0)  # a collective's time on this link is its volume in bytes


@dataclass(eq=False)
class Lookup:
    """One embedding lookup of a sparse table."""

    parameter: str  # the table's FQN
    rows: int
    row_bytes: int
    lookups: int  # indices per step, whole batch
    density: float | None = None  # user's α: fraction of rows one device touches per step
    indices: torch.Tensor | None = None  # the lookup's real index values, when the inputs had them
    pooled_bytes: int | None = None  # whole batch's lookup results after the bag's sum/mean, when pooled
    fused: int = 1  # table-wise lookups of the graph whose exchanges go in one all-to-all (add_table_wise)
    # where each bag's ids start (bags of varying size: their offsets, then the id count), when
    # the inputs had them: a device's share of ids is its bags' (passes.bag_runtime)
    bag_starts: torch.Tensor | None = None
    _touched: dict = dataclasses.field(default_factory=dict)

    @property
    def result_bytes(self) -> int:
        """Bytes of what row-wise owners send back per step: the pooled bags where a sum or mean
        follows the lookup (a partial sum stays partial through them), else every looked-up row."""
        return self.pooled_bytes if self.pooled_bytes is not None else self.lookups * self.row_bytes

    @property
    def table_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def source(self) -> str:
        return "user" if self.density is not None else "inputs" if self.indices is not None else "uniform"

    def touched_rows(self, shards: int, dim: int = 0) -> int:
        """Distinct rows the busiest of ``shards`` devices touches when the indices are split
        on tensor dim ``dim``."""
        key = (shards, dim)
        if key not in self._touched:
            if self.density is not None:
                touched = math.ceil(self.density * self.rows)
            elif self.indices is not None and self.bag_starts is not None and dim == 0:
                touched = max(int(piece.unique().numel()) if piece.numel() else 0 for piece in self._by_bags(shards))
            elif self.indices is not None and self.indices.dim() > dim and self.indices.shape[dim] >= shards:
                touched = max(int(piece.unique().numel()) for piece in self.indices.chunk(shards, dim))
            else:
                draws = self.lookups / shards
                touched = math.ceil(self.rows * -math.expm1(draws * math.log1p(-1 / self.rows))) if self.rows > 1 else 1
            self._touched[key] = max(1, min(self.rows, touched))
        return self._touched[key]

    def _by_bags(self, shards: int) -> list[torch.Tensor]:
        """The ids each of ``shards`` devices looks up when the bags split evenly over them."""
        bags = self.bag_starts.numel() - 1
        cuts = [self.bag_starts[min(bags, k * math.ceil(bags / shards))] for k in range(shards + 1)]
        return [self.indices[int(a):int(b)] for a, b in zip(cuts, cuts[1:])]


def annotate_lookups(captured: Captured, example_inputs=None, sparsity: dict[str, float] | None = None) -> None:
    """Find sparse tables (parameters whose only use is one embedding lookup) and attach a
    :class:`Lookup` to that lookup. ``example_inputs`` with real values give the access
    pattern; ``sparsity`` (FQN → α in (0, 1]) overrides it."""
    sparsity = dict(sparsity or {})
    for fqn, alpha in sparsity.items():
        if not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise AutoparError(ErrorKind.BAD_INPUT, f"sparsity[{fqn!r}] = {alpha!r}: the access density must be a "
                               "fraction of the table's rows in (0, 1]")
    graph = captured.graph
    values = real_values(captured, example_inputs)
    found = set()
    aliases = captured.aliases
    for node in graph.nodes:
        fqn = captured.parameter_of.get(node.name)
        if fqn is None or fqn in aliases or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.target is not torch.ops.aten.embedding.default or user.args[0] is not node or len(user.args) > 2:
            continue  # padding_idx / scale_grad_by_freq lookups keep the dense path
        weight, ids = node.meta["val"], user.args[1].meta["val"]
        user.meta[LOOKUP_KEY] = Lookup(fqn, weight.shape[0], weight[0].numel() * weight.element_size(), ids.numel(),
                                       sparsity.get(fqn), evaluate(user.args[1], values), _pooled_bytes(user),
                                       bag_starts=_bag_starts(user, values))
        found.add(fqn)
    unknown = sorted(set(sparsity) - found)
    if unknown:
        tables = sorted(found) or ["(none: the model has no table read only through one embedding lookup)"]
        raise AutoparError(ErrorKind.BAD_INPUT, f"sparsity names {', '.join(unknown)}, which is not a sparse table "
                           f"of this model; sparse tables: {', '.join(tables)}")


POOLS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim)


def _pooled_bytes(lookup: torch.fx.Node) -> int | None:
    """Bytes of the bag pooling right after a lookup (through per-sample weights' multiply),
    when its only use is a sum or mean over dims other than the row's last, or the pooling of
    bags of varying size."""
    pool = _pooling(lookup)
    if pool is None:
        return None
    out = pool.meta["val"]
    return out.numel() * out.element_size()


def _pooling(lookup: torch.fx.Node) -> torch.fx.Node | None:
    """The node pooling a lookup's rows into bags, through per-sample weights' multiply."""
    node = lookup
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is torch.ops.aten.mul.Tensor:
            node = user
            continue
        if user.target is POOL_ROWS and user.args[0] is node:
            return user
        dims = user.args[1] if len(user.args) > 1 else None
        rank = node.meta["val"].dim()
        if user.target in POOLS and dims and all(d % rank != rank - 1 for d in dims):
            return user
        return None
    return None


def _bag_starts(lookup: torch.fx.Node, values: dict) -> torch.Tensor | None:
    """Where each bag's ids start, then the id count, for a lookup pooled into bags of varying
    size whose offsets the inputs hold (passes.embedding_bag.pooling_offsets)."""
    pool = _pooling(lookup)
    bag = pooling_offsets(pool) if pool is not None and pool.target is POOL_ROWS else None
    offsets = values.get(bag.offsets) if bag is not None else None
    if offsets is None:
        return None
    starts = offsets[:bag.bags].to(torch.long)
    return torch.cat([starts, torch.tensor([lookup.args[1].meta["val"].shape[0]], device=starts.device)])


def _split_dims(strategy: Strategy) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) where the lookup's indices are sharded."""
    return pl.sharded_dims(strategy.inputs[1])


def add_sparse_exchange(graph: torch.fx.Graph) -> None:
    """Give every data-parallel strategy of a sparse lookup (table replicated, indices split,
    nothing partial) a twin that exchanges the table's gradient as touched rows."""
    for node in graph.nodes:
        if LOOKUP_KEY not in node.meta or STRATEGIES_KEY not in node.meta:
            continue
        strategies = [s for s in node.meta[STRATEGIES_KEY] if not s.exchange]
        twins = [dataclasses.replace(s, exchange=SPARSE_ALLGATHER) for s in strategies
                 if pl.is_replicated(s.inputs[0]) and _split_dims(s)
                 and not any(p.is_partial for p in (*(s.outputs[0] or ()), *s.inputs[1]))]
        node.meta[STRATEGIES_KEY] = strategies + twins


def pooling_of(lookup: torch.fx.Node) -> torch.fx.Node | None:
    """The bag's sum or mean that alone reads a lookup's rows, over dims other than the row's
    (keepdim off, no dtype): what a table's owner computes before sending (table-wise). For
    bags of varying size, their pooling (through the per-sample weights' multiply) when the
    ids, offsets and weights are inputs: the owner pools every bag of the batch from them."""
    if len(lookup.users) != 1:
        return None
    (user,) = lookup.users
    jagged = user
    if jagged.target is torch.ops.aten.mul.Tensor and jagged.args[0] is lookup and len(jagged.users) == 1:
        (jagged,) = jagged.users
    if jagged.target is POOL_ROWS:
        weighted, weights = pooling_weights(jagged)
        whole = pooling_offsets(jagged) is not None and pooling_ids(jagged) is lookup.args[1]
        return jagged if whole and (weights is not None or not weighted) else None
    if user.target not in POOLS or user.kwargs or len(user.args) > 3 or (len(user.args) == 3 and user.args[2]):
        return None
    dims, rank = (user.args[1] if len(user.args) > 1 else None), lookup.meta["val"].dim()
    if not dims or any(d % rank == rank - 1 for d in dims) or 0 in [d % rank for d in dims]:
        return None
    return user


def add_table_wise(graph: torch.fx.Graph, mesh_shape: tuple[int, ...]) -> None:
    """Give every pooled lookup of a sparse table (an embedding bag) twins that place the
    table whole on one device of a mesh dim, its owner (``O``, TorchRec's table-wise sharding):
    the owner looks up and pools the bags of the whole batch (ids replicated on that dim), and
    one all-to-all for all such tables sends every device its batch shard of the pooled rows
    (the twin's output ``Shard(0)`` there); backward sends the gradients the other way and
    the table's gradient stays on its owner. Twins come from strategies with the table and
    the ids replicated (so the owner's copies along the other mesh dims compute the same
    gradient and need no sum). Bags of varying size too: the twin splits the lookup's rows by
    bags (as the pooled bags split), and lowering has the owner pool every bag of the batch
    from the full inputs (passes.fuse.bag_pools)."""
    eligible = [n for n in graph.nodes if LOOKUP_KEY in n.meta and STRATEGIES_KEY in n.meta
                and pooling_of(n) is not None]
    for node in eligible:
        node.meta[LOOKUP_KEY].fused = len(eligible)
        pool = pooling_of(node)  # bags of varying size: the lookup's rows split by bags, the bags evenly
        shape = pool.meta["val"].shape if pool.target is POOL_ROWS else node.meta["val"].shape
        strategies = [s for s in node.meta[STRATEGIES_KEY] if s.exchange != TABLE_WISE]
        twins = []
        for s in strategies:
            table, ids, out = s.inputs[0], s.inputs[1], s.outputs[0]
            if s.exchange or out is None or not pl.is_replicated(table) or any(p.is_partial for p in ids):
                continue
            if not pl.is_replicated(ids):
                continue  # a batch split on another dim would leave the owners partial gradients to sum
            for d, size in enumerate(mesh_shape):
                owned_out = pl.with_dim(out, d, pl.Shard(0))
                if size > 1 and out[d] is pl.R and evenly_sharded(shape, owned_out, mesh_shape):
                    twins.append(Strategy((owned_out,), (pl.with_dim(table, d, pl.O), ids),
                                          exchange=TABLE_WISE))
        node.meta[STRATEGIES_KEY] = strategies + list(dict.fromkeys(twins))


def table_wise_tables(graph: torch.fx.Graph) -> set[str]:
    """Placeholder names of the tables whose lookup has table-wise twins."""
    return {n.args[0].name for n in graph.nodes if LOOKUP_KEY in n.meta
            and any(s.exchange == TABLE_WISE for s in n.meta.get(STRATEGIES_KEY, ()))}


def owned_table_options(mesh_shape: tuple[int, ...]) -> list[pl.Spec]:
    """A table's table-wise placements: whole on one device of a mesh dim, replicated on the others."""
    return [pl.with_dim(pl.replicated(len(mesh_shape)), d, pl.O)
            for d, size in enumerate(mesh_shape) if size > 1]


def table_owners(tables: list[tuple[str, int, int]], devices: int) -> dict[str, int]:
    """The owner (coordinate on their mesh dim) of each table-wise table, from (name, pooled
    bytes, table bytes): most pooled bytes first, each onto the device sending the fewest so
    far (the fused all-to-all waits for the busiest sender), then holding the fewest table
    bytes — TorchRec's greedy table-wise partitioner, by traffic first."""
    owners: dict[str, int] = {}
    sent, held = [0] * devices, [0] * devices
    for name, pooled, nbytes in sorted(tables, key=lambda t: (-t[1], -t[2], t[0])):
        k = min(range(devices), key=lambda k: (sent[k], held[k], k))
        owners[name] = k
        sent[k] += pooled
        held[k] += nbytes
    return owners


def table_wise_s(lookup: Lookup, strategy: Strategy, mesh: MeshSpec, links=None) -> float:
    """A table-wise lookup's share of the fused all-to-all, forward and backward: its owner
    sends (n−1)/n of the pooled rows, and with the tables spread evenly over the n owners each
    device sends 1/n of all tables' — (n−1)/n² of this table's bytes, the all-to-all's volume —
    while the collective's latency is paid once for the ``lookup.fused`` tables. (The planner
    adds what the busiest owner sends beyond that mean, passes.strategy_exchanges.table_wise_by_owners.)"""
    links = links or mesh.links
    d = pl.owned_dim(strategy.inputs[0])
    n, link = mesh.shape[d], links[d]
    others = math.prod(size for k, (p, size) in enumerate(zip(strategy.outputs[0], mesh.shape))
                       if k != d and p.is_shard)
    volume = all_to_all_s(lookup.result_bytes / others, n, dataclasses.replace(link, latency_s=0.0))
    return 2 * (volume + all_to_all_s(0.0, n, link) / lookup.fused)


def sparse_exchange_s(lookup: Lookup, strategy: Strategy, mesh: MeshSpec, links=None) -> float:
    """Time of the twin's gradient exchange: one all-gather of (row id, row) pairs per mesh dim
    the indices are split on, innermost first; each gathers what the previous one collected.
    A table-wise twin's is its pooled rows' all-to-all (:func:`table_wise_s`)."""
    if strategy.exchange == TABLE_WISE:
        return table_wise_s(lookup, strategy, mesh, links)
    links = links or mesh.links
    dims = _split_dims(strategy)
    shards = math.prod(mesh.shape[d] for d, _ in dims)
    rows = lookup.touched_rows(shards, dims[0][1])
    total = 0.0
    for d, _ in sorted(dims, reverse=True):
        n = mesh.shape[d]
        total += all_gather_s(n * rows * (lookup.row_bytes + INDEX_BYTES), n, links[d])
        rows *= n
    return total


def exchange_bytes(lookup: Lookup, devices: int) -> dict[str, float]:
    """Bytes one device receives per step for the table over ``devices`` data-parallel devices,
    by method — the cost model's own collectives on a link of 1 byte/s without latency, so
    these are its volumes (the closed forms of the module docstring). Row-wise sharding moves
    lookups instead of gradients: the indices are gathered, the lookup results reduced to
    their batch shard and their gradients gathered back."""
    flat = MeshSpec((devices,), ("dp",), (UNIT_LINK,))
    twin = Strategy(((pl.Shard(0),),), ((pl.R,), (pl.Shard(0),)), exchange=SPARSE_ALLGATHER)
    results = lookup.result_bytes
    return {"allreduce": all_reduce_s(lookup.table_bytes, devices, UNIT_LINK),
            SPARSE_ALLGATHER: sparse_exchange_s(lookup, twin, flat),
            **({TABLE_WISE: 2 * all_to_all_s(lookup.result_bytes, devices, UNIT_LINK)}
               if lookup.pooled_bytes is not None else {}),
            "row_sharded": (all_gather_s(lookup.lookups * INDEX_BYTES, devices, UNIT_LINK)
                            + reduce_scatter_s(results, devices, UNIT_LINK) + all_gather_s(results, devices, UNIT_LINK))}
