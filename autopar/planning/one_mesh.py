"""The one-mesh family: every device in one mesh, the sharding ILP over candidate meshes.

Capture → costs → strategies per candidate mesh → solve → Plan. Every candidate mesh (1-D,
and 2-D with the inner dim inside a host) gets a problem and its LP lower bound; meshes are
then solved in order of that bound (the simpler mesh first on equal bounds), and a mesh whose
bound cannot beat the best plan found so far is pruned (status "PRUNED"): branch and bound
over meshes, so the winner is still the optimum over all of them. Ties keep the mesh solved
first, so results are stable. The hand-written configurations (planning.hand_written) are
costed on every mesh first: they are the plan's baselines and the solver's warm start.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import MeshSpec, candidate_meshes, checked_mesh, three_dim_refinements
from autopar.plan import Plan
from autopar.planning.costing import plan_choice, priced
from autopar.planning.hand_written import baseline_problem, cost_baselines
from autopar.planning.mesh_plan import replicated_on_one_device, to_plan
from autopar.planning.options import PlanOptions
from autopar.planning.recompute_cut import recompute_where_needed
from autopar.units import format_bytes
from autopar.problem import ShardingProblem, Solution
from autopar.passes.capture import Captured
from autopar.passes.layers import find_repeated_layers
from autopar.passes.layer_recompute import recompute_mode
from autopar.passes.stages import layer_order
from autopar.passes.cost import annotate_costs
from autopar.passes.memory import annotate_saved
from autopar.passes.build_problem import ProblemIndex, annotate_strategies, build_problem
from autopar.passes.strategy_exchanges import table_wise_by_owners
from autopar.solvers import get_solver
from autopar.solvers.baselines import BASELINES, BASELINES_2D, configurations

log = logging.getLogger(__name__)


class OneMesh:
    """Family "one_mesh": one mesh over every device of the cluster."""

    name = "one_mesh"

    def unavailable(self, cluster: Cluster, options: PlanOptions) -> str | None:
        return None  # any cluster is one mesh (mixed devices run at the slowest one's pace)

    def plan(self, graphs, cluster: Cluster, options: PlanOptions) -> Plan:
        """The best plan, recomputing layers only where memory requires it
        (planning.recompute_cut.recompute_where_needed)."""
        return recompute_where_needed(lambda changed: mesh_search(graphs, cluster, changed), cluster, options,
                                      layer_order(graphs.full.graph))

    def lower(self, plan: Plan, model, loss_fn: Callable | None, captured: Captured | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        from autopar.parallel import ParallelModule
        from autopar.passes.lower import lower
        from autopar.passes.relower import Relowering
        from autopar.planning.lowering import capture_for
        from autopar.planning.world import device_type, runtime_device

        kind = device_type(model)
        mesh = init_device_mesh(kind, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
        captured = captured or capture_for(model, plan)
        relowering = Relowering(plan, mesh, model, captured)  # before lowering: the model as given
        return ParallelModule(lower(captured, plan, mesh, model), plan, loss_fn, relowering=relowering,
                              device=runtime_device(kind))


def mesh_search(graphs, cluster: Cluster, options: PlanOptions) -> "MeshSearch":
    """The one-mesh search of ``graphs``' full batch on ``cluster``, prepared once: the family's
    plan and the hand-written baselines every winner lists share its problems."""
    mode = "none" if options.recompute == "auto" else options.recompute
    known = options.mesh_bounds.of(mode) if options.mesh_bounds is not None else {}
    return graphs.derived(_search_key(cluster, options),
                          lambda: MeshSearch(graphs.full, cluster, options, loss_on_outputs=True, known_bounds=known))


def _search_key(cluster: Cluster, options: PlanOptions) -> tuple:
    """What a one-mesh search is made once per, for one graph (ModelGraphs.derived)."""
    return ("one_mesh", id(cluster), options)


def searched_cost(graphs, cluster: Cluster, options: PlanOptions, plan: Plan) -> tuple[float, int] | None:
    """``plan``'s step and memory per device on ``cluster`` from the one-mesh search already made
    with ``options`` (:meth:`MeshSearch.cost_of`), or None where there is none or it cannot tell:
    a re-plan costs the old plan this way instead of building its mesh's problem again."""
    search = graphs.derived_so_far(_search_key(cluster, options))
    return search.cost_of(plan) if search is not None else None


def group_search(graphs, rows: int, cluster: Cluster, options: PlanOptions) -> "MeshSearch":
    """The one-mesh search of ``graphs`` at ``rows`` rows over ``cluster``'s devices (a replica
    group's), prepared once for these graphs per cluster value and options."""
    key = ("group_search", rows, cluster.fingerprint(), dataclasses.replace(options, baselines=False))
    return graphs.derived(key, lambda: MeshSearch(graphs.at_rows(rows), cluster, options, baselines=False))


def group_plan(graphs, rows: int, cluster: Cluster, options: PlanOptions) -> Plan:
    """The best plan of ``graphs`` at ``rows`` rows over ``cluster``'s devices (a replica
    group's, :func:`group_search`), made once for these graphs per cluster value: a re-plan
    whose WAN link changed finds each group's plan made (a group's own cluster holds no WAN
    link)."""
    key = ("group_plan", rows, cluster.fingerprint(), dataclasses.replace(options, baselines=False))
    found = graphs.derived(key, lambda: plan_or_no_fit(lambda: group_search(graphs, rows, cluster, options).best()))
    if isinstance(found, AutoparError):
        raise found
    return found


def plan_or_no_fit(make: Callable[..., Plan], *args, **kwargs) -> "Plan | AutoparError":
    """``make(*args, **kwargs)``, or the INFEASIBLE_MEMORY error it raised (kept like a plan:
    that nothing fits is as much an answer)."""
    try:
        return make(*args, **kwargs)
    except AutoparError as exc:
        if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
            raise
        return exc


def make_plan(captured: Captured, cluster: Cluster, options: PlanOptions, **kwargs) -> Plan:
    """The best intra-operator plan of ``captured`` over ``cluster``'s devices (see
    :class:`MeshSearch` for ``kwargs``)."""
    return MeshSearch(captured, cluster, options, **kwargs).best()


class MeshSearch:
    """Problems of ``captured`` on every candidate mesh, their hand-written baselines, and the
    optimum. A pipeline stage is planned the same way on its own group: ``activation_copies``
    micro-batches in flight, ``baselines=False`` skips the hand-written configurations, and
    ``annotate=False`` keeps the cost and saved-activation annotations its nodes already carry.
    ``options.configuration`` (a baseline's name) makes :meth:`best` return that hand-written
    configuration's plan instead of the optimum (to measure it, e.g.).
    ``known_bounds`` (mesh shape → a lower bound on its step; a re-plan's, options.MeshBounds):
    such a mesh's problem is built only when the search reaches it unpruned — not at all when
    the incumbent is already as fast (unused where baselines or a configuration are costed:
    they need every mesh's problem)."""

    def __init__(self, captured: Captured, cluster: Cluster, options: PlanOptions, *, activation_copies: int = 1,
                 baselines: bool = True, annotate: bool = True, loss_on_outputs: bool = False,
                 known_bounds: dict[tuple[int, ...], float] | None = None) -> None:
        self.captured, self.cluster, self.options = captured, cluster, options
        self.loss_on_outputs = loss_on_outputs
        self.activation_copies = activation_copies
        self.with_baselines = baselines and options.baselines and options.configuration is None
        self.start = time.perf_counter()
        if annotate:
            annotate_costs(captured.graph)
            annotate_saved(captured.graph)
        meshes = [checked_mesh(cluster, options.mesh_shape)] if options.mesh_shape else \
            [mesh for mesh in candidate_meshes(cluster) if len(mesh.shape) <= options.mesh_dims]
        self.engine = get_solver(options.solver, time_limit_s=options.time_limit_s)
        self.repeated = find_repeated_layers(captured) if options.cluster_layers else {}
        self.repeated.update(captured.tied)  # tied weights: one decision (and lowering gives them one tensor)
        known = (known_bounds or {}) if not self.with_baselines and options.configuration is None else {}
        prepared = []
        for order, mesh in enumerate(meshes):
            if tuple(mesh.shape) in known and not self._warm(mesh):  # built if best() reaches it
                prepared.append((known[tuple(mesh.shape)], order, mesh, None, None))
                continue
            bound, problem, index = self._bounded_problem(mesh)
            prepared.append((bound, order, mesh, problem, index))
        # by bound, then the simpler mesh; a warm start's mesh first (its incumbent prunes the rest)
        self.prepared = sorted(prepared, key=lambda p: (not self._warm(p[2]), *p[:2]))
        self._deferred: dict[int, tuple[float, ShardingProblem, ProblemIndex]] = {}  # built after all
        self.prepare_s = time.perf_counter() - self.start
        self._baselines: tuple[dict[str, dict], dict[int, list[int] | None]] | None = None

    def _warm(self, mesh: MeshSpec) -> bool:
        """Whether ``mesh`` is the warm-start plan's (options.warm_start, a one-mesh plan)."""
        warm = self.options.warm_start
        return warm is not None and warm.family == "one_mesh" and tuple(warm.mesh_shape) == tuple(mesh.shape)

    def _problem(self, mesh: MeshSpec, tables_whole: bool = False, recompute: str | None = None,
                 edges: bool = True):
        mode = recompute or (self.options.recompute if self.options.recompute != "auto" else None)
        return build_problem(self.captured, mesh, self.cluster.device, self.cluster.memory_limit_bytes,
                             self.options.optimizer, self.repeated, self.activation_copies, tables_whole=tables_whole,
                             recompute=mode, loss_on_outputs=self.loss_on_outputs, edges_without_fit=False,
                             edges=edges, **self.options.problem_overlap(self.cluster.device))

    def cost_of(self, plan: Plan) -> tuple[float, int] | None:
        """``plan``'s predicted step and memory per device on this search's built problem of its
        mesh — what planning.costing.recost gives, without building that problem again (the
        warm mesh of a re-plan is built first) — or None where this search cannot tell: the mesh
        not built, another recompute mode or a pinned configuration, or copies of a repeated
        layer placed unlike their representative (the problem has one decision for them). A
        problem built without edges (nothing fits) gives an infinite step."""
        mode = "none" if self.options.recompute == "auto" else self.options.recompute
        try:
            planned_mode = recompute_mode(layer_order(self.captured.graph), plan.recompute)
        except ValueError:  # a record no mode gives (recost says so by name)
            return None
        if plan.family != "one_mesh" or self.options.configuration is not None or planned_mode != mode:
            return None
        built = [(mesh, problem, index) for _, _, mesh, problem, index in self.prepared
                 if problem is not None and tuple(mesh.shape) == tuple(plan.mesh_shape)]
        if not built:
            return None
        mesh, problem, index = built[0]
        placed = {name: (node.outputs, node.inputs, node.exchange) for name, node in plan.nodes.items()}
        if any(copy in placed and placed[copy] != placed.get(representative)
               for copy, representative in self.repeated.items()):
            return None
        try:
            choice = plan_choice(self.captured, plan, index, f"mesh {list(mesh.shape)}")
        except AutoparError:
            return None
        step_s, memory = priced(self.captured, problem, index, choice, mesh, self.options.optimizer)
        fits_at_all = problem.min_memory() <= self.cluster.memory_limit_bytes  # else built without edges
        return (step_s if fits_at_all else math.inf), memory

    def memory_of(self, plan: Plan, mesh: MeshSpec, recompute: str) -> int:
        """Bytes per device ``plan``'s placements (made on ``mesh``) hold when ``recompute``
        is the mode: its problem's node memory (built without edges), and the weights its
        placements gather (the plan's: no recompute mode changes them), strategies annotated
        for ``mesh`` first."""
        annotate_strategies(self.captured, mesh.shape, skip=self.repeated)
        problem, index = self._problem(mesh, recompute=recompute, edges=False)
        choice = plan_choice(self.captured, plan, index, f"mesh {list(mesh.shape)}")
        return problem.memory(choice) + plan.memory.gathered_bytes

    @staticmethod
    def _rules(mesh: MeshSpec) -> dict:
        return BASELINES if len(mesh.shape) == 1 else BASELINES_2D

    @property
    def baselines(self) -> dict[str, dict]:
        """Each hand-written configuration on its best mesh: {name: {predicted_step_s,
        feasible, memory_bytes, and reason when infeasible}}."""
        return self._costed_baselines()[0]

    def _costed_baselines(self) -> tuple[dict[str, dict], dict[int, list[int] | None]]:
        """The baselines, and per mesh the best baseline's choice (that mesh's warm start)."""
        if self._baselines is None:
            found: dict[str, dict] = {}
            hints: dict[int, list[int] | None] = {}
            for bound, order, mesh, problem, index in self.prepared:
                if problem is None:  # not built (a known bound): no baselines here, never the warm mesh
                    hints[order] = None
                    continue
                # a baseline already as fast as this mesh's bound cannot do better here (its pinned
                # problem is this one restricted); nor can the plan, so no hint is needed either
                rules = {name: rule for name, rule in (self._rules(mesh) if self.with_baselines else {}).items()
                         if not _beaten(found.get(name), bound)}
                costed, hints[order] = cost_baselines(self.captured, problem, index, self.engine, rules)
                for name, entry in costed.items():  # each baseline keeps its best mesh
                    old = found.get(name)
                    if old is None or entry["feasible"] and (not old["feasible"] or
                                                             entry["predicted_step_s"] < old["predicted_step_s"]):
                        found[name] = entry
                if self._warm(mesh):  # the plan being re-made: the solver starts from its placements
                    try:
                        hints[order] = plan_choice(self.captured, self.options.warm_start, index,
                                                   f"mesh {list(mesh.shape)}")
                    except AutoparError as exc:
                        log.info("warm start not usable on mesh %s: %s", list(mesh.shape), exc.message)
            for name in (*BASELINES, *BASELINES_2D) if self.with_baselines else ():
                found.setdefault(name, {"predicted_step_s": None, "feasible": False,
                                        "reason": "no mesh of this cluster has its shape"})
            self._baselines = (found, hints)
        return self._baselines

    def best(self) -> Plan:
        """The optimum over the candidate meshes (or the pinned configuration's plan)."""
        baselines, hints = self._costed_baselines()
        configuration = self.options.configuration
        best: _Incumbent | None = None
        candidates: dict[int, dict] = {}
        least_memory_bytes = []  # per infeasible mesh: the least any placement needs
        searched = itertools.chain(self.prepared, self._refinements(lambda: best))
        for position, (bound, order, mesh, problem, index) in enumerate(searched):
            if configuration is not None:
                rule = configurations(len(mesh.shape)).get(configuration)
                pinned = baseline_problem(self.captured, problem, index, configuration, rule) if rule else None
                if pinned is None:  # not expressible on this mesh
                    candidates[order] = {"mesh_shape": list(mesh.shape), "status": "NOT_APPLICABLE",
                                         "predicted_step_s": None, "bound_s": None}
                    continue
                problem = pinned
            if problem is None and not _pruned(bound, best):  # a known bound did not prune it: build it
                bound, problem, index = self._deferred_problem(order, mesh, bound)
            if _pruned(bound, best):
                # branch and bound over meshes: this mesh's relaxation cannot beat the incumbent
                candidates[order] = {"mesh_shape": list(mesh.shape), "status": "PRUNED", "predicted_step_s": None,
                                     "bound_s": _finite(bound)}
                if problem is None:
                    log.info("mesh %s: pruned by a known bound (%.3g s), its problem not needed",
                             list(mesh.shape), bound)
                continue
            log.info("mesh %s: solving (%d nodes, %d edges)", list(mesh.shape), problem.num_nodes, len(problem.edges))
            solution, problem, excess, spread_s = self._solve(mesh, problem, index, hints.get(order),
                                                              meanwhile=self._ahead(position))
            candidates[order] = {"mesh_shape": list(mesh.shape), "status": solution.status,
                                 "predicted_step_s": solution.objective_s + spread_s if solution.choice else None,
                                 "bound_s": _finite(solution.bound_s)}
            if not solution.choice:
                least_memory_bytes.append(problem.min_memory())
                continue
            if best is None or solution.objective_s + spread_s < best.step_s * (1 - 1e-9):
                best = _Incumbent(mesh, problem, solution, index, excess, solution.objective_s + spread_s)
        candidates = [candidates[k] for k in sorted(candidates)]
        if best is None and configuration is not None and not least_memory_bytes:
            raise AutoparError(ErrorKind.BAD_INPUT, f"configuration {configuration!r} cannot be expressed for this "
                               f"model on {self.cluster.describe()} (meshes tried: "
                               f"{[c['mesh_shape'] for c in candidates]}): a placement it needs does not split "
                               "evenly (e.g. the batch over the data-parallel degree), or the model has none of the "
                               "layers it parallelises")
        if best is None:
            raise _infeasible(self.cluster, min(least_memory_bytes, default=0), candidates)
        mesh, problem, solution, index, excess, step_s = best
        if math.prod(mesh.shape) == 1 and configuration is None:
            replicated = replicated_on_one_device(problem, index, solution)
            step_s += replicated.objective_s - solution.objective_s
            solution = replicated
        plan_s = time.perf_counter() - self.start
        plan = to_plan(self.captured, self.cluster, mesh, problem, solution, index, candidates, self.options,
                        baselines, excess, step_s,
                        timings={"plan_s": plan_s, "prepare_s": self.prepare_s, "solve_s": solution.solve_s,
                                 "solve_total_s": plan_s - self.prepare_s})
        log.info("plan: mesh %s, predicted step %.3g s, %s", mesh.shape, plan.predicted_step_s, solution.status)
        return plan

    def _refinements(self, incumbent: Callable[[], "_Incumbent | None"]):
        """3-D meshes refining the best 2-D one found (autopar.mesh.three_dim_refinements), as
        (bound, order, mesh, problem, index), each built only when the search reaches it — after
        every prepared mesh, so ``incumbent()`` is the best of those. Only with
        ``options.mesh_dims=3``: none for a pinned mesh or configuration (a 2-D rule), or when no
        2-D mesh won. Each costs a problem on a bigger mesh (about 3.3 s each on this machine
        for the Llama-3-8B shape on 8×8 H100, both pruned by bound there), so 2-D is the default."""
        best = incumbent()
        if self.options.mesh_dims < 3 or self.options.mesh_shape or self.options.configuration or best is None \
                or len(best.mesh.shape) != 2:
            return
        for order, mesh in enumerate(three_dim_refinements(self.cluster, best.mesh.shape), start=len(self.prepared)):
            bound, problem, index = self._bounded_problem(mesh)
            yield bound, order, mesh, problem, index

    def _deferred_problem(self, order: int, mesh: MeshSpec, known: float
                          ) -> tuple[float, ShardingProblem, ProblemIndex]:
        """The problem of a mesh left unbuilt for its ``known`` bound, made once: (the larger of
        that bound and its relaxation's, the problem, its index)."""
        if order not in self._deferred:
            bound, problem, index = self._bounded_problem(mesh)
            self._deferred[order] = (max(known, bound), problem, index)
        return self._deferred[order]

    def _bounded_problem(self, mesh: MeshSpec) -> tuple[float, ShardingProblem, ProblemIndex]:
        """``mesh``'s problem (its strategies annotated first: the graph holds one mesh's at a
        time), with its relaxation's bound and its index."""
        annotate_strategies(self.captured, mesh.shape, skip=self.repeated)
        problem, index = self._problem(mesh)
        return self.engine.lower_bound(problem), problem, index

    def _ahead(self, position: int) -> Iterator[None]:
        """Build the unbuilt meshes after ``position`` in the search order, one per step: what
        the main thread does while CP-SAT searches a mesh (most are needed next; whether one is
        pruned still depends on its known bound alone, so plans do not depend on the timing)."""
        for bound, order, mesh, problem, _index in self.prepared[position + 1:]:
            if problem is None:
                self._deferred_problem(order, mesh, bound)
                yield

    def _solve(self, mesh: MeshSpec, problem: ShardingProblem, index: ProblemIndex, hint: list[int] | None,
               meanwhile: Iterator[None] | None = None) -> tuple[Solution, ShardingProblem, int, float]:
        """Solve one mesh's problem (doing ``meanwhile``'s steps while CP-SAT searches); returns
        the solution, the problem it solved, the busiest table-wise owner's bytes beyond the even
        split, and the owners' extra exchange time."""
        # warm start: a time limit keeps it ≥ the best baseline
        solution = self.engine.solve(problem, hint=hint, meanwhile=meanwhile)
        # the problem charged the table-wise tables evenly spread over their owners: the owners
        # picked for this choice hold (and send) more on the busiest device
        optimizer = self.options.optimizer
        excess, spread_s = table_wise_by_owners(self.captured, index, solution.choice, mesh, optimizer) \
            if solution.choice else (0, 0.0)
        if excess and problem.memory(solution.choice) + excess > problem.memory_limit_bytes:
            # the owners cannot spread the table-wise tables evenly enough: charge them whole
            # on every device (a bound whatever the owners) and solve again
            log.info("mesh %s: table-wise owners %d bytes over the even split; solving again", list(mesh.shape), excess)
            annotate_strategies(self.captured, mesh.shape, skip=self.repeated)  # the graph holds the last mesh's
            whole, _ = self._problem(mesh, tables_whole=True)
            problem = dataclasses.replace(whole, fixed=problem.fixed, excluded=problem.excluded)
            solution = self.engine.solve(problem, hint=hint)
            spread_s = table_wise_by_owners(self.captured, index, solution.choice, mesh, optimizer)[1] \
                if solution.choice else 0.0
            excess = 0  # charged whole: the busiest owner holds no more
        return solution, problem, excess, spread_s


class _Incumbent(NamedTuple):
    """The best mesh solved so far: what its plan is made of."""

    mesh: MeshSpec
    problem: ShardingProblem
    solution: Solution
    index: ProblemIndex
    table_excess: int  # bytes the busiest table-wise owner holds beyond the even split
    step_s: float  # the objective plus the table-wise owners' real spread


def _pruned(bound: float, best: _Incumbent | None) -> bool:
    """Whether a mesh whose step is at least ``bound`` cannot beat the incumbent."""
    return best is not None and bound >= best.step_s * (1 - 1e-9)


def _beaten(baseline: dict | None, bound: float) -> bool:
    """Whether a baseline's best entry so far is at least as fast as a mesh's lower bound
    (costing it on that mesh could not replace the entry: only a strictly faster one does)."""
    return baseline is not None and baseline["feasible"] and baseline["predicted_step_s"] <= bound


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _infeasible(cluster: Cluster, needed: int, candidates) -> AutoparError:
    limit = cluster.memory_limit_bytes
    if needed > limit:
        shortfall = f"{needed - limit} bytes over"
    else:  # each node's leanest strategy fits, but they do not chain without resharding copies
        shortfall = ("each node's leanest placement would fit, but no placement of the whole graph "
                     "that chains them does")
    return AutoparError(
        ErrorKind.INFEASIBLE_MEMORY,
        f"no plan fits in memory on {cluster.describe()}: even the most sharded placement needs at least "
        f"{needed} bytes ({format_bytes(needed)}) per device, each device has {limit} bytes "
        f"({format_bytes(limit)}); {shortfall} (meshes tried: "
        f"{[c['mesh_shape'] for c in candidates]}). Fixes: 1) more devices, 2) a smaller batch, "
        "3) a larger memory_limit or devices with more memory, 4) an optimizer with less state (sgd)",
        needed_bytes=needed)
