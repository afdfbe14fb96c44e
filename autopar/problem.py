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
    # overlap group whose compute hides this edge's communication (-1: on the critical path).
    # Only a parameter's edges are overlappable: its gathers can be prefetched and its gradient
    # reduced while the layer's backward runs, as FSDP2 and DDP do
    group: int = -1
    # [u][v] (forward gathers s, backward re-gathers s, gradient reduction s, the reduction's
    # collective kind): the parts of ``cost`` that can run beside compute (passes.reshard_cost.Parts;
    # the rest is on the critical path)
    parts: list[list[tuple[float, float, float, str] | None]] | None = field(default=None, compare=False, repr=False)
    # [u][v] bytes one device holds of the gathered copy while ``layer`` runs (a sharded weight
    # gathered for use: FSDP's unsharded parameter), 0 where the pair gathers nothing; None:
    # the edge gathers no weight. ``layer``: the run of ops whose gathered weights are alive
    # together (a layer; the weights outside every layer before the first and after the last)
    held: list[list[int | None]] | None = field(default=None, compare=False, repr=False)
    layer: int = -1

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
    # Overlap (issue 20): nodes and edges in one overlap group (a layer) share a compute and a
    # communication stream. A collective of kind k runs the fraction η_k of its time beside
    # compute and stalls compute for the rest, so a group's phase takes
    #     max(C, Σ_k η_k·O_k) + Σ_k (1 − η_k)·O_k  =  C + Σ_k O_k − min(C, Σ_k η_k·O_k)
    # (η_k < 0: overlapping it slows both streams, as gloo's thread taking a core does), except
    # one copy of the first layer's (``exposed_group``), which nothing runs beside.
    node_group: list[int] | None = None  # per node, its group (-1: none)
    node_comm: list[list[float]] | None = None  # per node and strategy, the part of its cost that is
    # communication it makes itself (an expert dispatch, a sparse exchange): exposed, not compute
    node_forward: list[list[float]] | None = None  # per node and strategy, its forward compute (the
    # rest of its compute is backward); None: all of it in one phase
    overlap_efficiency: float = 0.0  # η of every collective kind not in ``collective_overlap``
    collective_overlap: tuple[tuple[str, float], ...] = ()  # (kind, η): all_gather, reduce_scatter, all_reduce
    # weight gathers issued ahead of their layer (FSDP2's prefetch): the forward share of a
    # parameter's communication hides behind compute; False: it is exposed (gathered when read)
    prefetch: bool = True
    # the group of the first layer the graph runs: one copy of its communication no compute
    # hides — its weights are gathered before any layer computes, and its gradients reduced
    # after the last backward computes (with the last layer's first re-gather, as large)
    exposed_group: int = -1
    # the layers (``Edge.layer``) whose gathered weights one device holds at once: each the
    # running layer and those prefetched after it (FSDP2: 1 + its prefetch depth, in forward and
    # in backward), a repeated layer named once per copy in it
    held_windows: tuple[tuple[int, ...], ...] = ()

    def eta(self, kind: str) -> float:
        """The overlap efficiency of collectives of ``kind``."""
        return dict(self.collective_overlap).get(kind, self.overlap_efficiency)

    @property
    def overlaps(self) -> bool:
        """Whether any collective kind overlaps (else no group is built)."""
        return any_overlap(self.overlap_efficiency, self.collective_overlap)

    def weighted_parts(self, e: Edge, u: int, v: int) -> tuple[float, float, float, float]:
        """Edge ``e``'s class pair (u, v), once: (forward overlappable s, backward overlappable
        s, and each weighted by its collectives' η). Forward is the prefetched gathers (none
        without ``prefetch``), backward the re-gathers (prefetched likewise) and the gradient's
        reduction."""
        part = e.parts[u][v] if e.parts else None
        if part is None:
            return 0.0, 0.0, 0.0, 0.0
        forward, regather, reduction, kind = part
        if not self.prefetch:
            forward = regather = 0.0
        gather = self.eta("all_gather")
        return forward, regather + reduction, gather * forward, gather * regather + self.eta(kind) * reduction

    def count(self, i: int) -> int:
        return 1 if self.node_count is None else self.node_count[i]

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    def memory(self, choice: list[int]) -> int:
        """Bytes per device: every node's, and the gathered weights held at once (:meth:`held_bytes`)."""
        return sum(self.count(i) * self.node_memory[i][s] for i, s in enumerate(choice)) + self.held_bytes(choice)

    def layer_held(self, choice: list[int]) -> dict[int, int]:
        """Per layer (``Edge.layer``), the bytes of its weights gathered for use under
        ``choice``: one copy of a repeated layer (its copies run one after another)."""
        held: dict[int, int] = {}
        for e in self.edges:
            if e.held is not None and e.layer >= 0:
                held[e.layer] = held.get(e.layer, 0) + (e.held[e.src_class[choice[e.src]]][e.dst_class[choice[e.dst]]]
                                                        or 0)
        return held

    def held_bytes(self, choice: list[int]) -> int:
        """The gathered weights one device holds at the peak: the most of any window of
        ``held_windows`` (FSDP2 holds the running layer's unsharded weights and the prefetched
        ones)."""
        held = self.layer_held(choice)
        return max((sum(held.get(g, 0) for g in window) for window in self.held_windows), default=0)

    def compute(self, choice: list[int]) -> float:
        return sum(self.count(i) * self.node_costs[i][s] for i, s in enumerate(choice))

    def own_comm(self, choice: list[int]) -> float:
        """The communication inside node costs (exchanges strategies make themselves)."""
        if self.node_comm is None:
            return 0.0
        return sum(self.count(i) * self.node_comm[i][s] for i, s in enumerate(choice))

    def edge_comm(self, choice: list[int]) -> float:
        """The resharding every edge pays under ``choice`` (``inf`` where a pair is forbidden)."""
        return sum(e.count * e.pair_cost(choice[e.src], choice[e.dst]) for e in self.edges)

    def evaluate(self, choice: list[int]) -> float:
        """Objective of a full assignment (``inf`` when an edge pair is forbidden): every cost
        summed, less what overlap hides (:meth:`hidden_comm`)."""
        total = self.compute(choice) + self.edge_comm(choice)
        if not self.overlaps or total == math.inf:
            return total
        return total - self.hidden_comm(choice)

    def group_times(self, choice: list[int]) -> dict[tuple[int, str], tuple[float, float, float]]:
        """Per overlap group and phase ("forward", "backward"): (its compute C, its overlappable
        communication O, and O weighted by each collective's η), every copy counted."""
        groups = {g for g in self.node_group or () if g >= 0} | {e.group for e in self.edges if e.group >= 0}
        comm = {(g, phase): [0.0, 0.0] for g in groups for phase in ("forward", "backward")}
        for e in self.edges:
            if e.group >= 0:
                forward, backward, weighted_forward, weighted_backward = self.weighted_parts(
                    e, e.src_class[choice[e.src]], e.dst_class[choice[e.dst]])
                for phase, raw, weighted in (("forward", forward, weighted_forward),
                                             ("backward", backward, weighted_backward)):
                    comm[(e.group, phase)][0] += e.count * raw
                    comm[(e.group, phase)][1] += e.count * weighted
        compute = dict.fromkeys(comm, 0.0)
        for i, s in enumerate(choice):
            g = -1 if self.node_group is None else self.node_group[i]
            if (g, "forward") in compute:
                own = 0.0 if self.node_comm is None else self.node_comm[i][s]
                forward = 0.0 if self.node_forward is None else self.node_forward[i][s]
                compute[(g, "forward")] += self.count(i) * forward
                compute[(g, "backward")] += self.count(i) * (self.node_costs[i][s] - own - forward)
        return {key: (compute[key], *comm[key]) for key in comm}

    def hidden_comm(self, choice: list[int]) -> float:
        """Communication overlap hides: min(C, Σ_k η_k·O_k) per group and phase (negative where
        overlapping costs more than it hides), all but one copy's in the exposed group."""
        return sum(self.hidden_share(g) * _least(c, w) for (g, _), (c, _, w) in self.group_times(choice).items())

    def hidden_share(self, g: int) -> float:
        """The share of group ``g``'s copies whose communication overlap may hide: (n − 1)/n
        for the n copies of :attr:`exposed_group`, else all of them."""
        if g != self.exposed_group:
            return 1.0
        copies = self.group_copies(g)
        return (copies - 1) / copies

    def group_copies(self, g: int) -> int:
        """How many identical copies overlap group ``g`` stands for (a repeated layer's; 1 else)."""
        return max((self.count(i) for i, h in enumerate(self.node_group or ()) if h == g), default=1)

    def min_memory(self) -> int:
        """Memory of the least memory-hungry strategy of every node the problem leaves free (a
        fixed node at its strategy, excluded strategies left out): a lower bound of any
        solution's memory, so a problem whose bound exceeds the limit is infeasible without
        a search (a hand-written baseline replicating weights that cannot fit, say)."""
        total = 0
        for i, options in enumerate(self.node_memory):
            if i in self.fixed:
                least = options[self.fixed[i]]
            else:
                least = min((m for s, m in enumerate(options) if (i, s) not in self.excluded), default=min(options))
            total += self.count(i) * least
        return total

    def feasible(self, choice: list[int]) -> bool:
        return math.isfinite(self.evaluate(choice)) and self.memory(choice) <= self.memory_limit_bytes


def any_overlap(efficiency: float, by_kind: tuple[tuple[str, float], ...]) -> bool:
    """Whether a device with these overlap efficiencies overlaps any collective kind at all."""
    return bool(efficiency) or any(eta for _, eta in by_kind)


def _least(a, b):
    """min(a, b), also of sympy expressions (a symbolic plan's times): (a + b − |a − b|) / 2."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return min(a, b)
    return (a + b - abs(a - b)) / 2


@dataclass(frozen=True)
class Solution:
    choice: list[int]
    status: str  # OPTIMAL / FEASIBLE / INFEASIBLE / TIMEOUT
    objective_s: float
    bound_s: float
    solve_s: float
    num_variables: int
    num_constraints: int
    # what proved the status: "lp" (integral relaxation), "cp-sat", or "memory" (least memory over the limit)
    method: str = "cp-sat"
