r"""The sharding ILP (solvers/formulation.py, where its math is written) on OR-Tools CP-SAT.

Every x and y is a 0/1 ``BoolVar``, every overlap z an integer in the objective's units (its
rows' coefficients in seconds are scaled like the objective), the held-weights peak h an
integer in bytes; one_strategy rows become ``add_exactly_one``, the other
rows linear constraints named after their family; the objective is scaled to integers (the
largest single term becomes 1e8 units). CP-SAT runs with one worker and
``linearization_level=2`` (deterministic, and it proves optimality fast without a second
worker), without presolve probing or symmetry detection (slow on these problems, no help).

Before CP-SAT, the LP relaxation (solvers/relaxation.py, the same rows over [0, 1]) is
solved; when it is integral its answer is optimal and CP-SAT is skipped. Otherwise CP-SAT is
hinted with the better of its leaning assignment and the caller's hint (the best baseline, a
warm start), given whole: every x, y and z.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable

from ortools.sat.python import cp_model

from autopar.problem import ShardingProblem, Solution
from autopar.solvers.formulation import Formulation, summed
from autopar.solvers.relaxation import LpRelaxation

log = logging.getLogger(__name__)

_SCALE_TARGET = 1e8  # the largest single cost term becomes this many integer units


def _solve_interruptibly(solver: cp_model.CpSolver, model: cp_model.CpModel, meanwhile: Iterable | None = None):
    """Search in a worker thread so that Ctrl-C reaches Python at once (the main thread is not
    stuck inside the C++ search): the search is stopped and KeyboardInterrupt raised, so
    nothing is made of an interrupted solve. CP-SAT's own SIGINT handler is off, or it would
    end the search quietly and a half-searched plan would look like a finished one.

    ``meanwhile``: the caller's work, one step per item, done in this thread while the search
    runs (CP-SAT releases the GIL) and only until it ends — e.g. the next meshes' problems; if a
    step raises, the search is stopped first."""
    solver.parameters.catch_sigint_signal = False
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault("code", solver.solve(model)), daemon=True)
    worker.start()
    try:
        for _ in meanwhile or ():
            if not worker.is_alive():
                break
        while worker.is_alive():
            worker.join(0.05)
    except BaseException:  # Ctrl-C, or the caller's work failed: no search left running behind
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
        self._formulations: dict[tuple, Formulation] = {}

    def solve(self, problem: ShardingProblem, hint: list[int] | None = None,
              meanwhile: Iterable | None = None) -> Solution:
        """The optimum of ``problem`` (or the best found in the time limit); ``hint``: a first
        incumbent; ``meanwhile``: the caller's work to do, step by step, while CP-SAT searches
        (:func:`_solve_interruptibly`; none of it when the relaxation answers)."""
        start = time.perf_counter()
        if problem.min_memory() > problem.memory_limit_bytes:  # no search can fit it
            log.info("least memory %d bytes over the limit %d: infeasible", problem.min_memory(),
                     problem.memory_limit_bytes)
            return Solution([], "INFEASIBLE", math.inf, math.inf, time.perf_counter() - start, 0, 0, method="memory")
        if self.relaxation_first:
            relaxation = self._relaxation_of(problem)
            relaxed = relaxation.solve(problem.fixed, self.time_limit_s, excluded=problem.excluded)
            if relaxed.status == "INTEGRAL" and problem.feasible(relaxed.choice):
                objective = problem.evaluate(relaxed.choice)
                elapsed = time.perf_counter() - start
                log.info("lp relaxation integral: optimal in %.2fs", elapsed)
                return Solution(relaxed.choice, "OPTIMAL", objective, min(relaxed.bound_s, objective), elapsed,
                                *relaxation.size, method="lp")
            hint = _better_start(problem, hint, relaxed)
        return self._cp_sat(problem, hint, start, meanwhile)

    def lower_bound(self, problem: ShardingProblem) -> float:
        """Optimum of the LP relaxation (``inf`` when even that is infeasible)."""
        if problem.min_memory() > problem.memory_limit_bytes:
            return math.inf
        relaxed = self._relaxation_of(problem).solve(problem.fixed, self.time_limit_s, least_memory=False,
                                                     excluded=problem.excluded)
        return relaxed.bound_s

    def _relaxation_of(self, problem: ShardingProblem) -> LpRelaxation:
        """Built once per problem; baselines (the same problem with other ``fixed``) reuse it."""
        key = _structure(problem)
        if key not in self._relaxations:
            self._relaxations[key] = LpRelaxation(self._formulation_of(problem))
        return self._relaxations[key]

    def _formulation_of(self, problem: ShardingProblem) -> Formulation:
        key = _structure(problem)
        if key not in self._formulations:  # the cached formulation holds the problem: ids stay unique
            self._formulations[key] = Formulation(problem)
        return self._formulations[key]

    def _cp_sat(self, problem: ShardingProblem, hint: list[int] | None, start: float,
                meanwhile: Iterable | None = None) -> Solution:
        formulation = self._formulation_of(problem)
        model, x, scale = _cp_sat_model(formulation, problem.fixed, problem.excluded, hint)

        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = self.time_limit_s
        solver.parameters.num_workers = 1
        solver.parameters.linearization_level = 2
        # presolve probing and symmetry detection took 70% of the time on folded transformer
        # problems (Llama-8B shape, 8×8 mesh, fixed TP×DP leaves: 10.2 s → 3.1 s, same optimum)
        solver.parameters.cp_model_probing_level = 0
        solver.parameters.symmetry_level = 0
        solver.parameters.random_seed = self.seed
        code = _solve_interruptibly(solver, model, meanwhile)
        elapsed = time.perf_counter() - start
        stats = model.proto
        n_vars, n_cons = len(stats.variables), len(stats.constraints)
        log.info("cp-sat: %d variables, %d constraints, status %s in %.2fs",
                 n_vars, n_cons, solver.status_name(code), elapsed)
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            status = "INFEASIBLE" if code == cp_model.INFEASIBLE else "TIMEOUT"
            return Solution([], status, math.inf, math.inf, elapsed, n_vars, n_cons)
        solution = solver.response_proto.solution
        choice = [next(s for s, v in enumerate(row) if solution[v]) for row in x]
        status = "OPTIMAL" if code == cp_model.OPTIMAL else "FEASIBLE"
        return Solution(choice, status, problem.evaluate(choice), solver.best_objective_bound / scale,
                        elapsed, n_vars, n_cons)


def _better_start(problem: ShardingProblem, hint: list[int] | None, relaxed) -> list[int] | None:
    """CP-SAT's hint: the better (lower objective) of the caller's (the best baseline, a warm
    start's placements) and the LP relaxation's leaning assignment, when that is feasible.
    Given whole (every x, y and z: _cp_sat_model), a near-optimal hint leaves CP-SAT little
    but the proof: on benchmarks/adapt.py's 10 Gbit/s problem the leaning is 4e-5 above the
    optimum, the warm start 10 %; hinted with the leaning the re-plan solves in 0.9 s, with
    the warm start 1.1–14 s (and 2.7–3.8 s with either given as x alone, as before)."""
    leaning = relaxed.leaning
    if hint is None:
        return leaning
    if leaning is None or not problem.feasible(leaning):
        return hint
    return leaning if problem.evaluate(leaning) < problem.evaluate(hint) else hint


def _structure(problem: ShardingProblem) -> tuple:
    """What a formulation depends on (not ``fixed`` nor ``excluded``)."""
    return id(problem.edges), id(problem.node_costs), id(problem.node_memory), problem.memory_limit_bytes


def _cp_sat_model(formulation: Formulation, fixed: dict[int, int], excluded: frozenset[tuple[int, int]],
                  hint: list[int] | None = None):
    """The formulation as a CP-SAT model: (model, x[i][s] as variable indices, objective
    scale); ``hint`` (a strategy per node) becomes a complete hint: every x, y and z.
    Written into the model's proto directly, each term summed per variable as CP-SAT's own
    builders do (one by one through them, an 8×8 Llama-8B mesh took 0.45 s to build)."""
    model = cp_model.CpModel()
    proto = model.proto
    binary = formulation.num_binary
    costs = formulation.objective_coeffs
    largest = max((abs(c) for v, c in zip(formulation.objective_vars, costs) if v < binary), default=0.0)
    scale = _SCALE_TARGET / largest if largest > 0 else 1.0
    # a z is an integer in the objective's units (1/scale s); its bound: every term at once
    z_bound = sum(round(abs(c) * scale) for c in costs) + 1
    # h (bytes): the layer that gathers the most, at most every layer's gathers at once
    h_bound = sum(round(b) for _, held in formulation.held_layers.values() for b in held) * \
        max((len(window) for window, *_ in formulation.held_windows), default=1) + 1
    for v, name in enumerate(formulation.names()):
        variable = proto.variables.add()
        variable.name = name
        variable.domain.extend([0, 1] if v < binary else [0, h_bound if v == formulation.h else z_bound])

    def integral(v: int, c: float) -> int:  # seconds → units; z are in units already
        return round(c * scale) if v < binary else round(c)

    for row in formulation.rows(fixed, excluded):
        constraint = proto.constraints.add()
        constraint.name = row.name
        if row.exactly_one:
            constraint.exactly_one.literals.extend(list(row.vars))
            continue
        terms = summed(row.vars, [integral(v, c) for v, c in zip(row.vars, row.coeffs)] if row.seconds
                        else [_whole(c, row.name) for c in row.coeffs])
        constraint.linear.vars.extend(list(terms))
        constraint.linear.coeffs.extend(list(terms.values()))
        constraint.linear.domain.extend([cp_model.INT_MIN if row.lo == -math.inf else _whole(row.lo, row.name),
                                         cp_model.INT_MAX if row.hi == math.inf else _whole(row.hi, row.name)])
    objective = summed(formulation.objective_vars,
                        [integral(v, c) for v, c in zip(formulation.objective_vars, costs)])
    proto.objective.vars.extend(list(objective))
    proto.objective.coeffs.extend(list(objective.values()))
    if hint is not None:
        values = [round(v) for v in formulation.values(hint)]
        for _g, _phase, z, *sides in formulation.overlap_groups:  # in units, as its rows round them
            values[z] = max(sum(integral(var, c) for var, c in zip(*side) if values[var]) for side in sides)
        proto.solution_hint.vars.extend(list(range(len(values))))
        proto.solution_hint.values.extend(values)
    return model, formulation.x, scale


def _whole(value: float, row: str) -> int:
    """An integer row's coefficient or bound as an int (CP-SAT takes nothing else)."""
    if value != int(value):
        raise ValueError(f"row {row}: {value} is not a whole number")
    return int(value)
