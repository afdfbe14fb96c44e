"""A solved mesh as a :class:`autopar.plan.Plan`: every graph node (copies of repeated layers
included) with its problem node's placements and alternatives, every parameter with its
placement and optimizer state, the memory breakdown, the time split (compute,
communication, exposed after overlap), the bytes sent, and the solver's account. The
one-mesh search (autopar.planning.one_mesh) makes it for the best mesh it finds.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.cluster import Cluster
from autopar.mesh import MeshSpec
from autopar.placements import format_spec, is_replicated
from autopar.plan import MemoryBreakdown, NodePlan, ParameterPlan, Plan
from autopar.planning.options import PlanOptions
from autopar.planning.sections import expert_layers, sparse_tables
from autopar.problem import ShardingProblem, Solution
from autopar.passes.capture import Captured
from autopar.passes.layer_recompute import recomputed_layers
from autopar.passes.stages import layer_order, node_layer
from autopar.passes.cost import tensor_bytes
from autopar.passes.build_problem import OUTPUT, ProblemIndex
from autopar.passes.strategy_exchanges import strategy_exchange_s
from autopar.passes.reshard_cost import unit_links


def _unclustered_variables(problem: ShardingProblem) -> int:
    """Variables the ILP would have without folding repeated layers (x per node and strategy,
    y per allowed class pair of edges with several classes on both sides)."""
    total = sum(problem.count(i) * len(costs) for i, costs in enumerate(problem.node_costs))
    for e in problem.edges:
        if len(set(e.src_class)) > 1 and len(set(e.dst_class)) > 1:
            total += e.count * sum(c is not None for row in e.cost for c in row)
    return total


_ALTERNATIVES = 4


def replicated_on_one_device(problem: ShardingProblem, index: ProblemIndex, solution: Solution) -> Solution:
    """``solution`` of a one-device mesh with every node that can moved to its cheapest
    strategy placing everything replicated, where that costs no more time or memory: on one
    device a split, a partial sum and the whole tensor are the same values, so the solver
    settles their ties arbitrarily — and the lowered program then carries DTensor splits of one
    device for nothing (a batch norm placed so met a DTensor gap, session 33). Kept only
    where the whole assignment costs no more (every reshard between replicated tensors is free)
    and still fits; else ``solution`` as it is."""
    choice = list(solution.choice)
    for i, s in enumerate(solution.choice):
        if i in problem.fixed:
            continue
        whole = [t for t, strategy in enumerate(index.strategies[i])
                 if all(spec is None or is_replicated(spec) for spec in (*strategy.outputs, *strategy.inputs))
                 and (strategy.state is None or is_replicated(strategy.state)) and not strategy.exchange]
        if whole:
            t = min(whole, key=lambda t: (problem.node_costs[i][t], problem.node_memory[i][t]))
            if problem.node_costs[i][t] <= problem.node_costs[i][s] and \
                    problem.node_memory[i][t] <= problem.node_memory[i][s]:
                choice[i] = t
    if choice == solution.choice:
        return solution
    objective_s = problem.evaluate(choice)
    if objective_s > solution.objective_s * (1 + 1e-12) or problem.memory(choice) > problem.memory_limit_bytes:
        return solution
    return dataclasses.replace(solution, choice=choice, objective_s=objective_s)


def _local_costs(problem: ShardingProblem, choice: list[int], q: int, incident) -> list[float]:
    """Resharding time on one graph node's edges for each strategy of its problem node ``q``,
    every neighbour as chosen — paying the reshard also where the solver's coarsening keeps
    a view on its producer's placement, so every node can show its alternatives.
    ``incident``: (problem edge, node is its producer) pairs."""
    costs = []
    for t in range(len(problem.node_costs[q])):
        total = 0.0
        for e, as_producer in incident:
            s_src = t if as_producer else choice[e.src]
            s_dst = choice[e.dst] if as_producer else t
            total += e.reshard_cost(s_src, s_dst)
        costs.append(total)
    return costs


def to_plan(captured: Captured, cluster: Cluster, mesh: MeshSpec, problem: ShardingProblem, solution: Solution,
             index: ProblemIndex, candidates, options: PlanOptions, baselines: dict, table_excess: int = 0,
             step_s: float | None = None, timings: dict[str, float] | None = None) -> Plan:
    """Every graph node (copies of repeated layers included) gets its problem node's choice.
    ``table_excess``: bytes the busiest table-wise owner holds beyond the even split the
    problem charged (the plan's memory is the busiest device's); ``step_s``: the step time
    with the table-wise owners' real spread (default: the solver's objective)."""
    incident: dict[str, list] = {}
    for (producer, consumer, _arg), k in index.edge_of.items():
        incident.setdefault(producer, []).append((k, True))
        incident.setdefault(consumer, []).append((k, False))
    # a repeated layer's copies share their problem node and edges: their costs once
    local_costs: dict[tuple, list[float]] = {}
    nodes, parameters, buffers = {}, {}, {}
    # the busiest table-wise owner's excess is master weights, gradients and states alike
    excess = table_excess // (2 + options.optimizer_states)
    memory = {"param": table_excess - excess * (1 + options.optimizer_states), "grad": excess,
              "states": excess * options.optimizer_states, "act": 0, "act_kept": 0, "rerun_s": 0.0,
              "rerun_buffer": 0}
    for position, node in enumerate(captured.graph.nodes):
        q = index.node_of.get(node.name)
        if q is None:
            continue
        choice = solution.choice[q]
        chosen = index.strategies[q][choice]
        kind = index.kinds[q]
        if kind == "param":
            fqn = captured.parameter_of[node.name]
            exchange = "reduce_scatter" if any(p.is_shard for p in chosen.stored) else "allreduce"
            parameters[fqn] = ParameterPlan(format_spec(chosen.outputs[0]), tensor_bytes(node.meta["val"]), exchange,
                                            optimizer_state=format_spec(chosen.stored))
            held = index.parameter_memory[q][choice]
            memory["param"] += held.master + held.working
            memory["grad"] += held.grad
            memory["states"] += held.states
        elif kind == "buffer":
            buffers[captured.buffer_of[node.name]] = format_spec(chosen.outputs[0])
        elif kind in ("op", "input"):
            key = (q, tuple(incident.get(node.name, ())))
            if key not in local_costs:
                local_costs[key] = _local_costs(problem, solution.choice, q,
                                                [(problem.edges[k], producer) for k, producer in key[1]])
            local = local_costs[key]
            others = sorted((t for t in range(len(local)) if t != choice and math.isfinite(local[t])),
                            key=lambda t: (problem.node_costs[q][t] + local[t], t))[:_ALTERNATIVES]
            nodes[node.name] = NodePlan(
                op=str(node.target) if kind == "op" else "input",
                outputs=tuple(format_spec(p) for p in chosen.outputs),
                inputs=tuple(format_spec(p) for p in chosen.inputs),
                compute_s=problem.node_costs[q][choice],
                fallback=bool(index.fallback[q]),
                reshard_s=local[choice],
                alternatives=tuple({
                    "outputs": [format_spec(p) for p in index.strategies[q][t].outputs],
                    "inputs": [format_spec(p) for p in index.strategies[q][t].inputs],
                    "compute_s": problem.node_costs[q][t], "reshard_s": local[t],
                    "memory_delta_bytes": problem.node_memory[q][t] - problem.node_memory[q][choice],
                } for t in others),
                memory_bytes=problem.node_memory[q][choice], exchange=chosen.exchange,
                layer=node_layer(node) or "", position=position)
            memory["act"] += problem.node_memory[q][choice]
            memory["act_kept"] += index.kept_without_recompute.get(q, problem.node_memory[q])[choice]
            memory["rerun_s"] += index.rerun_s[q][choice] if q in index.rerun_s else 0.0
            memory["rerun_buffer"] += index.rerun_buffer[q][choice] if q in index.rerun_buffer else 0
    out = index.node_of[OUTPUT]
    sink = index.strategies[out][solution.choice[out]]
    memory["act"] += problem.node_memory[out][solution.choice[out]]  # the loss's copy and gradient (passes.node_memory)
    memory["act_kept"] += problem.node_memory[out][solution.choice[out]]
    outputs = () if all(is_replicated(spec) for spec in sink.inputs) else tuple(format_spec(s) for s in sink.inputs)
    sparse = sparse_tables(captured, nodes, parameters, mesh)
    experts = expert_layers(captured, parameters, nodes, mesh)
    sent = _bytes_sent(captured, problem, index, solution.choice, mesh)
    communication = problem.own_comm(solution.choice)
    compute_total = problem.compute(solution.choice) - communication
    communication += problem.edge_comm(solution.choice)
    step_s = step_s if step_s is not None else solution.objective_s
    recomputed = recomputed_layers(layer_order(captured.graph), options.recompute)
    return Plan(
        fingerprint=captured.fingerprint,
        cluster=cluster.plan_header(),
        mesh_shape=mesh.shape, mesh_dim_names=mesh.dim_names, inputs=tuple(captured.inputs),
        nodes=nodes, parameters=parameters, buffers=buffers,
        predicted_step_s=step_s, predicted_compute_s=compute_total,
        predicted_comm_s=communication + step_s - solution.objective_s,  # the table-wise owners' spread too
        predicted_exposed_comm_s=step_s - compute_total,
        memory=MemoryBreakdown(memory["param"], memory["grad"], memory["states"], memory["act"],
                               problem.held_bytes(solution.choice)),
        solver={"name": options.solver, "status": solution.status, "method": solution.method,
                "objective_s": solution.objective_s,
                "bound_s": solution.bound_s, "variables": solution.num_variables,
                "constraints": solution.num_constraints, "nodes": len(index.node_of),
                "gap": max(0.0, (solution.objective_s - solution.bound_s) / solution.objective_s)
                if solution.objective_s > 0 else 0.0,
                "variables_unclustered": _unclustered_variables(problem),
                "distinct_nodes": problem.num_nodes, "edges": len(index.edge_of),
                "distinct_edges": len(problem.edges)},
        mesh_candidates=tuple(candidates), options=options.recorded(), baselines=baselines, sparse=sparse,
        recompute=recomputed,
        recompute_cost={"rerun_s": memory["rerun_s"], "activations_kept_bytes": memory["act_kept"],
                        "rerun_buffer_bytes": memory["rerun_buffer"]}
        if recomputed else {},
        experts=experts, comm_bytes=sent, timings=timings, outputs=outputs,
        overlap=_overlap_summary(problem, index, solution.choice),
    )


def _overlap_summary(problem: ShardingProblem, index: ProblemIndex, choice: list[int]) -> dict:
    """The plan's ``overlap``: the device's efficiency (per collective kind where measured) and,
    per layer group in the order the graph runs them (repeated layers once, with their copies),
    each phase's compute, overlappable communication and that communication weighted by its
    kinds' η (what overlap can hide: min(compute, weighted), in all copies but the first
    layer's ``exposed_copies``) — what ``show``, the HTML report and ``show --trace`` draw."""
    times = problem.group_times(choice)
    layers = [{"layer": name, "copies": problem.group_copies(g),
               "forward": list(times.get((g, "forward"), (0.0, 0.0, 0.0))),
               "backward": list(times.get((g, "backward"), (0.0, 0.0, 0.0))),
               **({"exposed_copies": 1} if g == problem.exposed_group else {})}
              for g, name in enumerate(index.group_names)]
    summary = {"efficiency": problem.overlap_efficiency, "layers": layers}
    if problem.collective_overlap:
        summary["by_collective"] = dict(problem.collective_overlap)
    return summary


def _bytes_sent(captured: Captured, problem: ShardingProblem, index: ProblemIndex, choice: list[int],
                mesh: MeshSpec) -> float:
    """Bytes one device sends per step under ``choice``: every reshard and gradient collective
    on its edge, and the sparse row exchanges of lookups."""
    total = sum(e.count * e.pair_bytes(choice[e.src], choice[e.dst]) for e in problem.edges)
    return total + strategy_exchange_s(captured, problem, index, choice, unit_links(mesh))
