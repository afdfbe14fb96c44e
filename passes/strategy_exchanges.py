"""The communication strategies make themselves, apart from the edges' resharding: a
lookup's sparse exchange, an expert dispatch, attention's gathered keys and values (context
parallelism) — per strategy while the problem is built, and for a chosen plan (bytes sent,
the table-wise owners' real spread)."""

from __future__ import annotations

import dataclasses
import math

import torch

from autopar import placements as pl
from autopar.comm import all_to_all_s
from autopar.devices import DeviceSpec
from autopar.mesh import MeshSpec
from autopar.problem import ShardingProblem
from autopar.passes.capture import Captured
from autopar.passes.context_parallel import kv_exchange_s
from autopar.passes.cost import FUSED_ATTENTION, tensor_bytes
from autopar.passes.expert_dispatch import DISPATCH_KEY, EXPERT_DISPATCH, dispatch_s
from autopar.passes.node_memory import OPTIMIZER_STATES
from autopar.passes.sparse import LOOKUP_KEY, TABLE_WISE, sparse_exchange_s, table_owners
from autopar.passes.strategies import Strategy


def exchange_s(node: torch.fx.Node, strategy: Strategy, mesh: MeshSpec, device: DeviceSpec | None) -> float:
    """Communication a strategy makes itself: a lookup's sparse exchange, an expert dispatch,
    attention's gathered keys and values (context parallelism)."""
    if node.target is FUSED_ATTENTION:
        return kv_exchange_s(node, strategy, mesh)
    if strategy.exchange == EXPERT_DISPATCH:
        return dispatch_s(node, strategy, mesh, device)
    return sparse_exchange_s(node.meta[LOOKUP_KEY], strategy, mesh) if strategy.exchange else 0.0


def strategy_exchange_s(captured: Captured, problem: ShardingProblem, index, choice: list[int],
                        mesh: MeshSpec) -> float:
    """Time of the exchanges the chosen strategies make themselves — lookups' sparse rows,
    experts' dispatched rows, attention's gathered keys and values — every copy of a repeated node counted (on :func:`unit_links`
    meshes: the bytes one device sends)."""
    lookups = {n.name: n.meta[LOOKUP_KEY] for n in captured.graph.nodes if LOOKUP_KEY in n.meta}
    dispatches = {n.name: n for n in captured.graph.nodes if DISPATCH_KEY in n.meta}
    attentions = {n.name: n for n in captured.graph.nodes if n.target is FUSED_ATTENTION}
    total = 0.0
    for q, name in enumerate(index.names):
        strategy = index.strategies[q][choice[q]]
        if name in attentions:
            total += problem.count(q) * kv_exchange_s(attentions[name], strategy, mesh)
        elif strategy.exchange and name in lookups:
            total += problem.count(q) * sparse_exchange_s(lookups[name], strategy, mesh)
        elif strategy.exchange and name in dispatches:
            total += problem.count(q) * dispatch_s(dispatches[name], strategy, mesh, None)
    return total


def _table_wise_members(captured: Captured, index, choice: list[int], mesh: MeshSpec
                        ) -> dict[int, list[tuple[str, int, int, int]]]:
    """Per mesh dim placed ``O``: (FQN — as the plan names owners —, pooled bytes, table bytes,
    devices of the other mesh dims the pooled bags are split over) of the tables the choice
    places table-wise."""
    by_dim: dict[int, list[tuple[str, int, int, int]]] = {}
    for node in captured.graph.nodes:
        q = index.node_of.get(node.name)
        if q is None or LOOKUP_KEY not in node.meta:
            continue
        strategy = index.strategies[q][choice[q]]
        if strategy.exchange == TABLE_WISE:
            table, dim = node.args[0], pl.owned_dim(strategy.inputs[0])
            others = math.prod(size for k, (p, size) in enumerate(zip(strategy.outputs[0], mesh.shape))
                               if k != dim and p.is_shard)
            by_dim.setdefault(dim, []).append((captured.parameter_of[table.name], node.meta[LOOKUP_KEY].result_bytes,
                                               tensor_bytes(table.meta["val"]), others))
    return by_dim


def table_wise_by_owners(captured: Captured, index, choice: list[int], mesh: MeshSpec,
                         optimizer: str = "adamw") -> tuple[int, float]:
    """What the problem's even spread of table-wise tables over their owners (1/n of each table
    on every device of its dim, passes.sparse.table_wise_s's exchange) leaves out, with the
    owners :func:`passes.sparse.table_owners` picks for this choice, per mesh dim: the bytes
    the busiest owner holds beyond the even shares (its tables, gradients and optimizer
    states), and the time the fused all-to-all, forward and backward, waits for the owner
    sending the most pooled bags — (n−1)/n of them, against (n−1)/n of the mean owner's."""
    copies = 2 + OPTIMIZER_STATES[optimizer]
    excess, extra_s = 0, 0.0
    for dim, members in _table_wise_members(captured, index, choice, mesh).items():
        n = mesh.shape[dim]
        owners = table_owners([m[:3] for m in members], n)
        held = [sum(copies * nbytes for name, _, nbytes, _ in members if owners[name] == k) for k in range(n)]
        excess += max(held) - sum(copies * nbytes // n for _, _, nbytes, _ in members)
        sent = [sum(pooled / others for name, pooled, _, others in members if owners[name] == k) for k in range(n)]
        volume = n * (max(sent) - sum(sent) / n)  # all_to_all_s of n·x bytes: (n−1)/n · x per device
        extra_s += 2 * all_to_all_s(volume, n, dataclasses.replace(mesh.links[dim], latency_s=0.0))
    return max(excess, 0), extra_s
