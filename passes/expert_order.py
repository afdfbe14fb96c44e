"""Put experts on devices in a load-balancing order, not the model's.

Expert parallelism gives device d the experts of slots ``d·E/n … (d+1)·E/n − 1``. With a
skewed router the model's own order can pile the busy experts on one device;
solvers.balance.balanced_order finds an order whose blocks carry even loads. Applying it is a
relabelling of the experts: slot j computes expert ``order[j]``. Two edits do it:

  * the weights in slot order. A ModuleList's batched experts (passes.stack_experts): every
    stack node of the experts' weights stacks them in slot order — the parameters stay the
    model's own, each expert's weights move to the device of its slot. Stacked (E, ...)
    weights: their rows are stored in slot order (``permuted``), so ``Shard(0)`` gives
    device d the d-th block of the balanced order; ``runtime.full_value`` (and with it
    ``ParallelModule.full_state_dict``) gives them back in the model's order;
  * the router speaks in slots: either its scores are permuted along the expert dim
    (``scores[..., order]``: everything derived from them — probabilities, top-k choices,
    one-hot dispatch, gates — then follows), or, when the scores themselves are used
    elsewhere (returned for an auxiliary loss, biased by a per-expert tensor), the chosen
    expert ids are mapped to their slots.

Whether an edit keeps the model's function cannot be read off every router, so it is
tested: the model is evaluated on the example inputs with the experts relabelled by a cyclic
shift (stacked weights' rows shifted alike) and must give the same outputs. The first point that passes is recorded on the group
(``ExpertGroup.relabel``); none passing (or no real values to test with) leaves the order
as advice in the plan.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from autopar.passes.dtensor_ops import inverse_order, relabel_experts
from autopar.passes.values import evaluate

aten = torch.ops.aten
SCORES, IDS = "scores", "ids"
_RELATIVE_TOLERANCE = 1e-4  # round-off of summing experts in another order; a wrong relabelling is O(1)


@dataclass(frozen=True)
class Relabel:
    """Where the router is made to speak in slots, the stack nodes to reorder and the stacked
    parameters whose rows are stored in slot order."""

    node: str  # the router's scores (last dim = experts) or the top-k's chosen ids
    kind: str  # SCORES or IDS
    stacks: tuple[str, ...]
    permuted: tuple[str, ...] = ()  # FQNs of stacked (E, ...) expert weights

    def to_plan(self) -> dict:
        """The plan's ``relabel`` entry of an MoE layer (plain JSON)."""
        return {"node": self.node, "kind": self.kind, "stacks": list(self.stacks), "permuted": list(self.permuted)}

    @classmethod
    def from_plan(cls, entry: dict) -> "Relabel":
        return cls(entry["node"], entry["kind"], tuple(entry["stacks"]), tuple(entry.get("permuted", ())))


def find_relabel(graph: torch.fx.Graph, router: torch.fx.Node, stacks: tuple[str, ...],
                 values: dict[str, torch.Tensor], permuted: dict[str, str] | None = None) -> Relabel | None:
    """The first relabelling point that keeps the model's outputs on ``values`` (placeholder
    name -> real tensor): the router's logits, the top-k's input, then the chosen ids.
    ``permuted``: placeholder -> FQN of the stacked expert weights stored in slot order."""
    experts = router.args[0].meta["val"].shape[-1]
    shift = [(e + 1) % experts for e in range(experts)]
    permuted = permuted or {}
    reference = _outputs(graph, values)
    if reference is None or any(values.get(p) is None for p in permuted):
        return None
    shifted = {**values, **{p: values[p][shift] for p in permuted}}
    for node, kind in _candidates(router):
        relabel = Relabel(node.name, kind, stacks, tuple(permuted.values()))
        copy = _copy(graph)
        apply_relabel(copy, relabel, shift)
        outputs = _outputs(copy, shifted)
        if outputs is not None and _same(reference, outputs):
            return relabel
    return None


def apply_relabel(graph: torch.fx.Graph, relabel: Relabel, order: list[int]) -> bool:
    """Edit ``graph`` in place so slot j computes expert ``order[j]``; False (and no edit)
    when ``graph`` lacks the router or the stacks (a pipeline stage without this layer)."""
    by_name = {n.name: n for n in graph.nodes}
    if relabel.node not in by_name or any(s not in by_name for s in relabel.stacks):
        return False
    for name in relabel.stacks:
        stack = by_name[name]
        weights = list(stack.args[0])
        stack.args = ([weights[e] for e in order], *stack.args[1:])
    point = by_name[relabel.node]
    slots = order if relabel.kind == SCORES else inverse_order(order)
    with graph.inserting_after(point):
        moved = graph.call_function(relabel_experts, (point, slots, relabel.kind))
    moved.meta["val"] = point.meta.get("val")
    for user in list(point.users):
        if user is not moved:
            user.replace_input_with(point, moved)
    return True


def _candidates(router: torch.fx.Node) -> list[tuple[torch.fx.Node, str]]:
    """The router's logits (walking up from the top-k's input through ops with one tensor
    input of the same last dim), the top-k's input, and the top-k's ids (its output 1)."""
    scores = router.args[0]
    experts = scores.meta["val"].shape[-1]
    earliest = scores
    while earliest.op == "call_function":
        inputs = [a for a in earliest.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(inputs) != 1 or inputs[0].meta["val"].dim() == 0 or inputs[0].meta["val"].shape[-1] != experts:
            break
        earliest = inputs[0]
    found = [(earliest, SCORES), (scores, SCORES)]
    found += [(user, IDS) for user in router.users if user.target is operator.getitem and user.args[1] == 1]
    return list(dict.fromkeys(found))


def _copy(graph: torch.fx.Graph) -> torch.fx.Graph:
    copy = torch.fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy


def _outputs(graph: torch.fx.Graph, values: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
    nodes = [a for a in graph.output_node().all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    memo: dict = {}
    outputs = [evaluate(n, values, memo) for n in nodes]
    return outputs if outputs and all(isinstance(o, torch.Tensor) for o in outputs) else None


def _same(reference: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    for a, b in zip(reference, outputs, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return False
            continue
        scale = float(a.abs().max()) if a.numel() else 0.0
        if a.numel() and float((a - b).abs().max()) > _RELATIVE_TOLERANCE * max(scale, 1e-12):
            return False
    return True

