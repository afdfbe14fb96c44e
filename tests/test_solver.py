"""The ILP is exact: it equals brute force on random small problems, and a closed form."""

from __future__ import annotations

import dataclasses
import doctest
import itertools
import math
import random

import pytest

import autopar.solvers.formulation
from autopar.problem import Edge, ShardingProblem
from autopar.solvers.formulation import Formulation
from autopar.solvers.ilp import CpSatSolver, _cp_sat_model
from autopar.solvers.relaxation import LpRelaxation


def random_problem(rng: random.Random) -> ShardingProblem:
    """≤ 8 nodes, ≤ 4 strategies, a random DAG; half of the problems carry the multiplicities
    of folded repeated layers (node and edge counts, edges between copies of one node); some
    overlap groups, some gathered weights held per window of layers."""
    n = rng.randint(2, 8)
    k = [rng.randint(1, 4) for _ in range(n)]
    while math.prod(k) > 4096:  # keep brute force quick
        k[k.index(max(k))] -= 1
    costs = [[round(rng.uniform(0, 10), 3) for _ in range(k[i])] for i in range(n)]
    memory = [[rng.randint(0, 100) for _ in range(k[i])] for i in range(n)]
    folded = rng.random() < 0.5
    edges = []
    for j in range(1, n):
        sources = rng.sample(range(j), rng.randint(1, min(2, j)))
        if folded and rng.random() < 0.2:
            sources.append(j)  # a layer's node feeding the same node of the next copy
        for i in sources:
            src_class = [rng.randint(0, 2) for _ in range(k[i])]
            dst_class = [rng.randint(0, 2) for _ in range(k[j])]
            cost = [[None if rng.random() < 0.15 else round(rng.uniform(0, 10), 3) for _ in range(3)]
                    for _ in range(3)]
            edges.append(Edge(i, j, src_class, dst_class, cost, count=rng.randint(1, 4) if folded else 1))
    counts = [rng.randint(1, 3) for _ in range(n)] if folded else None
    limit = rng.randint(50, 100 * n * (2 if folded else 1))
    problem = ShardingProblem([f"n{i}" for i in range(n)], costs, memory, edges, limit, node_count=counts)
    if rng.random() < 0.4:  # overlap: nodes in 1–3 groups, some edges hidden behind their group's compute
        groups = [rng.randint(-1, 2) for _ in range(n)]
        own = [[round(rng.uniform(0, c), 3) if rng.random() < 0.3 else 0.0 for c in row] for row in costs]
        forward = [[round(rng.uniform(0, c - o), 3) for c, o in zip(row, mine)] for row, mine in zip(costs, own)]
        edges = [dataclasses.replace(e, group=groups[e.dst], parts=[[None if c is None else _parts(rng, c) for c in row]
                                                                     for row in e.cost]
                                     if rng.random() < 0.7 else None) if rng.random() < 0.6 else e for e in edges]
        kinds = tuple((kind, rng.choice([1.0, -0.5, round(rng.uniform(-1, 1), 3)]))
                      for kind in ("all_gather", "reduce_scatter", "all_reduce") if rng.random() < 0.5)
        problem = dataclasses.replace(problem, edges=edges, node_group=groups, node_comm=own, node_forward=forward,
                                      overlap_efficiency=rng.choice([1.0, 0.5, round(rng.uniform(0, 1), 3)]),
                                      collective_overlap=kinds, prefetch=rng.random() < 0.7)
    if rng.random() < 0.4:  # gathered weights: some edges hold bytes in one of 3 layers, held in windows
        edges = [dataclasses.replace(e, layer=rng.randint(0, 2), held=[[None if c is None else rng.choice(
            [0, rng.randint(1, 60)]) for c in row] for row in e.cost]) if rng.random() < 0.6 else e
            for e in problem.edges]
        windows = tuple(sorted({tuple(sorted(rng.choices(range(3), k=rng.randint(1, 3)))) for _ in range(3)}))
        problem = dataclasses.replace(problem, edges=edges, held_windows=windows)
    if problem.node_group is not None and rng.random() < 0.5:  # one copy of a group's communication exposed
        problem = dataclasses.replace(problem, exposed_group=rng.randint(0, 2))
    return problem


def _parts(rng: random.Random, cost: float) -> tuple[float, float, float, str]:
    """A random split of an edge's ``cost`` into forward gathers, backward re-gathers, a
    gradient reduction (of a random kind) and the exposed rest."""
    forward = round(rng.uniform(0, cost), 3)
    regather = round(rng.uniform(0, cost - forward), 3)
    reduction = round(rng.uniform(0, cost - forward - regather), 3)
    return forward, regather, reduction, rng.choice(["all_reduce", "reduce_scatter"])


def brute_force(problem: ShardingProblem) -> float:
    best = math.inf
    for choice in itertools.product(*[range(len(c)) for c in problem.node_costs]):
        if problem.feasible(list(choice)):
            best = min(best, problem.evaluate(list(choice)))
    return best


@pytest.mark.parametrize("seed", range(200))
def test_ilp_equals_brute_force(seed):
    problem = random_problem(random.Random(seed))
    expected = brute_force(problem)
    solution = CpSatSolver(time_limit_s=20).solve(problem)
    if math.isinf(expected):
        assert solution.status == "INFEASIBLE"
    else:
        assert solution.status == "OPTIMAL"
        assert problem.feasible(solution.choice)
        assert solution.objective_s == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_both_proofs_are_exercised():
    """The LP relaxation settles some problems; CP-SAT the rest (both checked above)."""
    methods = set()
    for seed in range(60):
        problem = random_problem(random.Random(seed))
        if not math.isinf(brute_force(problem)):
            methods.add(CpSatSolver(time_limit_s=20).solve(problem).method)
    assert methods == {"lp", "cp-sat"}


def test_cp_sat_alone_matches_relaxation_first():
    for seed in range(30):
        problem = random_problem(random.Random(seed))
        a = CpSatSolver(time_limit_s=20).solve(problem)
        b = CpSatSolver(time_limit_s=20, relaxation_first=False).solve(problem)
        assert a.status == b.status
        if a.choice:
            assert a.objective_s == pytest.approx(b.objective_s, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("seed", range(0, 200, 4))
def test_relaxation_is_a_lower_bound(seed):
    """The LP (single-class edges folded into x, as in CP-SAT) never exceeds the optimum."""
    problem = random_problem(random.Random(seed))
    assert CpSatSolver().lower_bound(problem) <= brute_force(problem) + 1e-6


@pytest.mark.parametrize("seed", [144, 219, 240])
def test_the_relaxation_costs_a_row_naming_a_variable_twice_as_the_ilp_does(seed):
    """An overlap row may take two parts of its work from one variable (these random problems
    do): the LP sums the coefficients, as CP-SAT does. With every placement fixed to the
    ILP's optimum, the LP costs it exactly (set one by one, the last coefficient won and the
    LP came out 4-11 % cheaper on these seeds, a relaxation of another problem)."""
    problem = random_problem(random.Random(seed))
    formulation = Formulation(problem)
    assert any(len(set(row.vars)) < len(row.vars) for row in formulation.overlap())
    optimum = CpSatSolver(time_limit_s=30).solve(problem)
    assert optimum.status == "OPTIMAL"
    fixed = LpRelaxation(formulation).solve(dict(enumerate(optimum.choice)), 30, least_memory=False)
    assert fixed.bound_s == pytest.approx(optimum.objective_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(0, 40, 5))
def test_a_relaxation_answers_each_fixing_as_a_fresh_one_does_in_any_order(seed):
    """The relaxation keeps each fixing's first solve (the search's own solve of a mesh comes
    after the baselines' pinned ones): asked again after others, it answers what a fresh
    relaxation answers, its least-memory tie-break included."""
    problem = random_problem(random.Random(seed))
    formulation = Formulation(problem)
    rng = random.Random(seed + 1)
    fixings = [{}, *({i: rng.randrange(len(problem.node_costs[i]))} for i in rng.sample(range(problem.num_nodes), 2))]
    shared = LpRelaxation(formulation)
    for fixed in [*fixings, *reversed(fixings)]:
        for least_memory in (False, True):
            again = shared.solve(fixed, 30, least_memory=least_memory)
            fresh = LpRelaxation(formulation).solve(fixed, 30, least_memory=least_memory)
            assert (again.status, again.choice) == (fresh.status, fresh.choice), fixed
            assert again.bound_s == pytest.approx(fresh.bound_s, rel=1e-9, abs=1e-12)


def test_both_backends_get_the_same_named_rows():
    """One description: CP-SAT and the LP get the same rows, named by family (the LP applies
    the fixed and excluded rows as bounds, per solve)."""
    for seed in range(20):
        problem = random_problem(random.Random(seed))
        problem = dataclasses.replace(problem, fixed={0: 0}, excluded=frozenset({(1, 0)}))
        formulation = Formulation(problem)
        rows = [row.name for row in formulation.rows(problem.fixed, problem.excluded)]
        model, _, _ = _cp_sat_model(formulation, problem.fixed, problem.excluded)
        assert [c.name for c in model.proto.constraints] == rows
        assert rows[-2:] == ["fixed[n0]", "excluded[n1,0]"]
        lp = LpRelaxation(formulation)
        assert [c.name() for c in lp.solver.constraints()] == rows[:-2]
        assert len(model.proto.variables) == lp.solver.NumVariables() == formulation.num_variables


@pytest.mark.parametrize("seed", range(60))
def test_a_choice_gives_a_whole_assignment_that_meets_every_row_and_costs_its_objective(seed):
    """Formulation.values: the hint CP-SAT is given (every x, y and z, not the x alone) meets
    every row but memory's for any choice (memory's too when the choice fits), and its
    objective is the choice's step time; CP-SAT receives a hint for every variable."""
    problem = random_problem(random.Random(seed))
    formulation = Formulation(problem)
    rng = random.Random(seed + 1000)
    for _ in range(5):
        choice = [rng.randrange(len(c)) for c in problem.node_costs]
        values = formulation.values(choice)
        allowed = all(e.cost[e.src_class[choice[e.src]]][e.dst_class[choice[e.dst]]] is not None
                      for e in problem.edges)
        for row in formulation.rows({}, frozenset()):
            if row.name == "memory" and not problem.feasible(choice) or not allowed:
                continue
            total = sum(c * values[v] for v, c in zip(row.vars, row.coeffs))
            assert row.lo - 1e-9 <= total <= row.hi + 1e-9, (row.name, total, row.lo, row.hi)
        if allowed:
            objective = sum(c * values[v] for v, c in zip(formulation.objective_vars, formulation.objective_coeffs))
            assert objective == pytest.approx(problem.evaluate(choice), rel=1e-9, abs=1e-9)
        model, _, _ = _cp_sat_model(formulation, {}, frozenset(), choice)
        assert len(model.proto.solution_hint.vars) == formulation.num_variables


def test_formulation_docstring_example():
    assert doctest.testmod(autopar.solvers.formulation).failed == 0


def test_chain_with_reshard_penalty_has_closed_form():
    """N nodes, 2 strategies; strategy 1 is cheaper by d per node but switching costs r.
    Optimum: all strategy 1 (cost N·(c−d)) since a single class can't be mixed cheaper."""
    n, c, d, r = 12, 5.0, 1.0, 3.0
    edges = [Edge(i, i + 1, [0, 1], [0, 1], [[0.0, r], [r, 0.0]]) for i in range(n - 1)]
    problem = ShardingProblem([f"l{i}" for i in range(n)], [[c, c - d]] * n, [[0, 0]] * n, edges, 0)
    solution = CpSatSolver().solve(problem)
    assert solution.choice == [1] * n
    assert solution.objective_s == pytest.approx(n * (c - d))
    # forcing the first node onto strategy 0: switch once (r) if r < d·(n−1), as here
    fixed = ShardingProblem(problem.node_names, problem.node_costs, problem.node_memory, edges, 0, fixed={0: 0})
    assert CpSatSolver().solve(fixed).objective_s == pytest.approx(c + r + (n - 1) * (c - d))


def test_least_memory_with_fixed_nodes_settles_infeasibility_without_a_search():
    """A pinned problem (a hand-written baseline) whose fixed placements alone exceed the
    limit is infeasible at once; the bound counts fixed nodes at their strategy and leaves
    excluded strategies out, and never rules out a problem that fits."""
    n = 4
    edges = [Edge(i, i + 1, [0, 1], [0, 1], [[0.0, 1.0], [1.0, 0.0]]) for i in range(n - 1)]
    free = ShardingProblem([f"l{i}" for i in range(n)], [[2.0, 1.0]] * n, [[1, 5]] * n, edges, 8)
    assert free.min_memory() == 4 and CpSatSolver().solve(free).status == "OPTIMAL"
    pinned = dataclasses.replace(free, fixed={0: 1, 1: 1})
    assert pinned.min_memory() == 12
    solution = CpSatSolver().solve(pinned)
    assert (solution.status, solution.method, solution.choice) == ("INFEASIBLE", "memory", [])
    one = dataclasses.replace(free, fixed={0: 1})
    assert one.min_memory() == 8
    solution = CpSatSolver().solve(one)
    assert solution.status == "OPTIMAL" and solution.choice[0] == 1 and one.memory(solution.choice) <= 8
    excluded = dataclasses.replace(free, excluded=frozenset((i, 0) for i in range(3)))
    assert excluded.min_memory() == 16 and CpSatSolver().solve(excluded).method == "memory"


def test_time_limit_returns_the_warm_start_or_better():
    """A hint (e.g. the best baseline) is a feasible answer even when the search is cut short."""
    rng = random.Random(7)
    problem = random_problem(rng)
    while math.isinf(brute_force(problem)):
        problem = random_problem(rng)
    hint = next(list(c) for c in itertools.product(*[range(len(x)) for x in problem.node_costs])
                if problem.feasible(list(c)))
    solution = CpSatSolver(time_limit_s=5).solve(problem, hint=hint)
    assert solution.status in ("OPTIMAL", "FEASIBLE")
    assert solution.objective_s <= problem.evaluate(hint) + 1e-9


def _endless(steps: list):
    while True:
        steps.append(len(steps))
        yield


def test_the_callers_work_runs_while_cp_sat_searches_and_stops_when_the_search_ends():
    """``solve(meanwhile=…)`` (the one-mesh search builds the next meshes so): its steps run in
    the caller's thread while CP-SAT searches and no more once the search has ended (an endless
    generator ends with it), the answer is the one solving alone gives, and a problem the
    relaxation settles runs none of them."""
    searched = settled = None
    for seed in range(60):
        problem = random_problem(random.Random(seed))
        if math.isinf(brute_force(problem)):
            continue
        method = CpSatSolver(time_limit_s=20).solve(problem).method
        searched = searched or (problem if method == "cp-sat" else None)
        settled = settled or (problem if method == "lp" else None)
    steps = []
    solution = CpSatSolver(time_limit_s=20).solve(searched, meanwhile=_endless(steps))
    assert solution.method == "cp-sat" and steps
    assert solution.objective_s == pytest.approx(brute_force(searched), rel=1e-6, abs=1e-6)
    untouched = []
    assert CpSatSolver(time_limit_s=20).solve(settled, meanwhile=_endless(untouched)).method == "lp"
    assert untouched == []


def test_a_failing_step_of_the_callers_work_stops_the_search():
    """An error in the work done meanwhile reaches the caller, with no search left running."""
    import threading

    def failing():
        raise RuntimeError("building the next mesh failed")
        yield

    problem = next(p for p in (random_problem(random.Random(seed)) for seed in range(60))
                   if not math.isinf(brute_force(p)) and CpSatSolver(time_limit_s=20).solve(p).method == "cp-sat")
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="next mesh failed"):
        CpSatSolver(time_limit_s=20, relaxation_first=False).solve(problem, meanwhile=failing())
    assert threading.active_count() == before
