"""Mixture-of-experts layers: find the stacked expert weights, measure each expert's load, and
place experts on devices so every device gets about the same number of tokens.

Experts are found in their grouped form (GShard, Switch, Megablocks' grouped GEMM): a
parameter of three or more dims whose dim 0 counts the experts and which reaches a batched
matmul (``bmm``, what ``einsum("egcd,edh->egch")`` exports to) through reshapes only — or
through a per-token gather of experts (``weight[ids]``, transformers' "batched_mm" Mixtral;
DTensor has no rule splitting the gathered dim: passes.expert_dispatch sends the rows to
their experts' owners instead). The
sharding ILP then already holds the three choices the MoE literature weighs: expert
parallelism (the weights ``Shard(0)`` over experts, tokens moved to their experts by an
all-to-all — DTensor's ``Shard(g) -> Shard(e)`` redistribute), expert-internal tensor
parallelism (the weights sharded on their hidden dim) and replication (data parallel,
gradients all-reduced). A ModuleList of identical experts behind a router is found after
passes.stack_experts batched it (its weights then reach the batched matmuls through stack
nodes of the E experts' parameters, which that pass lets live on their owners: "O").

The router (a ``topk`` over a last dim of the expert count inside the same module) evaluated
on the example inputs gives the tokens each expert receives. Expert parallelism puts experts
in contiguous blocks on devices; :func:`balanced_order` finds the order of experts (a
relabelling: the router's outputs and the stacked weights permuted alike, which changes
nothing in the model's function) whose contiguous blocks carry the most even load. A
ModuleList's experts, and stacked (E, ...) weights (their rows stored in that order), are
placed in that order when passes.expert_order's check on the example inputs passes; else the
order is advice in the plan.

Writes ``node.meta["autopar.experts"] = ExpertGroup(...)`` on the expert weights' placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.passes.capture import Captured
from autopar.passes.expert_dispatch import annotate_dispatches
from autopar.passes.expert_order import Relabel, find_relabel
from autopar.passes.stack_experts import STACKED_KEY
from autopar.passes.values import evaluate, real_values

EXPERTS_KEY = "autopar.experts"
aten = torch.ops.aten
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
             aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
             aten.clone.default, aten.contiguous.default, aten.alias.default}
_BATCHED = {aten.bmm.default, aten.baddbmm.default}


@dataclass(eq=False)
class ExpertGroup:
    """The stacked experts of one MoE layer."""

    module: str  # FQN of the module that holds the expert weights
    parameters: tuple[str, ...]  # FQNs of the stacked weights, dim 0 = expert
    experts: int
    top_k: int | None = None  # choices per token, when the router was found
    load: tuple[int, ...] | None = None  # tokens routed to each expert on the example inputs
    # "stacked": the model's own (E, ...) weights; "module_list": one module per expert, batched
    # by passes.stack_experts — ``parameters`` then names the stack nodes, each standing for
    # the E experts' weights of one name (``<module>.<e>.<name>``)
    form: str = "stacked"
    nodes: tuple[str, ...] = ()  # the graph nodes of the stacked weights (placeholders, or stack nodes)
    # experts whose router can be made to speak in slots (passes.expert_order): the planner may
    # then place them in a balanced order; None: the order stays advice
    relabel: Relabel | None = None

    @property
    def load_source(self) -> str:
        return "inputs" if self.load is not None else "uniform"


def annotate_experts(captured: Captured, example_inputs=None) -> list[ExpertGroup]:
    """Find expert groups, attach them to their weights' placeholders and return them."""
    graph = captured.graph
    by_module: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        fqn = captured.parameter_of.get(node.name)
        val = node.meta.get("val")
        if STACKED_KEY in node.meta:  # a ModuleList's expert weights, stacked by passes.stack_experts
            by_module.setdefault(_common_prefix(node.meta[STACKED_KEY]), []).append(node)
        if fqn is None or not isinstance(val, torch.Tensor) or val.dim() < 3 or val.shape[0] < 2:
            continue
        if _reaches_batched_matmul(node, val.shape[0]):
            by_module.setdefault(fqn.rsplit(".", 1)[0] if "." in fqn else "", []).append(node)
    groups = []
    values = None
    memo: dict = {}
    for module, weights in by_module.items():
        experts = weights[0].meta["val"].shape[0]
        weights = [w for w in weights if w.meta["val"].shape[0] == experts]
        router = _router(graph, module, experts)
        if any(STACKED_KEY in w.meta for w in weights) and router is None:
            continue  # identical modules batched, but no router chooses among them: not experts
        load = None
        if router is not None:
            if values is None:
                values = real_values(captured, example_inputs, parameters=True)
            chosen = evaluate(router, values, memo)
            if isinstance(chosen, tuple) and len(chosen) == 2:
                chosen = chosen[1]
            if isinstance(chosen, torch.Tensor):
                load = tuple(int(c) for c in torch.bincount(chosen.reshape(-1).long(), minlength=experts))
        form = "module_list" if STACKED_KEY in weights[0].meta else "stacked"
        relabel = None
        if load is not None and len(set(load)) > 1:  # a skewed router: the order may be placed
            if form == "module_list":
                relabel = find_relabel(graph, router, tuple(w.name for w in weights), values)
            else:
                relabel = find_relabel(graph, router, (), values, {w.name: captured.parameter_of[w.name] for w in weights})
        group = ExpertGroup(module, tuple(_fqns(captured, w) for w in weights), experts,
                            int(router.args[1]) if router is not None else None, load, form,
                            tuple(w.name for w in weights), relabel)
        for w in weights:
            w.meta[EXPERTS_KEY] = group
        groups.append(group)
    # experts gathered per token: the region their owners can run (passes.expert_dispatch)
    stacked = {w: g for g in groups if g.form == "stacked" for w in g.nodes}
    if stacked:
        if values is None and example_inputs is not None:
            values = real_values(captured, example_inputs, parameters=True)
        annotate_dispatches(graph, stacked, values, memo)
    return groups


def _fqns(captured: Captured, weights: torch.fx.Node) -> str:
    """The FQN of stacked weights: the parameter's, or for a ModuleList's batched experts the
    pattern ``<module>.*.<name>`` of the E weights the stack node gathers."""
    if STACKED_KEY not in weights.meta:
        return captured.parameter_of[weights.name]
    first = captured.parameter_of[weights.args[0][0].name]
    prefix = weights.meta[STACKED_KEY][0]
    return f"{_common_prefix(weights.meta[STACKED_KEY])}.*{first[len(prefix):]}"


def _common_prefix(prefixes) -> str:
    """``moe.experts`` of ``moe.experts.0`` … ``moe.experts.7``."""
    return prefixes[0].rsplit(".", 1)[0] if "." in prefixes[0] else ""


def _reaches_batched_matmul(node: torch.fx.Node, experts: int, depth: int = 8, gathered: bool = False) -> bool:
    """Through reshapes to a ``bmm`` over the experts (grouped form), or through a gather of
    experts per token (``weight[ids]``, the "batched_mm" form of transformers' Mixtral) to a
    ``bmm`` over tokens."""
    for user in node.users:
        if user.target in _BATCHED and (gathered or user.meta["val"].shape[0] == experts):
            return True
        if depth > 0 and user.target in _RESHAPES and _reaches_batched_matmul(user, experts, depth - 1, gathered):
            return True
        if (depth > 0 and not gathered and user.target is aten.index.Tensor and user.args[0] is node
                and _reaches_batched_matmul(user, experts, depth - 1, True)):
            return True
    return False


def _router(graph: torch.fx.Graph, module: str, experts: int) -> torch.fx.Node | None:
    """The ``topk`` node choosing among ``experts`` in ``module`` or the nearest module around
    it (a router beside an ``experts`` submodule, or in the model's own forward)."""
    best, depth = None, -1
    for node in graph.nodes:
        if node.target is not aten.topk.default:
            continue
        scores = node.args[0].meta.get("val")
        if not isinstance(scores, torch.Tensor) or scores.shape[-1] != experts:
            continue
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()] or [""]  # "": the model
        for path in paths:
            if (path == "" or module == path or module.startswith(f"{path}.")) and path.count(".") > depth:
                best, depth = node, path.count(".")
    return best


def device_loads(load: tuple[float, ...], order: list[int], devices: int) -> list[float]:
    """Tokens each device processes when the experts, in ``order``, are cut into ``devices``
    contiguous blocks (DTensor's ``Shard(0)``)."""
    per = len(order) // devices
    return [sum(load[e] for e in order[d * per:(d + 1) * per]) for d in range(devices)]


def balanced_order(load: tuple[float, ...], devices: int, time_limit_s: float = 2.0) -> list[int]:
    """An order of the experts whose contiguous blocks of ``len(load) / devices`` experts carry
    the most even load: CP-SAT minimises the busiest device's tokens (a small bin-packing
    with equal bin counts), warm-started from longest-processing-time first; within the time
    limit the best assignment found is used; the experts keep their order when that is as
    even. ``len(load)`` must be a multiple of ``devices``."""
    experts = len(load)
    per = experts // devices
    identity = list(range(experts))
    if devices <= 1 or len(set(load)) <= 1:
        return identity
    greedy = _longest_first(load, devices, per)
    solved = _solve_bins(load, devices, per, greedy, time_limit_s)
    orders = [[e for b in bins for e in sorted(b)] for bins in (solved, greedy)]
    # the best of the solver's and the greedy order; the experts stay where they are unless moving helps
    return min([identity, *orders], key=lambda o: (imbalance(device_loads(load, o, devices)), o != identity))


def _longest_first(load, devices: int, per: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(devices)]
    totals = [0.0] * devices
    for e in sorted(range(len(load)), key=lambda e: (-load[e], e)):
        d = min((d for d in range(devices) if len(bins[d]) < per), key=lambda d: (totals[d], d))
        bins[d].append(e)
        totals[d] += load[e]
    return bins


def _solve_bins(load, devices: int, per: int, hint: list[list[int]], time_limit_s: float) -> list[list[int]]:
    from ortools.sat.python import cp_model

    scale = 1 if all(float(x).is_integer() for x in load) else 1000
    weights = [int(round(x * scale)) for x in load]
    model = cp_model.CpModel()
    x = {(e, d): model.NewBoolVar(f"x{e}_{d}") for e in range(len(load)) for d in range(devices)}
    busiest = model.NewIntVar(0, sum(weights), "busiest")
    lightest = model.NewIntVar(0, sum(weights), "lightest")
    for e in range(len(load)):
        model.AddExactlyOne(x[e, d] for d in range(devices))
    for d in range(devices):
        model.Add(sum(x[e, d] for e in range(len(load))) == per)
        model.Add(sum(weights[e] * x[e, d] for e in range(len(load))) <= busiest)
        model.Add(sum(weights[e] * x[e, d] for e in range(len(load))) >= lightest)
    model.Minimize(busiest * (sum(weights) + 1) - lightest)  # the busiest first, then the spread
    owner = {e: d for d, b in enumerate(hint) for e in b}
    for (e, d), var in x.items():
        model.AddHint(var, owner[e] == d)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # deterministic
    if solver.Solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint
    return [[e for e in range(len(load)) if solver.Value(x[e, d])] for d in range(devices)]


def imbalance(loads: list[float]) -> float:
    """max / mean load; 1.0 is perfect balance."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0

