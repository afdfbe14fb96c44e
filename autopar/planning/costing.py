"""Re-costing a plan already made: its step time on another cluster (``recost``), the bytes
it sends (``communication_bytes``), its step time as a formula in the batch size
(``symbolic_costs``). Each rebuilds the sharding problem on the plan's mesh and fixes every
node to the strategy the plan records (``planned_problem``), so a plan is costed by the very
model that made it, without solving again.
"""

from __future__ import annotations

import sympy

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import MeshSpec, checked_mesh
from autopar.placements import format_spec
from autopar.plan import Plan
from autopar.planning.options import PlanOptions
from autopar.problem import ShardingProblem
from autopar.passes.capture import Captured
from autopar.passes.cost import annotate_costs
from autopar.passes.layer_recompute import recompute_mode
from autopar.passes.memory import annotate_saved
from autopar.passes.build_problem import ProblemIndex, annotate_strategies, build_problem
from autopar.passes.strategy_exchanges import strategy_exchange_s, table_wise_by_owners
from autopar.passes.reshard_cost import unit_links
from autopar.passes.stages import layer_order
from autopar.passes.symbolic import BATCH, annotate_symbolic, formula


def recost(captured: Captured, plan: Plan, cluster: Cluster, optimizer: str = "adamw") -> tuple[float, int]:
    """Predicted step time and per-device memory of ``plan``'s placements on another
    ``cluster`` with as many devices (e.g. a plan made without knowing a slow WAN link, costed
    on the real one). Every node keeps its planned strategy; raises BAD_PLAN if a placement is
    not one the model offers on that mesh. Memory is the busiest device's, and the table-wise
    exchange waits for the busiest owner (owners as the planner picks them)."""
    mesh = checked_mesh(cluster, plan.mesh_shape)
    problem, index, choice = planned_problem(captured, plan, cluster, mesh, optimizer)
    return priced(captured, problem, index, choice, mesh, optimizer)


def priced(captured: Captured, problem: ShardingProblem, index: ProblemIndex, choice: list[int], mesh: MeshSpec,
           optimizer: str) -> tuple[float, int]:
    """``choice``'s step time and busiest device's memory on ``problem``: the table-wise exchange
    waits for the busiest owner, whose tables it holds too (owners as the planner picks them)."""
    excess, spread_s = table_wise_by_owners(captured, index, choice, mesh, optimizer)
    return problem.evaluate(choice) + spread_s, problem.memory(choice) + excess


def communication_bytes(captured: Captured, plan: Plan, cluster: Cluster) -> float:
    """Bytes one device sends per training step under ``plan``: every collective of the plan
    (reshards, gradient reductions, sparse row exchanges) costed on a link of 1 byte/s
    without latency, so its time is its volume. Counts through the edges' costs, not the
    byte counts the planner records in ``plan.comm_bytes``, so each checks the other."""
    mesh = unit_links(checked_mesh(cluster, plan.mesh_shape))
    problem, index, choice = planned_problem(captured, plan, cluster, mesh)
    return problem.edge_comm(choice) + strategy_exchange_s(captured, problem, index, choice, mesh)


def symbolic_costs(captured: Captured, plan: Plan, cluster: Cluster, model, example_inputs) -> dict:
    """``plan``'s step time as a sympy expression in the batch size (passes.symbolic), with
    each op's FLOPs and bytes as formulas; goes into ``plan.symbolic``."""
    b0 = annotate_symbolic(captured, model, example_inputs)
    mesh = checked_mesh(cluster, plan.mesh_shape)
    problem, index, choice = planned_problem(captured, plan, cluster, mesh, plan.options.get("optimizer", "adamw"),
                                          symbolic=True)
    step = sympy.nsimplify(0) + problem.evaluate(choice) + table_wise_by_owners(captured, index, choice, mesh)[1]
    nodes = {n.name: formula(n) for n in captured.graph.nodes if n.name in plan.nodes and n.op == "call_function"}
    batch_inputs = [spec.name for spec in plan.inputs if spec.shape and spec.shape[0] == b0]
    return {"symbol": str(BATCH), "traced_batch": b0, "batch_inputs": batch_inputs, "step_s": str(step),
            "nodes": nodes}


def planned_problem(captured: Captured, plan: Plan, cluster: Cluster, mesh: MeshSpec, optimizer: str = "adamw",
                     symbolic: bool = False) -> tuple[ShardingProblem, ProblemIndex, list[int]]:
    """The sharding problem of ``captured`` on ``mesh`` and the strategy ``plan`` chose for each node."""
    if plan.family != "one_mesh":
        raise AutoparError(ErrorKind.BAD_PLAN, "re-costing plans over several device groups is not supported yet; "
                           "re-plan instead")
    annotate_costs(captured.graph)
    annotate_saved(captured.graph)
    annotate_strategies(captured, mesh.shape)
    try:
        recompute = recompute_mode(layer_order(captured.graph), plan.recompute)
    except ValueError as exc:
        raise AutoparError(ErrorKind.BAD_PLAN, f"{exc}; re-plan") from None
    problem, index = build_problem(captured, mesh, cluster.device, cluster.memory_limit_bytes, optimizer,
                                   symbolic=symbolic, recompute=recompute,
                                   loss_on_outputs=True,
                                   **PlanOptions.of_plan(plan).problem_overlap(cluster.device))
    return problem, index, plan_choice(captured, plan, index, f"mesh {list(mesh.shape)} of {cluster.describe()}")


def plan_choice(captured: Captured, plan: Plan, index: ProblemIndex, where: str) -> list[int]:
    """The strategy ``plan`` chose for each node of a problem (its ``index``) built on the
    plan's mesh shape; BAD_PLAN naming the node when a placement is not offered ``where``."""
    choice = []
    for q, (name, kind) in enumerate(zip(index.names, index.kinds)):
        options = index.strategies[q]
        if kind == "param":
            wanted = plan.parameters[captured.parameter_of[name]]
            match = [t for t, s in enumerate(options) if format_spec(s.outputs[0]) == wanted.placement
                     and format_spec(s.stored) == (wanted.optimizer_state or wanted.placement)]
        elif kind == "output" and plan.outputs:
            match = [t for t, s in enumerate(options) if tuple(format_spec(p) for p in s.inputs) == plan.outputs]
        elif kind == "buffer" or kind == "output":
            match = [0]
        else:
            node = plan.nodes.get(name)
            if node is None:
                raise AutoparError(ErrorKind.BAD_PLAN, f"node {name} of this graph is not in the plan (the plan was "
                                   "made for a different graph)")
            match = [t for t, s in enumerate(options) if tuple(format_spec(p) for p in s.outputs) == node.outputs
                     and tuple(format_spec(p) for p in s.inputs) == node.inputs and s.exchange == node.exchange]
        if not match:
            raise AutoparError(ErrorKind.BAD_PLAN, f"node {name}: its planned placement is not available on {where}")
        choice.append(match[0])
    return choice
