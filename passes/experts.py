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
in contiguous blocks on devices; solvers.balance.balanced_order finds the order of experts (a
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
from autopar.passes.expert_mm import EXPERT_MM
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
    for node in graph.nodes:  # per-expert biases (E, out) beside the weights, gathered per row (GPT-OSS)
        fqn = captured.parameter_of.get(node.name)
        module = fqn.rsplit(".", 1)[0] if fqn and "." in fqn else ""
        if fqn is not None and module in by_module and node not in by_module[module] and _gathered_per_row(node):
            by_module[module].append(node)
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
    """Through reshapes to a ``bmm`` over the experts (grouped form) or to the weights of a
    per-row expert product (``autopar::expert_mm``, grouped-GEMM experts as
    passes.grouped_experts rewrites them), or through a gather of experts per token
    (``weight[ids]``, the "batched_mm" form of transformers' Mixtral) to a ``bmm`` over tokens."""
    for user in node.users:
        if user.target in _BATCHED and (gathered or user.meta["val"].shape[0] == experts):
            return True
        if user.target is EXPERT_MM and user.args[1] is node and not gathered:  # grouped GEMM, per row
            return True
        if depth > 0 and user.target in _RESHAPES and _reaches_batched_matmul(user, experts, depth - 1, gathered):
            return True
        if (depth > 0 and not gathered and user.target is aten.index.Tensor and user.args[0] is node
                and _reaches_batched_matmul(user, experts, depth - 1, True)):
            return True
    return False


def _gathered_per_row(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a parameter of two or more dims) is indexed by per-row ids: ``b[ids]``."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and any(
        user.target is aten.index.Tensor and user.args[0] is node and len(user.args[1]) == 1
        and isinstance(user.args[1][0], torch.fx.Node) and user.args[1][0].meta["val"].dim() == 1
        for user in node.users)


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
