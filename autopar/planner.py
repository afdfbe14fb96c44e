"""Planning pipeline: capture → costs → strategies per candidate mesh → solve → Plan.

Every candidate mesh (1-D, and 2-D with the inner dim inside a host) is solved and the
fastest feasible plan wins; ties keep the earlier (simpler) mesh, so results are stable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import MeshSpec, candidate_meshes, mesh_for_shape
from autopar.plan import MemoryBreakdown, NodePlan, ParameterPlan, Plan
from autopar.units import format_bytes
from autopar.problem import ShardingProblem, Solution
from autopar.passes.capture import Captured
from autopar.passes.layers import find_repeated_layers, layer_of_path
from autopar.passes.cost import annotate_costs, tensor_bytes
from autopar.passes.problem import OPTIMIZER_STATES, ProblemIndex, build_problem
from autopar.passes.strategies import FALLBACK_KEY, enumerate_strategies
from autopar.solvers import get_solver
from autopar.solvers.baselines import BASELINES, BASELINES_2D

log = logging.getLogger(__name__)


def make_plan(captured: Captured, cluster: Cluster, *, optimizer: str = "adamw", solver: str = "cpsat",
              time_limit_s: float = 60.0, mesh_shape: tuple[int, ...] | None = None,
              cluster_layers: bool = True) -> Plan:
    if optimizer not in OPTIMIZER_STATES:
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATES)}")
    start = time.perf_counter()
    annotate_costs(captured.graph)
    meshes = [mesh_for_shape(cluster, _checked_shape(mesh_shape, cluster))] if mesh_shape else candidate_meshes(cluster)
    engine = get_solver(solver, time_limit_s=time_limit_s)
    repeated = find_repeated_layers(captured) if cluster_layers else {}
    best = None
    candidates, lower_bounds = [], []
    baselines = {}
    for mesh in meshes:
        enumerate_strategies(captured.graph, mesh.shape)
        problem, index = build_problem(captured, mesh, cluster.device, cluster.memory_limit_bytes, optimizer,
                                       repeated)
        rules = BASELINES if len(mesh.shape) == 1 else BASELINES_2D
        found, hint = _baselines(problem, index, engine, _megatron_roles(captured, index), rules)
        for name, entry in found.items():  # each baseline keeps its best mesh
            old = baselines.get(name)
            if old is None or entry["feasible"] and (not old["feasible"] or
                                                     entry["predicted_step_s"] < old["predicted_step_s"]):
                baselines[name] = entry
        solution = engine.solve(problem, hint=hint)  # warm start: a time limit keeps it ≥ the best baseline
        candidates.append({"mesh_shape": list(mesh.shape), "status": solution.status,
                           "predicted_step_s": solution.objective_s if solution.choice else None})
        if not solution.choice:
            lower_bounds.append(sum(min(m) for m in problem.node_memory))
            continue
        if best is None or solution.objective_s < best[2].objective_s * (1 - 1e-9):
            best = (mesh, problem, solution, index)
    for name in (*BASELINES, *BASELINES_2D):  # e.g. no 2-D mesh on this cluster
        baselines.setdefault(name, {"predicted_step_s": None, "feasible": False})
    if best is None:
        raise _infeasible(cluster, min(lower_bounds) if lower_bounds else 0, candidates)
    mesh, problem, solution, index = best
    plan = _to_plan(captured, cluster, mesh, problem, solution, index, candidates, optimizer, baselines)
    object.__setattr__(plan, "timings", {"plan_s": time.perf_counter() - start, "solve_s": solution.solve_s})
    log.info("plan: mesh %s, predicted step %.3g s, %s", mesh.shape, plan.predicted_step_s, solution.status)
    return plan


def _megatron_roles(captured: Captured, index: ProblemIndex) -> list[str | None]:
    """Linear layers of each repeated layer (or of the whole model), in order of use, alternate
    column- and row-parallel, as Megatron pairs qkv/proj and fc/out."""
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
    roles = []
    for name, kind in zip(index.names, index.kinds):
        path = linear_of.get(name) if kind == "param" else None
        if path is None:
            roles.append(None)
            continue
        side = "column" if position[path] % 2 == 0 else "row"
        roles.append(f"{side}_{'weight' if captured.parameter_of[name].endswith('weight') else 'bias'}")
    return roles


def _baselines(problem: ShardingProblem, index: ProblemIndex, engine, roles,
               rules: dict) -> tuple[dict, list[int] | None]:
    """Hand-written configurations as fixed parameter and input placements, the rest optimised
    by the same model. Returns their predictions and the best feasible assignment (a warm start)."""
    leaf_options = [[",".join(s.outputs[0]) for s in options] if kind in ("param", "input") else []
                    for kind, options in zip(index.kinds, index.strategies)]
    result, best = {}, None
    for name, rule in rules.items():
        fixed = rule(index.kinds, leaf_options, roles)
        solution = engine.solve(dataclasses.replace(problem, fixed=fixed)) if fixed is not None else None
        feasible = solution is not None and bool(solution.choice)
        result[name] = {"predicted_step_s": solution.objective_s if feasible else None, "feasible": feasible}
        if feasible and (best is None or solution.objective_s < best.objective_s):
            best = solution
    return result, (best.choice if best else None)


def _checked_shape(shape, cluster: Cluster) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != cluster.num_devices or any(s < 1 for s in shape):
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"mesh_shape {shape} has {math.prod(shape)} devices but the cluster has "
                           f"{cluster.num_devices}; use a factorisation of {cluster.num_devices}")
    return shape


def _infeasible(cluster: Cluster, needed: int, candidates) -> AutoparError:
    limit = cluster.memory_limit_bytes
    return AutoparError(
        ErrorKind.INFEASIBLE_MEMORY,
        f"no plan fits in memory on {cluster.describe()}: even the most sharded placement needs at least "
        f"{needed} bytes ({format_bytes(needed)}) per device, each device has {limit} bytes "
        f"({format_bytes(limit)}); {max(needed - limit, 0)} bytes over (meshes tried: "
        f"{[c['mesh_shape'] for c in candidates]}). Fixes: 1) more devices, 2) a smaller batch, "
        "3) a larger memory_limit or devices with more memory, 4) an optimizer with less state (sgd)")


_ALTERNATIVES = 4


def _local_costs(problem: ShardingProblem, choice: list[int], i: int, edges) -> list[float]:
    """Resharding time on node i's edges for each of its strategies, every neighbour as chosen."""
    costs = []
    for t in range(len(problem.node_costs[i])):
        total = 0.0
        for e in edges:
            s_src = t if e.src == i else choice[e.src]
            s_dst = t if e.dst == i else choice[e.dst]
            total += e.pair_cost(s_src, s_dst)
        costs.append(total)
    return costs


def _joined(placement) -> str | None:
    return None if placement is None else ",".join(placement)


def _to_plan(captured: Captured, cluster: Cluster, mesh: MeshSpec, problem: ShardingProblem, solution: Solution,
             index: ProblemIndex, candidates, optimizer: str, baselines: dict) -> Plan:
    nodes_by_name = {n.name: n for n in captured.graph.nodes}
    edges_of: dict[int, list] = {i: [] for i in range(problem.num_nodes)}
    for e in problem.edges:
        edges_of[e.src].append(e)
        edges_of[e.dst].append(e)
    nodes, parameters, buffers = {}, {}, {}
    compute_total = 0.0
    memory = {"param": 0, "act": 0}
    states = OPTIMIZER_STATES[optimizer]
    for i, name in enumerate(index.names):
        chosen = index.strategies[i][solution.choice[i]]
        kind = index.kinds[i]
        compute_total += problem.node_costs[i][solution.choice[i]]
        if kind == "param":
            fqn = captured.parameter_of[name]
            val = nodes_by_name[name].meta["val"]
            split = tuple(d for d, p in enumerate(chosen.outputs[0]) if p.startswith("S("))
            exchange = "reduce_scatter" if split else "allreduce"
            parameters[fqn] = ParameterPlan(_joined(chosen.outputs[0]), tensor_bytes(val), exchange)
            memory["param"] += problem.node_memory[i][solution.choice[i]]
        elif kind == "buffer":
            buffers[captured.buffer_of[name]] = _joined(chosen.outputs[0])
        elif kind in ("op", "input"):
            node = nodes_by_name[name]
            local = _local_costs(problem, solution.choice, i, edges_of[i])
            chosen_reshard = local[solution.choice[i]]
            others = sorted((t for t in range(len(local)) if t != solution.choice[i] and math.isfinite(local[t])),
                            key=lambda t: (problem.node_costs[i][t] + local[t], t))[:_ALTERNATIVES]
            nodes[name] = NodePlan(
                op=str(node.target) if kind == "op" else "input",
                outputs=tuple(_joined(p) for p in chosen.outputs),
                inputs=tuple(_joined(p) for p in chosen.inputs),
                compute_s=problem.node_costs[i][solution.choice[i]],
                fallback=bool(node.meta.get(FALLBACK_KEY, False)),
                reshard_s=chosen_reshard,
                alternatives=tuple({
                    "outputs": [_joined(p) for p in index.strategies[i][t].outputs],
                    "inputs": [_joined(p) for p in index.strategies[i][t].inputs],
                    "compute_s": problem.node_costs[i][t], "reshard_s": local[t],
                    "memory_delta_bytes": problem.node_memory[i][t] - problem.node_memory[i][solution.choice[i]],
                } for t in others))
            memory["act"] += problem.node_memory[i][solution.choice[i]]
    per_copy = memory["param"] // (2 + states)
    return Plan(
        fingerprint=captured.fingerprint,
        cluster={"spec": cluster.describe(), "device": cluster.device.name, "hosts": cluster.hosts,
                 "devices_per_host": cluster.devices_per_host, "memory_limit_bytes": cluster.memory_limit_bytes},
        mesh_shape=mesh.shape, mesh_dim_names=mesh.dim_names, inputs=tuple(captured.inputs),
        nodes=nodes, parameters=parameters, buffers=buffers,
        predicted_step_s=solution.objective_s, predicted_compute_s=compute_total,
        predicted_comm_s=solution.objective_s - compute_total,
        memory=MemoryBreakdown(per_copy, per_copy, per_copy * states, memory["act"]),
        solver={"name": "cpsat", "status": solution.status, "objective_s": solution.objective_s,
                "bound_s": solution.bound_s, "variables": solution.num_variables,
                "constraints": solution.num_constraints, "nodes": problem.num_nodes,
                "gap": max(0.0, (solution.objective_s - solution.bound_s) / solution.objective_s)
                if solution.objective_s > 0 else 0.0,
                "distinct_nodes": problem.num_nodes - len(problem.same_as)},
        mesh_candidates=tuple(candidates), options={"optimizer": optimizer}, baselines=baselines,
    )
