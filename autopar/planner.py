"""Planning pipeline: capture → costs → strategies per candidate mesh → solve → Plan.

Every candidate mesh (1-D, and 2-D with the inner dim inside a host) gets a problem and its
LP lower bound; meshes are then solved in order of that bound (the simpler mesh first on
equal bounds), and a mesh whose bound cannot beat the best plan found so far is pruned
(status "PRUNED"): branch and bound over meshes, so the winner is still the optimum over all
of them. Ties keep the mesh solved first, so results are stable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import MeshSpec, candidate_meshes, checked_mesh
from autopar.plan import MemoryBreakdown, NodePlan, ParameterPlan, Plan, layer_of_path, placement_text
from autopar.plan_sections import expert_layers, sparse_tables
from autopar.units import format_bytes
from autopar.problem import ShardingProblem, Solution
from autopar.passes.capture import Captured
from autopar.passes.layers import find_repeated_layers
from autopar.passes.cost import annotate_costs, tensor_bytes
from autopar.passes.memory import annotate_saved
from autopar.passes.problem import (
    OPTIMIZER_STATES, ProblemIndex, annotate_strategies, build_problem, lookup_exchange_s, table_wise_by_owners,
    unit_links)
from autopar.passes.sparse import LOOKUP_KEY
from autopar.solvers import get_solver
from autopar.solvers.baselines import BASELINES, BASELINES_2D

log = logging.getLogger(__name__)


def make_plan(captured: Captured, cluster: Cluster, *, optimizer: str = "adamw", solver: str = "cpsat",
              time_limit_s: float = 60.0, mesh_shape: tuple[int, ...] | None = None,
              cluster_layers: bool = True, activation_copies: int = 1, baselines: bool = True,
              annotate: bool = True, configuration: str | None = None) -> Plan:
    """The best intra-operator plan of ``captured`` over ``cluster``'s devices. A pipeline stage
    is planned the same way on its own group: ``activation_copies`` micro-batches in flight,
    and ``baselines=False`` skips costing the hand-written configurations; ``annotate=False``
    keeps the cost and saved-activation annotations its nodes already carry.
    ``configuration`` (a baseline's name: "ddp", "fsdp", "megatron_tp", "tp_dp") returns that
    hand-written configuration's plan instead of the optimum (to measure it, e.g.)."""
    if configuration is not None and configuration not in {**BASELINES, **BASELINES_2D}:
        raise AutoparError(ErrorKind.BAD_INPUT, f"unknown configuration {configuration!r}; choose one of "
                           f"{', '.join({**BASELINES, **BASELINES_2D})}")
    baselines = baselines and configuration is None
    if optimizer not in OPTIMIZER_STATES:
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATES)}")
    start = time.perf_counter()
    if annotate:
        annotate_costs(captured.graph)
        annotate_saved(captured.graph)
    meshes = [checked_mesh(cluster, mesh_shape)] if mesh_shape else candidate_meshes(cluster)
    engine = get_solver(solver, time_limit_s=time_limit_s)
    repeated = find_repeated_layers(captured) if cluster_layers else {}
    repeated.update(captured.tied)  # tied weights: one decision (and lowering gives them one tensor)
    prepared = []
    for order, mesh in enumerate(meshes):
        annotate_strategies(captured, mesh.shape, skip=repeated)
        problem, index = build_problem(captured, mesh, cluster.device, cluster.memory_limit_bytes, optimizer,
                                       repeated, activation_copies)
        prepared.append((engine.lower_bound(problem), order, mesh, problem, index))
    prepare_s = time.perf_counter() - start
    best = None
    candidates: dict[int, dict] = {}
    lower_bounds = []
    found_baselines: dict[str, dict] = {}
    for bound, order, mesh, problem, index in sorted(prepared, key=lambda p: p[:2]):
        rules = (BASELINES if len(mesh.shape) == 1 else BASELINES_2D) if baselines else {}
        found, hint = _baselines(captured, problem, index, engine, rules)
        for name, entry in found.items():  # each baseline keeps its best mesh
            old = found_baselines.get(name)
            if old is None or entry["feasible"] and (not old["feasible"] or
                                                     entry["predicted_step_s"] < old["predicted_step_s"]):
                found_baselines[name] = entry
        if configuration is not None:
            rule = (BASELINES if len(mesh.shape) == 1 else BASELINES_2D).get(configuration)
            pinned = _baseline_problem(captured, problem, index, configuration, rule) if rule else None
            if pinned is None:  # not expressible on this mesh
                candidates[order] = {"mesh_shape": list(mesh.shape), "status": "NOT_APPLICABLE",
                                     "predicted_step_s": None, "bound_s": None}
                continue
            problem = pinned
        if best is not None and bound >= best[5] * (1 - 1e-9):
            # branch and bound over meshes: this mesh's relaxation cannot beat the incumbent
            candidates[order] = {"mesh_shape": list(mesh.shape), "status": "PRUNED", "predicted_step_s": None,
                                 "bound_s": _finite(bound)}
            continue
        log.info("mesh %s: solving (%d nodes, %d edges)", list(mesh.shape), problem.num_nodes, len(problem.edges))
        solution = engine.solve(problem, hint=hint)  # warm start: a time limit keeps it ≥ the best baseline
        # the problem charged the table-wise tables evenly spread over their owners: the owners
        # picked for this choice hold (and send) more on the busiest device
        excess, spread_s = table_wise_by_owners(captured, index, solution.choice, mesh, optimizer) \
            if solution.choice else (0, 0.0)
        if excess and problem.memory(solution.choice) + excess > problem.memory_limit_bytes:
            # the owners cannot spread the table-wise tables evenly enough: charge them whole
            # on every device (a bound whatever the owners) and solve again
            log.info("mesh %s: table-wise owners %d bytes over the even split; solving again", list(mesh.shape), excess)
            annotate_strategies(captured, mesh.shape, skip=repeated)  # the graph holds the last candidate mesh's
            whole, _ = build_problem(captured, mesh, cluster.device, cluster.memory_limit_bytes, optimizer,
                                     repeated, activation_copies, tables_whole=True)
            problem = dataclasses.replace(whole, fixed=problem.fixed, excluded=problem.excluded)
            solution = engine.solve(problem, hint=hint)
            spread_s = table_wise_by_owners(captured, index, solution.choice, mesh, optimizer)[1] \
                if solution.choice else 0.0
            excess = 0  # charged whole: the busiest owner holds no more
        candidates[order] = {"mesh_shape": list(mesh.shape), "status": solution.status,
                             "predicted_step_s": solution.objective_s + spread_s if solution.choice else None,
                             "bound_s": _finite(solution.bound_s)}
        if not solution.choice:
            lower_bounds.append(problem.min_memory())
            continue
        if best is None or solution.objective_s + spread_s < best[5] * (1 - 1e-9):
            best = (mesh, problem, solution, index, excess, solution.objective_s + spread_s)
    candidates = [candidates[k] for k in sorted(candidates)]
    for name in (*BASELINES, *BASELINES_2D) if baselines else ():  # e.g. no 2-D mesh on this cluster
        found_baselines.setdefault(name, {"predicted_step_s": None, "feasible": False})
    if best is None and configuration is not None and not lower_bounds:
        raise AutoparError(ErrorKind.BAD_INPUT, f"configuration {configuration!r} cannot be expressed for this model "
                           f"on {cluster.describe()} (meshes tried: {[c['mesh_shape'] for c in candidates]}): "
                           "a placement it needs does not split evenly (e.g. the batch over the data-parallel "
                           "degree), or the model has none of the layers it parallelises")
    if best is None:
        raise _infeasible(cluster, min(lower_bounds) if lower_bounds else 0, candidates)
    mesh, problem, solution, index, excess, step_s = best
    plan = _to_plan(captured, cluster, mesh, problem, solution, index, candidates, optimizer, found_baselines, excess,
                    step_s)
    plan_s = time.perf_counter() - start
    object.__setattr__(plan, "timings", {"plan_s": plan_s, "prepare_s": prepare_s, "solve_s": solution.solve_s,
                                         "solve_total_s": plan_s - prepare_s})
    log.info("plan: mesh %s, predicted step %.3g s, %s", mesh.shape, plan.predicted_step_s, solution.status)
    return plan


def _unclustered_variables(problem: ShardingProblem) -> int:
    """Variables the ILP would have without folding repeated layers (x per node and strategy,
    y per allowed class pair of edges with several classes on both sides)."""
    total = sum(problem.count(i) * len(costs) for i, costs in enumerate(problem.node_costs))
    for e in problem.edges:
        if len(set(e.src_class)) > 1 and len(set(e.dst_class)) > 1:
            total += e.count * sum(c is not None for row in e.cost for c in row)
    return total


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _megatron_roles(captured: Captured, index: ProblemIndex) -> list[str | None]:
    """Linear layers of each repeated layer (or of the whole model), in order of use, alternate
    column- and row-parallel, as Megatron pairs qkv/proj and fc/out; sparse embedding tables
    get the role "table"."""
    linear_of: dict[str, str] = {}  # parameter placeholder -> Linear module path
    order: list[str] = []
    for node in captured.graph.nodes:
        for arg in node.all_input_nodes:
            if arg.name in captured.parameter_of and arg.name not in linear_of:
                path, cls = list((node.meta.get("nn_module_stack") or {"": ("", "")}).values())[-1]
                if str(cls).endswith("Linear"):
                    linear_of[arg.name] = path
                    if path not in order:
                        order.append(path)
    position: dict[str, int] = {}
    counters: dict[str | None, int] = {}
    for path in order:
        layer = layer_of_path(path)
        position[path] = counters.get(layer, 0)
        counters[layer] = position[path] + 1
    tables = {node.args[0].name for node in captured.graph.nodes if LOOKUP_KEY in node.meta}
    roles = []
    for name, kind in zip(index.names, index.kinds):
        path = linear_of.get(name) if kind == "param" else None
        if path is None:
            roles.append("table" if kind == "param" and name in tables else None)
            continue
        side = "column" if position[path] % 2 == 0 else "row"
        roles.append(f"{side}_{'weight' if captured.parameter_of[name].endswith('weight') else 'bias'}")
    return roles


def _batch_dims(captured: Captured, index: ProblemIndex) -> list[int | None]:
    """Batch dimension of each user input for the data-parallel baselines: the first dim whose
    size is the first input's leading size (DLRM's ids are (tables, batch, ids per bag))."""
    batch = captured.inputs[0].shape[0] if captured.inputs and captured.inputs[0].shape else None
    dims: list[int | None] = []
    for name, kind in zip(index.names, index.kinds):
        spec = next((t for t in captured.inputs if t.name == name), None) if kind == "input" else None
        dims.append(next((d for d, size in enumerate(spec.shape) if size == batch), None) if spec else None)
    return dims


def _baselines(captured: Captured, problem: ShardingProblem, index: ProblemIndex, engine, rules: dict
               ) -> tuple[dict, list[int] | None]:
    """Hand-written configurations as fixed parameter and input placements, the rest optimised
    by the same model. Returns their predictions and the best feasible assignment (a warm start)."""
    result, best = {}, None
    for name, rule in rules.items():
        pinned = _baseline_problem(captured, problem, index, name, rule)
        solution = engine.solve(pinned) if pinned is not None else None
        feasible = solution is not None and bool(solution.choice)
        result[name] = {"predicted_step_s": solution.objective_s if feasible else None, "feasible": feasible,
                        "memory_bytes": pinned.memory(solution.choice) if feasible else None}
        if feasible and (best is None or solution.objective_s < best.objective_s):
            best = solution
    return result, (best.choice if best else None)


def _baseline_problem(captured: Captured, problem: ShardingProblem, index: ProblemIndex, name: str, rule
                      ) -> ShardingProblem | None:
    """``problem`` with the configuration ``rule`` fixed; None when it is not expressible.
    Hand-written configurations are dense: no sparse gradient exchange. DDP also keeps every
    embedding lookup on its batch shard (table replicated, gradient all-reduced), as
    DistributedDataParallel does, rather than letting the solver gather the ids."""
    fixed = rule(index.kinds, _leaf_options(index), _megatron_roles(captured, index), _batch_dims(captured, index))
    if fixed is None:
        return None
    if name == "ddp":
        lookups = {n.name for n in captured.graph.nodes if LOOKUP_KEY in n.meta}
        for q, node_name in enumerate(index.names):
            if node_name in lookups:
                local = [t for t, s in enumerate(index.strategies[q]) if not s.exchange
                         and all(p == "R" for p in s.inputs[0]) and all(p == "S(0)" for p in s.inputs[1])]
                if local:
                    fixed = {**fixed, q: local[0]}
    return dataclasses.replace(problem, fixed=fixed, excluded=_sparse_exchanges(index))


def _sparse_exchanges(index: ProblemIndex) -> frozenset[tuple[int, int]]:
    """(node, strategy) of every sparse-exchange lookup: hand-written configurations are dense."""
    return frozenset((i, t) for i, options in enumerate(index.strategies) for t, s in enumerate(options) if s.exchange)


def _leaf_options(index: ProblemIndex) -> list[list[str]]:
    """Placement string of each strategy of every parameter and input node (baselines fix these)."""
    return [[",".join(s.outputs[0]) for s in options] if kind in ("param", "input") else []
            for kind, options in zip(index.kinds, index.strategies)]


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


_ALTERNATIVES = 4


def _local_costs(problem: ShardingProblem, choice: list[int], q: int, incident) -> list[float]:
    """Resharding time on one graph node's edges for each strategy of its problem node ``q``,
    every neighbour as chosen. ``incident``: (problem edge, node is its producer) pairs."""
    costs = []
    for t in range(len(problem.node_costs[q])):
        total = 0.0
        for e, as_producer in incident:
            s_src = t if as_producer else choice[e.src]
            s_dst = choice[e.dst] if as_producer else t
            total += e.pair_cost(s_src, s_dst)
        costs.append(total)
    return costs


def _to_plan(captured: Captured, cluster: Cluster, mesh: MeshSpec, problem: ShardingProblem, solution: Solution,
             index: ProblemIndex, candidates, optimizer: str, baselines: dict, table_excess: int = 0,
             step_s: float | None = None) -> Plan:
    """Every graph node (copies of repeated layers included) gets its problem node's choice.
    ``table_excess``: bytes the busiest table-wise owner holds beyond the even split the
    problem charged (the plan's memory is the busiest device's); ``step_s``: the step time
    with the table-wise owners' real spread (default: the solver's objective)."""
    incident: dict[str, list] = {}
    for (producer, consumer, _arg), k in index.edge_of.items():
        incident.setdefault(producer, []).append((problem.edges[k], True))
        incident.setdefault(consumer, []).append((problem.edges[k], False))
    nodes, parameters, buffers = {}, {}, {}
    memory = {"param": table_excess, "act": 0}
    states = OPTIMIZER_STATES[optimizer]
    for node in captured.graph.nodes:
        q = index.node_of.get(node.name)
        if q is None:
            continue
        choice = solution.choice[q]
        chosen = index.strategies[q][choice]
        kind = index.kinds[q]
        if kind == "param":
            fqn = captured.parameter_of[node.name]
            split = tuple(d for d, p in enumerate(chosen.outputs[0]) if p.startswith("S("))
            exchange = "reduce_scatter" if split else "allreduce"
            parameters[fqn] = ParameterPlan(placement_text(chosen.outputs[0]), tensor_bytes(node.meta["val"]), exchange)
            memory["param"] += problem.node_memory[q][choice]
        elif kind == "buffer":
            buffers[captured.buffer_of[node.name]] = placement_text(chosen.outputs[0])
        elif kind in ("op", "input"):
            local = _local_costs(problem, solution.choice, q, incident.get(node.name, []))
            others = sorted((t for t in range(len(local)) if t != choice and math.isfinite(local[t])),
                            key=lambda t: (problem.node_costs[q][t] + local[t], t))[:_ALTERNATIVES]
            nodes[node.name] = NodePlan(
                op=str(node.target) if kind == "op" else "input",
                outputs=tuple(placement_text(p) for p in chosen.outputs),
                inputs=tuple(placement_text(p) for p in chosen.inputs),
                compute_s=problem.node_costs[q][choice],
                fallback=bool(index.fallback[q]),
                reshard_s=local[choice],
                alternatives=tuple({
                    "outputs": [placement_text(p) for p in index.strategies[q][t].outputs],
                    "inputs": [placement_text(p) for p in index.strategies[q][t].inputs],
                    "compute_s": problem.node_costs[q][t], "reshard_s": local[t],
                    "memory_delta_bytes": problem.node_memory[q][t] - problem.node_memory[q][choice],
                } for t in others),
                memory_bytes=problem.node_memory[q][choice], exchange=chosen.exchange)
            memory["act"] += problem.node_memory[q][choice]
    sparse = sparse_tables(captured, nodes, parameters, mesh)
    experts = expert_layers(captured, parameters, nodes, mesh)
    sent = _bytes_sent(captured, problem, index, solution.choice, mesh)
    compute_total = problem.compute(solution.choice)
    per_copy = memory["param"] // (2 + states)
    return Plan(
        fingerprint=captured.fingerprint,
        cluster={"spec": cluster.describe(), "device": cluster.device.name, "hosts": cluster.hosts,
                 "devices_per_host": cluster.devices_per_host, "memory_limit_bytes": cluster.memory_limit_bytes},
        mesh_shape=mesh.shape, mesh_dim_names=mesh.dim_names, inputs=tuple(captured.inputs),
        nodes=nodes, parameters=parameters, buffers=buffers,
        predicted_step_s=step_s if step_s is not None else solution.objective_s, predicted_compute_s=compute_total,
        predicted_comm_s=(step_s if step_s is not None else solution.objective_s) - compute_total,
        memory=MemoryBreakdown(per_copy, per_copy, per_copy * states, memory["act"]),
        solver={"name": "cpsat", "status": solution.status, "method": solution.method,
                "objective_s": solution.objective_s,
                "bound_s": solution.bound_s, "variables": solution.num_variables,
                "constraints": solution.num_constraints, "nodes": len(index.node_of),
                "gap": max(0.0, (solution.objective_s - solution.bound_s) / solution.objective_s)
                if solution.objective_s > 0 else 0.0,
                "variables_unclustered": _unclustered_variables(problem),
                "distinct_nodes": problem.num_nodes, "edges": len(index.edge_of),
                "distinct_edges": len(problem.edges)},
        mesh_candidates=tuple(candidates), options={"optimizer": optimizer}, baselines=baselines, sparse=sparse,
        experts=experts, comm_bytes=sent,
    )


def _bytes_sent(captured: Captured, problem: ShardingProblem, index: ProblemIndex, choice: list[int],
                mesh: MeshSpec) -> float:
    """Bytes one device sends per step under ``choice``: every reshard and gradient collective
    on its edge, and the sparse row exchanges of lookups."""
    total = sum(e.count * e.pair_bytes(choice[e.src], choice[e.dst]) for e in problem.edges)
    return total + lookup_exchange_s(captured, problem, index, choice, unit_links(mesh))
