r"""Sharding ILP on OR-Tools CP-SAT (Alpa's intra-operator formulation over placement classes).

Variables
    x[i,s] ∈ {0,1}          node i uses strategy s
    y[e,u,v] ∈ {0,1}        edge e carries producer class u into consumer class v
                            (only for allowed pairs; classes group strategies that give
                            the same placement on that edge, so y is small)
Constraints
    one_strategy:   Σ_s x[i,s] = 1                                    ∀ i
    edge_rows:      Σ_v y[e,u,v] = Σ_{s ∈ u} x[src(e),s]              ∀ e, u
    edge_cols:      Σ_u y[e,u,v] = Σ_{t ∈ v} x[dst(e),t]              ∀ e, v
    memory:         Σ_i Σ_s m[i,s]·x[i,s] ≤ M                          (bytes per device)
Objective (seconds of one training step, scaled to integers)
    min Σ_i Σ_s c[i,s]·x[i,s] + Σ_e Σ_{u,v} R[e,u,v]·y[e,u,v]

Rows and columns of y sum to one-hot vectors, so y is the outer product of the two
choices (the transportation polytope of two one-hot vectors has only that integer point).
An edge whose producer (or consumer) side has a single class needs no y: its cost is
folded into the other side's x. CP-SAT runs with one worker and ``linearization_level=2``
(deterministic, and it proves optimality fast without a second worker).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

from ortools.sat.python import cp_model

from autopar.problem import ShardingProblem, Solution

log = logging.getLogger(__name__)

_SCALE_TARGET = 1e8  # the largest single cost term becomes this many integer units


class CpSatSolver:
    """Exact solver; ``time_limit_s`` bounds the search and yields FEASIBLE/TIMEOUT."""

    name = "cpsat"

    def __init__(self, time_limit_s: float = 60.0, seed: int = 0) -> None:
        self.time_limit_s = time_limit_s
        self.seed = seed

    def solve(self, problem: ShardingProblem, hint: list[int] | None = None) -> Solution:
        start = time.perf_counter()
        model = cp_model.CpModel()
        x = self._one_strategy(model, problem)
        terms: list[tuple[cp_model.IntVar, float]] = [
            (x[i][s], c) for i, costs in enumerate(problem.node_costs) for s, c in enumerate(costs) if c]
        terms += self._edges(model, problem, x)
        self._memory(model, problem, x)
        for i, s in problem.fixed.items():
            model.add(x[i][s] == 1)
        largest = max((c for _, c in terms), default=0.0)
        scale = _SCALE_TARGET / largest if largest > 0 else 1.0
        model.minimize(sum(round(c * scale) * var for var, c in terms))
        if hint is not None:
            for i, s in enumerate(hint):
                if problem.representative(i) == i:  # copies share their representative's variables
                    for t, var in enumerate(x[i]):
                        model.add_hint(var, t == s)

        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = self.time_limit_s
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        solver.parameters.random_seed = self.seed
        code = solver.solve(model)
        elapsed = time.perf_counter() - start
        stats = model.proto
        n_vars, n_cons = len(stats.variables), len(stats.constraints)
        log.info("cp-sat: %d variables, %d constraints, status %s in %.2fs",
                 n_vars, n_cons, solver.status_name(code), elapsed)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            status = "INFEASIBLE" if code == cp_model.INFEASIBLE else "TIMEOUT"
            return Solution([], status, math.inf, math.inf, elapsed, n_vars, n_cons)
        choice = [next(s for s, var in enumerate(row) if solver.value(var)) for row in x]
        status = "OPTIMAL" if code == cp_model.OPTIMAL else "FEASIBLE"
        return Solution(choice, status, problem.evaluate(choice), solver.best_objective_bound / scale,
                        elapsed, n_vars, n_cons)

    @staticmethod
    def _one_strategy(model: cp_model.CpModel, problem: ShardingProblem) -> list[list[cp_model.IntVar]]:
        """x[i] rows; a node of a repeated layer reuses its representative's row."""
        x: list[list[cp_model.IntVar]] = []
        for i, name in enumerate(problem.node_names):
            rep = problem.representative(i)
            if rep != i:
                assert rep < i and len(problem.node_costs[rep]) == len(problem.node_costs[i]), (name, rep)
                x.append(x[rep])
                continue
            row = [model.new_bool_var(f"x[{name},{s}]") for s in range(len(problem.node_costs[i]))]
            model.add_exactly_one(row).with_name(f"one_strategy[{name}]")
            x.append(row)
        return x

    @staticmethod
    def _edges(model: cp_model.CpModel, problem: ShardingProblem,
               x: list[list[cp_model.IntVar]]) -> list[tuple[cp_model.IntVar, float]]:
        terms: list[tuple[cp_model.IntVar, float]] = []
        shared: dict[tuple, dict[tuple[int, int], cp_model.IntVar]] = {}  # repeated-layer edges
        for k, e in enumerate(problem.edges):
            key = (problem.representative(e.src), problem.representative(e.dst), tuple(e.src_class), tuple(e.dst_class))
            if key in shared and shared[key] is not None:  # same pair variables as an earlier copy
                for (u, v), y in shared[key].items():
                    if e.cost[u][v] is None:
                        model.add(y == 0)
                    elif e.cost[u][v]:
                        terms.append((y, e.cost[u][v]))
                continue
            src_members: dict[int, list[int]] = defaultdict(list)
            dst_members: dict[int, list[int]] = defaultdict(list)
            for s, u in enumerate(e.src_class):
                src_members[u].append(s)
            for t, v in enumerate(e.dst_class):
                dst_members[v].append(t)
            if len(src_members) == 1 or len(dst_members) == 1:
                terms += _fold_edge(model, e, x, src_members, dst_members)
                shared[key] = None
                continue
            rows: dict[int, list[cp_model.IntVar]] = defaultdict(list)
            cols: dict[int, list[cp_model.IntVar]] = defaultdict(list)
            shared[key] = pairs = {}
            for u in src_members:
                for v in dst_members:
                    cost = e.cost[u][v]
                    if cost is None:
                        continue
                    y = model.new_bool_var(f"y[{k},{u},{v}]")
                    pairs[(u, v)] = y
                    rows[u].append(y)
                    cols[v].append(y)
                    if cost:
                        terms.append((y, cost))
            for u, members in src_members.items():
                model.add(sum(rows[u]) == sum(x[e.src][s] for s in members)).with_name(f"edge_rows[{k},{u}]")
            for v, members in dst_members.items():
                model.add(sum(cols[v]) == sum(x[e.dst][t] for t in members)).with_name(f"edge_cols[{k},{v}]")
        return terms

    @staticmethod
    def _memory(model: cp_model.CpModel, problem: ShardingProblem, x: list[list[cp_model.IntVar]]) -> None:
        expr = [m * x[i][s] for i, mems in enumerate(problem.node_memory) for s, m in enumerate(mems) if m]
        if expr:
            model.add(sum(expr) <= problem.memory_limit_bytes).with_name("memory")


def _fold_edge(model, e, x, src_members, dst_members) -> list:
    """Edge with one class on a side: its cost is a linear term of the other side's choice."""
    terms = []
    if len(src_members) == 1:
        (u,) = src_members
        for v, members in dst_members.items():
            for t in members:
                cost = e.cost[u][v]
                if cost is None:
                    model.add(x[e.dst][t] == 0)
                elif cost:
                    terms.append((x[e.dst][t], cost))
    else:
        (v,) = dst_members
        for u, members in src_members.items():
            for s in members:
                cost = e.cost[u][v]
                if cost is None:
                    model.add(x[e.src][s] == 0)
                elif cost:
                    terms.append((x[e.src][s], cost))
    return terms
