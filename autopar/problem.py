"""The sharding problem the solvers see: plain Python, no torch.fx inside.

Each graph node offers strategies, each with a compute cost and a per-device memory term.
Each edge couples a producer and a consumer through *placement classes*: the producer's
strategies map to the placement they output on that edge, the consumer's to the placement
(and work split) they expect, and ``cost[u][v]`` is the resharding time between classes
(``None`` = not allowed, e.g. turning a replicated tensor into a partial sum).

Repeated layers are folded before the solver sees them: one problem node stands for
``node_count[i]`` identical graph nodes and one edge for ``count`` identical graph edges, so
the objective and the memory row weigh each term by its multiplicity (Alpa's operator
clustering, exact because identical copies take identical placements).

>>> p = ShardingProblem(
...     node_names=["a", "b"], node_costs=[[1.0, 2.0], [1.0, 1.0]], node_memory=[[0, 0], [0, 0]],
...     edges=[Edge(0, 1, src_class=[0, 1], dst_class=[0, 1], cost=[[0.0, 5.0], [5.0, 0.0]])],
...     memory_limit_bytes=1)
>>> p.evaluate([0, 0]), p.evaluate([0, 1])
(2.0, 7.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    src_class: list[int]  # producer strategy -> class index u
    dst_class: list[int]  # consumer strategy -> class index v
    cost: list[list[float | None]]  # [u][v] seconds, None = forbidden
    count: int = 1  # identical graph edges this edge stands for
    # (u, v) -> bytes one device sends for that reshard (for reports; the solver never reads it)
    volume: Callable[[int, int], float] | None = field(default=None, compare=False, repr=False)
    # (u, v) -> seconds of that reshard even where ``cost`` forbids the pair (a "follow" edge keeps
    # the solver on its diagonal): what explaining an alternative with its neighbours fixed pays
    unrestricted: Callable[[int, int], float | None] | None = field(default=None, compare=False, repr=False)

    def members(self) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Strategies of the producer per class u, and of the consumer per class v."""
        src: dict[int, list[int]] = {}
        dst: dict[int, list[int]] = {}
        for s, u in enumerate(self.src_class):
            src.setdefault(u, []).append(s)
        for t, v in enumerate(self.dst_class):
            dst.setdefault(v, []).append(t)
        return src, dst

    def pair_bytes(self, s: int, t: int) -> float:
        return self.volume(self.src_class[s], self.dst_class[t]) if self.volume else 0.0

    def pair_cost(self, s: int, t: int) -> float:
        c = self.cost[self.src_class[s]][self.dst_class[t]]
        return math.inf if c is None else c

    def reshard_cost(self, s: int, t: int) -> float:
        """``pair_cost``, or where the solver's coarsening forbids the pair, what the reshard
        itself would take (inf only where no reshard exists)."""
        c = self.cost[self.src_class[s]][self.dst_class[t]]
        if c is None and self.unrestricted is not None:
            c = self.unrestricted(self.src_class[s], self.dst_class[t])
        return math.inf if c is None else c


@dataclass(frozen=True)
class ShardingProblem:
    node_names: list[str]
    node_costs: list[list[float]]  # seconds per strategy (compute + fixed communication)
    node_memory: list[list[int]]  # bytes per device per strategy
    edges: list[Edge]
    memory_limit_bytes: int
    fixed: dict[int, int] = field(default_factory=dict)  # node -> forced strategy
    # (node, strategy) pairs the solver may not choose (the dense baselines exclude sparse exchange)
    excluded: frozenset[tuple[int, int]] = frozenset()
    node_count: list[int] | None = None  # identical graph nodes per problem node (None: all 1)

    def count(self, i: int) -> int:
        return 1 if self.node_count is None else self.node_count[i]

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    def memory(self, choice: list[int]) -> int:
        return sum(self.count(i) * self.node_memory[i][s] for i, s in enumerate(choice))

    def compute(self, choice: list[int]) -> float:
        return sum(self.count(i) * self.node_costs[i][s] for i, s in enumerate(choice))

    def evaluate(self, choice: list[int]) -> float:
        """Objective of a full assignment (``inf`` when an edge pair is forbidden)."""
        return self.compute(choice) + sum(e.count * e.pair_cost(choice[e.src], choice[e.dst]) for e in self.edges)

    def min_memory(self) -> int:
        """Memory of the least memory-hungry strategy of every node (a lower bound)."""
        return sum(self.count(i) * min(m) for i, m in enumerate(self.node_memory))

    def feasible(self, choice: list[int]) -> bool:
        return math.isfinite(self.evaluate(choice)) and self.memory(choice) <= self.memory_limit_bytes


@dataclass(frozen=True)
class Solution:
    choice: list[int]
    status: str  # OPTIMAL / FEASIBLE / INFEASIBLE / TIMEOUT
    objective_s: float
    bound_s: float
    solve_s: float
    num_variables: int
    num_constraints: int
    method: str = "cp-sat"  # what proved the status: "lp" (integral relaxation) or "cp-sat"
