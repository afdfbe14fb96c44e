r"""LP relaxation of the sharding ILP (GLOP): a proof of optimality when it comes out integral.

The rows of solvers/formulation.py (as CP-SAT gets them), with x and y relaxed to [0, 1];
the memory row is stated in GiB to keep its coefficients near the cost scale. The relaxation's
optimum is a lower bound on the ILP's; when its x is integral, y is too (rows and columns of
each edge's pair block then sum to one-hot vectors), the assignment is feasible, and it is
therefore optimal — no branch and bound needed. On transformer graphs folded by repeated-layer
clustering this is the common case: a Llama-3-8B shape on an 8×8 mesh (103 problem nodes,
16k pair variables) solves in ~0.2 s as an LP where CP-SAT needed 6–15 s to prove the same
optimum. When x is fractional the caller falls back to CP-SAT.

The model is built once per problem and re-solved for each set of fixed placements (the
baselines fix parameter and input placements of the same problem), warm-started by GLOP: the
fixed and excluded rows, each over one variable, are applied as bounds for one solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple
from itertools import chain

from ortools.linear_solver import linear_solver_pb2, pywraplp

from autopar.solvers.formulation import Formulation, Row, summed

_INTEGRAL = 1e-6  # x within this of 0 or 1 counts as integral


@dataclass(frozen=True)
class RelaxedSolution:
    status: str  # "INTEGRAL", "FRACTIONAL", "INFEASIBLE" or "UNKNOWN"
    bound_s: float  # the relaxation's optimum (a lower bound), when solved
    choice: list[int] | None  # the assignment, when integral
    leaning: list[int] | None  # per node, the strategy with the largest x (a hint)


class _FirstStage(NamedTuple):
    """A solve for time alone: GLOP's status code, x's values (when optimal), the bound, and
    when integral the variables in no time-optimal solution (:meth:`LpRelaxation._nonoptimal`;
    None when fractional)."""
    code: int
    values: list[list[float]] | None
    bound: float
    nonoptimal: list | None


class LpRelaxation:
    """The relaxation of one problem (its ``fixed`` placements are ignored here: pass them
    to :meth:`solve`)."""

    def __init__(self, formulation: Formulation) -> None:
        self.formulation = formulation
        self.solver = pywraplp.Solver.CreateSolver("GLOP")
        # the model goes in as one proto, each row's terms summed per variable (formulation.summed):
        # an 8×8 Llama-8B problem (40k variables, 7k rows) loads in 0.14-0.24 s, 0.24 s set term
        # by term
        model = linear_solver_pb2.MPModelProto()
        bounded = formulation.num_binary
        for v in range(formulation.num_variables):  # z (overlap, seconds) and h (bytes) are unbounded
            model.variable.add(lower_bound=0.0, upper_bound=1.0 if v < bounded else math.inf)
        for row in chain(formulation.one_strategy(), formulation.edge_consistency()):
            _add_row(model, row)
        memory_terms = [_add_row(model, row) for row in formulation.memory()]
        for row in chain(formulation.held(), formulation.overlap()):
            _add_row(model, row)
        status = self.solver.LoadModelFromProtoKeepNames(model)
        if status:
            raise RuntimeError(f"GLOP refused the relaxation's model: {status}")
        variables = self.solver.variables()
        self._x_flat = variables[:formulation.num_x]  # x come first
        self._binary = variables[:formulation.num_binary]
        self.memory_terms = [(variables[v], c) for terms in memory_terms for v, c in terms.items()]
        coefficients = [0.0] * formulation.num_variables
        for v, c in zip(formulation.objective_vars, formulation.objective_coeffs):
            coefficients[v] += c  # a folded edge's cost adds to its x's
        self.time_terms = [(var, c) for var, c in zip(variables, coefficients) if c]
        self.objective = self.solver.Objective()
        self._set_objective(self.time_terms)
        self.time_row = None  # created on first use by _least_memory
        # (fixed, excluded) -> that first-stage solve: lower_bound() and the baselines' pinned
        # solves come before the search's own solve of the mesh, which then re-solves nothing
        self._solved: dict[tuple, _FirstStage] = {}

    @property
    def size(self) -> tuple[int, int]:
        return self.solver.NumVariables(), self.solver.NumConstraints()

    def solve(self, fixed: dict[int, int], time_limit_s: float, least_memory: bool = True,
              excluded: frozenset[tuple[int, int]] = frozenset()) -> RelaxedSolution:
        """``least_memory``: when integral, break ties in time by memory (a second LP).
        ``excluded``: (node, strategy) pairs held at 0."""
        rows = chain(self.formulation.fixed(fixed), self.formulation.excluded(excluded))
        bounds = [(self._x_flat[v], row.lo, row.hi) for row in rows for v in row.vars]
        for var, lo, hi in bounds:  # rows over one variable, coefficient 1
            var.SetBounds(max(var.lb(), lo), min(var.ub(), hi))
        key = (tuple(sorted(fixed.items())), tuple(sorted(excluded)))
        if key not in self._solved:
            self._solved[key] = self._first_stage(time_limit_s)
        code, values, bound, nonoptimal = self._solved[key]
        integral = nonoptimal is not None
        if integral and least_memory:
            values = self._least_memory(bound, nonoptimal, time_limit_s, values)
        for var, _lo, _hi in bounds:  # only after reading the solution: a change discards it
            var.SetBounds(0.0, 1.0)
        if code == pywraplp.Solver.INFEASIBLE:
            return RelaxedSolution("INFEASIBLE", float("inf"), None, None)
        if code != pywraplp.Solver.OPTIMAL:
            return RelaxedSolution("UNKNOWN", float("-inf"), None, None)
        leaning = [max(range(len(row)), key=row.__getitem__) for row in values]
        return RelaxedSolution("INTEGRAL" if integral else "FRACTIONAL", bound,
                               leaning if integral else None, leaning)

    def _first_stage(self, time_limit_s: float) -> "_FirstStage":
        """Solve for time as the bounds stand; when integral, also which variables no
        time-optimal solution uses, read now: the solver holds this solve's duals only until
        its next solve."""
        code, response = self._run(time_limit_s, dual=True)
        values = self._x_values(response)
        bound = self.objective.Value() if code == pywraplp.Solver.OPTIMAL else float("-inf")
        integral = values is not None and _integral(values)
        return _FirstStage(code, values, bound, self._nonoptimal(response) if integral else None)

    def _least_memory(self, time_s: float, nonoptimal: list, time_limit_s: float,
                      fastest: list[list[float]]) -> list[list[float]]:
        """Among the assignments as fast as ``time_s``, one that needs the least memory (e.g. a
        batch-sharded input rather than a replicated one that is sliced for free); when the
        second LP is not integral, its rounding if that is such an assignment needing less than
        ``fastest`` (:meth:`_rounded`), else ``fastest``. ``nonoptimal``: variables that are in no time-optimal
        solution (:meth:`_nonoptimal`), held at 0 so the second LP searches only the optimal
        face (T5, 567 nodes: 5–6 s → well under 1 s per baseline)."""
        if self.time_row is None:
            self.time_row = self.solver.Constraint(-self.solver.infinity(), self.solver.infinity())
            for var, c in self.time_terms:
                self.time_row.SetCoefficient(var, c)
        self.time_row.SetUb(time_s * (1 + 1e-9) + 1e-15)
        for var in nonoptimal:
            var.SetUb(0.0)
        self._set_objective(self.memory_terms)
        _code, response = self._run(time_limit_s, dual=False)
        values = self._x_values(response)
        for var in nonoptimal:
            var.SetUb(1.0)
        self.time_row.SetUb(self.solver.infinity())
        self._set_objective(self.time_terms)
        if values is None:
            return fastest
        if _integral(values):
            return values
        return self._rounded(values, time_s, fastest)

    def _rounded(self, values: list[list[float]], time_s: float, fastest: list[list[float]]) -> list[list[float]]:
        """A fractional least-memory optimum's largest strategy per node, where that is an
        assignment as fast as ``time_s`` needing less memory than ``fastest`` (the first
        LP's integral optimum, one vertex among the time-optimal ones: which one depends on
        where the simplex started); else ``fastest``."""
        problem = self.formulation.problem
        leaning = [max(range(len(row)), key=row.__getitem__) for row in values]
        chosen = [max(range(len(row)), key=row.__getitem__) for row in fastest]
        if not problem.feasible(leaning) or problem.evaluate(leaning) > time_s * (1 + 1e-9) + 1e-15 \
                or problem.memory(leaning) >= problem.memory(chosen):
            return fastest
        return [[float(s == t) for s in range(len(row))] for row, t in zip(values, leaning)]

    def _nonoptimal(self, response: linear_solver_pb2.MPSolutionResponse) -> list:
        """Variables at 0 with a positive reduced cost in the optimum ``response`` holds: by
        complementary slackness no optimal solution uses them (a tie within the tolerance
        may be dropped too, which only narrows the tie-break)."""
        largest = max((abs(c) for _, c in self.time_terms), default=0.0)
        tolerance = 1e-9 * largest
        costs, values = list(response.reduced_cost), list(response.variable_value)
        return [var for v, var in enumerate(self._binary) if costs[v] > tolerance and values[v] < _INTEGRAL]

    def _run(self, time_limit_s: float, dual: bool) -> tuple[int, linear_solver_pb2.MPSolutionResponse | None]:
        """Solve as the model stands; the solution (values and reduced costs of every variable,
        read in one call: one by one they took 0.02-0.1 s per solve of an 8×8 Llama-8B mesh)
        when optimal. Dual simplex after bounds changed (fixed placements: the last basis
        stays dual feasible), primal after the objective changed (the tie-break: the last
        basis stays primal feasible) — measured on T5's baselines, the other way round took
        4–20× longer."""
        self.solver.SetSolverSpecificParametersAsString(f"use_dual_simplex: {'true' if dual else 'false'}")
        self.solver.SetTimeLimit(int(time_limit_s * 1000))
        code = self.solver.Solve()
        if code != pywraplp.Solver.OPTIMAL:
            return code, None
        response = linear_solver_pb2.MPSolutionResponse()
        self.solver.FillSolutionResponseProto(response)
        return code, response

    def _x_values(self, response: linear_solver_pb2.MPSolutionResponse | None) -> list[list[float]] | None:
        """x's values in ``response``, per node and strategy (None: no solution)."""
        if response is None:
            return None
        flat = list(response.variable_value)
        return [[flat[v] for v in row] for row in self.formulation.x]

    def _set_objective(self, terms) -> None:
        self.objective.Clear()
        for var, c in terms:
            self.objective.SetCoefficient(var, c)
        self.objective.SetMinimization()


def _add_row(model: linear_solver_pb2.MPModelProto, row: Row) -> dict[int, float]:
    """Add ``row`` to ``model`` in its unit; its terms (formulation.summed)."""
    terms = summed(row.vars, [c / row.unit for c in row.coeffs])
    constraint = model.constraint.add(lower_bound=row.lo / row.unit, upper_bound=row.hi / row.unit, name=row.name)
    constraint.var_index.extend(terms)
    constraint.coefficient.extend(terms.values())
    return terms


def _integral(values: list[list[float]]) -> bool:
    return all(v < _INTEGRAL or v > 1.0 - _INTEGRAL for row in values for v in row)
