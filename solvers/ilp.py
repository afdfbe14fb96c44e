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
    min Σ_i n_i Σ_s c[i,s]·x[i,s] + Σ_e n_e Σ_{u,v} R[e,u,v]·y[e,u,v]
    (n_i, n_e: how many identical graph nodes / edges of repeated layers the term stands for;
    the memory row is weighted the same way)

Rows and columns of y sum to one-hot vectors, so y is the outer product of the two
choices (the transportation polytope of two one-hot vectors has only that integer point).
An edge whose producer (or consumer) side has a single class needs no y: its cost is
folded into the other side's x. CP-SAT runs with one worker and ``linearization_level=2``
(deterministic, and it proves optimality fast without a second worker), without presolve
probing or symmetry detection (slow on these problems, no help).

Before CP-SAT, the LP relaxation (solvers/relaxation.py) is solved; when it is integral its
answer is optimal and CP-SAT is skipped. Otherwise its leaning assignment is CP-SAT's hint
(unless the caller gave one, e.g. the best baseline).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict

from ortools.sat.python import cp_model

from autopar.problem import ShardingProblem, Solution
from autopar.solvers.relaxation import LpRelaxation

log = logging.getLogger(__name__)

_SCALE_TARGET = 1e8  # the largest single cost term becomes this many integer units


def _solve_interruptibly(solver: cp_model.CpSolver, model: cp_model.CpModel):
    """Search in a worker thread so that Ctrl-C reaches Python at once (the main thread is not
    stuck inside the C++ search): the search is stopped and KeyboardInterrupt raised, so
    nothing is made of an interrupted solve. CP-SAT's own SIGINT handler is off, or it would
    end the search quietly and a half-searched plan would look like a finished one."""
    solver.parameters.catch_sigint_signal = False
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("code", solver.solve(model)), daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    except KeyboardInterrupt:
        solver.stop_search()
        worker.join()
        raise
    return result["code"]


class CpSatSolver:
    """Exact solver; ``time_limit_s`` bounds the search and yields FEASIBLE/TIMEOUT."""

    name = "cpsat"

    def __init__(self, time_limit_s: float = 60.0, seed: int = 0, relaxation_first: bool = True) -> None:
        self.time_limit_s = time_limit_s
        self.seed = seed
        self.relaxation_first = relaxation_first
        self._relaxations: dict[tuple, LpRelaxation] = {}

    def solve(self, problem: ShardingProblem, hint: list[int] | None = None) -> Solution:
        start = time.perf_counter()
        if self.relaxation_first:
            relaxation = self._relaxation_of(problem)
            relaxed = relaxation.solve(problem.fixed, self.time_limit_s, excluded=problem.excluded)
            if relaxed.status == "INTEGRAL" and problem.feasible(relaxed.choice):
                objective = problem.evaluate(relaxed.choice)
                elapsed = time.perf_counter() - start
                log.info("lp relaxation integral: optimal in %.2fs", elapsed)
                return Solution(relaxed.choice, "OPTIMAL", objective, min(relaxed.bound_s, objective), elapsed,
                                *relaxation.size, method="lp")
            if hint is None:
                hint = relaxed.leaning
        return self._cp_sat(problem, hint, start)

    def lower_bound(self, problem: ShardingProblem) -> float:
        """Optimum of the LP relaxation (``inf`` when even that is infeasible)."""
        if problem.min_memory() > problem.memory_limit_bytes:
            return math.inf
        relaxed = self._relaxation_of(problem).solve(problem.fixed, self.time_limit_s, least_memory=False,
                                                     excluded=problem.excluded)
        return relaxed.bound_s

    def _relaxation_of(self, problem: ShardingProblem) -> LpRelaxation:
        """Built once per problem; baselines (the same problem with other ``fixed``) reuse it."""
        key = (id(problem.edges), id(problem.node_costs), id(problem.node_memory), problem.memory_limit_bytes)
        if key not in self._relaxations:  # the cached relaxation holds the problem: ids stay unique
            self._relaxations[key] = LpRelaxation(problem)
        return self._relaxations[key]

    def _cp_sat(self, problem: ShardingProblem, hint: list[int] | None, start: float) -> Solution:
        model = cp_model.CpModel()
        x = self._one_strategy(model, problem)
        terms: list[tuple[cp_model.IntVar, float]] = [
            (x[i][s], problem.count(i) * c)
            for i, costs in enumerate(problem.node_costs) for s, c in enumerate(costs) if c]
        terms += self._edges(model, problem, x)
        self._memory(model, problem, x)
        for i, s in problem.fixed.items():
            model.add(x[i][s] == 1)
        for i, s in problem.excluded:
            model.add(x[i][s] == 0)
        largest = max((c for _, c in terms), default=0.0)
        scale = _SCALE_TARGET / largest if largest > 0 else 1.0
        model.minimize(sum(round(c * scale) * var for var, c in terms))
        if hint is not None:
            for i, s in enumerate(hint):
                for t, var in enumerate(x[i]):
                    model.add_hint(var, t == s)

        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = self.time_limit_s
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        # presolve probing and symmetry detection took 70% of the time on folded transformer
        # problems (Llama-8B shape, 8×8 mesh, fixed TP×DP leaves: 10.2 s → 3.1 s, same optimum)
        solver.parameters.cp_model_probing_level = 0
        solver.parameters.symmetry_level = 0
        solver.parameters.random_seed = self.seed
        code = _solve_interruptibly(solver, model)
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
        x: list[list[cp_model.IntVar]] = []
        for i, name in enumerate(problem.node_names):
            row = [model.new_bool_var(f"x[{name},{s}]") for s in range(len(problem.node_costs[i]))]
            model.add_exactly_one(row).with_name(f"one_strategy[{name}]")
            x.append(row)
        return x

    @staticmethod
    def _edges(model: cp_model.CpModel, problem: ShardingProblem,
               x: list[list[cp_model.IntVar]]) -> list[tuple[cp_model.IntVar, float]]:
        terms: list[tuple[cp_model.IntVar, float]] = []
        for k, e in enumerate(problem.edges):
            src_members, dst_members = e.members()
            if len(src_members) == 1 or len(dst_members) == 1:
                terms += _fold_edge(model, e, x, src_members, dst_members)
                continue
            rows: dict[int, list[cp_model.IntVar]] = defaultdict(list)
            cols: dict[int, list[cp_model.IntVar]] = defaultdict(list)
            for u in src_members:
                for v in dst_members:
                    cost = e.cost[u][v]
                    if cost is None:
                        continue
                    y = model.new_bool_var(f"y[{k},{u},{v}]")
                    rows[u].append(y)
                    cols[v].append(y)
                    if cost:
                        terms.append((y, e.count * cost))
            for u, members in src_members.items():
                model.add(sum(rows[u]) == sum(x[e.src][s] for s in members)).with_name(f"edge_rows[{k},{u}]")
            for v, members in dst_members.items():
                model.add(sum(cols[v]) == sum(x[e.dst][t] for t in members)).with_name(f"edge_cols[{k},{v}]")
        return terms

    @staticmethod
    def _memory(model: cp_model.CpModel, problem: ShardingProblem, x: list[list[cp_model.IntVar]]) -> None:
        expr = [problem.count(i) * m * x[i][s]
                for i, mems in enumerate(problem.node_memory) for s, m in enumerate(mems) if m]
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
                    terms.append((x[e.dst][t], e.count * cost))
    else:
        (v,) = dst_members
        for u, members in src_members.items():
            for s in members:
                cost = e.cost[u][v]
                if cost is None:
                    model.add(x[e.src][s] == 0)
                elif cost:
                    terms.append((x[e.src][s], e.count * cost))
    return terms
