"""Hand-written configurations (DDP, FSDP, Megatron TP, TP × DP, context parallelism) as problems with their
parameters and inputs pinned: what a person would write, costed by the planner's own model
on the same mesh, so "plan vs best baseline" compares like with like
(``solvers.baselines`` holds the rules; this module maps them onto a captured graph).
"""

from __future__ import annotations

import dataclasses

from autopar import placements as pl
from autopar.plan import layer_of_path
from autopar.problem import ShardingProblem
from autopar.passes.capture import Captured
from autopar.passes.context_parallel import BALANCED_CAUSAL, SEQUENCE_SPLIT
from autopar.passes.cost import FUSED_ATTENTION
from autopar.passes.embedding_bag import bag_split_inputs
from autopar.passes.build_problem import ProblemIndex
from autopar.passes.sparse import LOOKUP_KEY
from autopar.solvers.baselines import Kept

NOT_EXPRESSIBLE = ("not expressible on this mesh (a placement it needs does not split evenly, or the model has "
                   "none of the layers it parallelises)")

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


def _batch_dims(captured: Captured, index: ProblemIndex, bags_split: bool = True) -> list[int | None]:
    """Batch dimension of each user input for the data-parallel baselines: the first dim whose
    size is the first input's leading size (DLRM's ids are (tables, batch, ids per bag)); the
    ids of bags of varying size split by bags (passes.embedding_bag.bag_split_inputs), as
    TorchRec's data-parallel input distribution gives each rank its own bags — unless not
    ``bags_split`` (row-wise tables: every lookup reads the whole batch's ids, DTensor's masked
    lookup routing each to its row's owner). Their offsets stay whole: a device reads the
    offsets of every bag to find its own (each bag's length needs the next bag's offset), as
    TorchRec's input distribution sends each rank its bags' lengths."""
    batch = captured.inputs[0].shape[0] if captured.inputs and captured.inputs[0].shape else None
    split = bag_split_inputs(captured.graph)[0]
    by_bags = split if bags_split else {}
    offsets = {bag.offsets for bag in split.values()}
    dims: list[int | None] = []
    for name, kind in zip(index.names, index.kinds):
        spec = next((t for t in captured.inputs if t.name == name), None) if kind == "input" else None
        if spec is not None and (name in by_bags or name in offsets):
            dims.append(0 if name in by_bags else None)
            continue
        dims.append(next((d for d, size in enumerate(spec.shape) if size == batch), None) if spec else None)
    return dims


def cost_baselines(captured: Captured, problem: ShardingProblem, index: ProblemIndex, engine, rules: dict
                   ) -> tuple[dict, list[int] | None]:
    """Hand-written configurations as fixed parameter and input placements, the rest optimised
    by the same model. Returns their predictions (infeasible ones with the reason) and the best
    feasible assignment (a warm start)."""
    result, best = {}, None
    for name, rule in rules.items():
        pinned = baseline_problem(captured, problem, index, name, rule)
        solution = engine.solve(pinned) if pinned is not None else None
        feasible = solution is not None and bool(solution.choice)
        result[name] = {"predicted_step_s": solution.objective_s if feasible else None, "feasible": feasible,
                        "memory_bytes": pinned.memory(solution.choice) if feasible else None}
        if not feasible:
            result[name]["reason"] = NOT_EXPRESSIBLE if pinned is None else "does not fit in memory"
        if feasible and (best is None or solution.objective_s < best.objective_s):
            best = solution
    return result, (best.choice if best else None)


def baseline_problem(captured: Captured, problem: ShardingProblem, index: ProblemIndex, name: str, rule
                     ) -> ShardingProblem | None:
    """``problem`` with the configuration ``rule`` fixed; None when it is not expressible.
    Hand-written configurations are dense: no sparse gradient exchange. DDP also keeps every
    embedding lookup on its batch shard (table replicated, gradient all-reduced), as
    DistributedDataParallel does, rather than letting the solver gather the ids."""
    fixed = rule(index.kinds, _leaf_options(index), _megatron_roles(captured, index),
                 _batch_dims(captured, index, bags_split=name != "row_wise"))
    if fixed is None:
        return None
    if name == "ddp":
        lookups = {n.name for n in captured.graph.nodes if LOOKUP_KEY in n.meta}
        for q, node_name in enumerate(index.names):
            if node_name in lookups:
                local = [t for t, s in enumerate(index.strategies[q]) if not s.exchange
                         and pl.is_replicated(s.inputs[0]) and all(p is pl.Shard(0) for p in s.inputs[1])]
                if local:
                    fixed = {**fixed, q: local[0]}
    if name == "context_parallel":  # attention splits its sequence wherever it can, as in torchtitan
        attention = _sequence_attention(captured, index)
        if not attention:  # no fused self-attention: there is no context to split
            return None
        fixed = {**fixed, **attention}
    return dataclasses.replace(problem, fixed=fixed, excluded=_sparse_exchanges(index))


def _sequence_attention(captured: Captured, index: ProblemIndex) -> dict[int, int]:
    """Attention nodes with a strategy splitting the sequence on every mesh dim of size > 1
    (passes.context_parallel) -> that strategy, load-balanced where it is causal (as
    torchtitan's context parallelism runs it)."""
    attention = {n.name for n in captured.graph.nodes if n.target is FUSED_ATTENTION}
    fixed = {}
    for q, name in enumerate(index.names):
        if name in attention:
            split = [t for t, s in enumerate(index.strategies[q]) if all(p == SEQUENCE_SPLIT for p in s.outputs[0])]
            if split:
                fixed[q] = max(split, key=lambda t: index.strategies[q][t].exchange == BALANCED_CAUSAL)
    return fixed


def _sparse_exchanges(index: ProblemIndex) -> frozenset[tuple[int, int]]:
    """(node, strategy) of every sparse-exchange lookup and expert dispatch: hand-written
    configurations are dense (balanced causal attention is no such exchange)."""
    return frozenset((i, t) for i, options in enumerate(index.strategies) for t, s in enumerate(options)
                     if s.exchange and s.exchange != BALANCED_CAUSAL)


def _leaf_options(index: ProblemIndex) -> list[list]:
    """Placement of each strategy of every input node, and of every parameter node with where
    its optimizer states live (baselines fix these)."""
    return [[Kept(s.outputs[0], s.stored) for s in options] if kind == "param"
            else [s.outputs[0] for s in options] if kind == "input" else []
            for kind, options in zip(index.kinds, index.strategies)]
