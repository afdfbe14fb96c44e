"""Expert parallelism for experts gathered per token (transformers' "batched_mm" experts), and
for grouped-GEMM experts written per row (passes.grouped_experts: ``expert_mm(x, w, ids)``).

Such a layer picks each (token, choice) row's expert weights with a gather, ``w[ids]`` (one
copy of the expert's matrix per row), and multiplies row by row (``bmm``) — or multiplies
each row by its expert's matrix in one op (``expert_mm``, which the same rules treat as a
gather of ``w`` by ``ids``). DTensor has no
rule that splits the gathered dim, so on its own the ILP can only replicate those experts or
split them inside. Expert parallelism needs the rows to travel to the device that owns their
expert: Megatron's all-to-all token dispatcher. Here it is one fused region:

  * the **segment**: the nodes from the gathers on whose every output has one row per
    (token, choice) and that compute each row on its own (gathers, batched matmuls,
    activations, the routing weights' product…; checked op by op and, with real values, by
    permuting the rows);
  * its **dispatch** (lowered by ``expert_runtime.dispatch_experts``): each device sends its rows
    (and their ids) to the owner of their expert along one mesh dim — one
    ``all_to_all_single`` with the counts exchanged first — the owner runs the segment on
    them with its block of every gathered weight (``Shard(0)``: E/n experts each), and the
    results come back the same way into the rows' own order. Backward is the reverse
    exchange; each weight's gradient stays with its owner.

For the ILP the choice is a marker placement, ``D`` (autopar.placements.Dispatched), on the
ids node: twins of its strategies put ``D`` on a mesh dim where the ids are split by rows, and
twins of the gathers take ``D`` ids with their weight ``Shard(0)`` on that dim
(:func:`add_expert_dispatch`). ``D`` converts to nothing else (passes.build_problem), so the ids' consumers — every gather — take
the twins together. The ids twin carries the exchange's time (the rows there and back,
forward and backward) and the busiest owner's extra compute (the router's load on the
example inputs, in the balanced order when the plan can place it).

Writes ``node.meta["autopar.dispatch"] = Dispatch(...)`` on the ids node.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from autopar import placements as pl
from autopar.comm import all_to_all_s
from autopar.mesh import MeshSpec
from autopar.passes.cost import COST_KEY, tensor_bytes, view_chain
from autopar.passes.expert_mm import EXPERT_MM
from autopar.passes.row_ops import row_wise, rows_of
from autopar.passes.strategies import STRATEGIES_KEY, Strategy
from autopar.passes.values import evaluate
from autopar.solvers.balance import balanced_order, device_loads, imbalance

aten = torch.ops.aten
DISPATCH_KEY = "autopar.dispatch"
EXPERT_DISPATCH = "expert_dispatch"  # Strategy.exchange of the twins
_RELATIVE_TOLERANCE = 1e-5

@dataclass(eq=False)
class Dispatch:
    """One MoE layer's gathered experts and the region that runs on their owners."""

    ids: str  # the node of each row's chosen expert
    gathers: tuple[str, ...]  # ``index(w, [ids])`` or ``expert_mm(x, w, ids)`` nodes
    weights: tuple[str, ...]  # the gathered weights' placeholders (one per gather; behind its views)
    segment: tuple[str, ...]  # nodes run on the owners, in graph order (the gathers included)
    inputs: tuple[str, ...]  # nodes outside the segment it reads (besides ids and weights)
    row_inputs: tuple[bool, ...]  # per input: one row per (token, choice) (sent with its row) or not (whole)
    outputs: tuple[str, ...]  # segment nodes read outside it
    rows: int
    experts: int
    sent_bytes: int  # the row inputs' bytes (every device's together)
    returned_bytes: int  # the outputs' bytes
    load: tuple[int, ...] | None = None  # rows per expert on the example inputs
    balanced: bool = False  # the plan may place the experts in a balanced order (a relabelling exists)

    def to_plan(self, dim: int) -> dict:
        """The MoE layer's ``dispatch`` entry in the plan: what lowering fuses, over mesh dim ``dim``."""
        return {"dim": dim, "ids": self.ids, "gathers": list(self.gathers), "segment": list(self.segment),
                "inputs": list(self.inputs), "row_inputs": list(self.row_inputs), "outputs": list(self.outputs),
                "rows": self.rows, "experts": self.experts}

    @classmethod
    def from_plan(cls, entry: dict) -> "Dispatch":
        return cls(entry["ids"], tuple(entry["gathers"]), (), tuple(entry["segment"]), tuple(entry["inputs"]),
                   tuple(entry["row_inputs"]), tuple(entry["outputs"]), entry["rows"], entry["experts"], 0, 0)


def annotate_dispatches(graph: torch.fx.Graph, expert_weights: dict[str, object],
                        values: dict[str, torch.Tensor] | None, memo: dict | None = None) -> list[Dispatch]:
    """Find the dispatchable regions of gathered experts. ``expert_weights``: placeholder name
    -> its passes.experts.ExpertGroup (the stacked experts)."""
    by_ids: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        ids = _gather_ids(node, expert_weights)
        val = ids.meta.get("val") if ids is not None else None
        if isinstance(val, torch.Tensor) and val.dim() == 1 and not val.dtype.is_floating_point:
            by_ids.setdefault(ids, []).append(node)
    found = []
    for ids, gathers in by_ids.items():
        dispatch = _dispatch(graph, ids, gathers, expert_weights, values, memo)
        if dispatch is not None:
            ids.meta[DISPATCH_KEY] = dispatch
            found.append(dispatch)
    return found


def gathered_weight(node: torch.fx.Node) -> torch.fx.Node:
    """The expert weights a per-row gather reads: ``w`` of ``index(w, [ids])`` and of
    ``expert_mm(x, w, ids)`` (passes.expert_mm: grouped-GEMM experts, per row)."""
    return node.args[weight_position(node)]


def weight_position(node: torch.fx.Node) -> int:
    """Which argument (and input placement) of a per-row gather is its expert weights."""
    return 1 if node.target is EXPERT_MM else 0


def _gather_ids(node: torch.fx.Node, expert_weights: dict) -> torch.fx.Node | None:
    """The per-row expert ids of a gather of stacked experts (``index(w, [ids])``, or
    ``expert_mm(x, w, ids)`` whose ``w`` is a view of them), else None."""
    if node.target is aten.index.Tensor and node.args[0].name in expert_weights and len(node.args[1]) == 1 \
            and isinstance(node.args[1][0], torch.fx.Node):
        return node.args[1][0]
    if node.target is EXPERT_MM and _stored(node.args[1]).name in expert_weights:
        return node.args[2]
    return None


def _stored(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of views reads (a weight's placeholder behind its transposes)."""
    return view_chain(node, through_getitem=False)[0]


def _dispatch(graph, ids: torch.fx.Node, gathers: list[torch.fx.Node], expert_weights: dict, values, memo
              ) -> Dispatch | None:
    rows = ids.meta["val"].shape[0]
    experts = {gathered_weight(g).meta["val"].shape[0] for g in gathers}
    if len(experts) != 1 or any(u not in gathers for u in ids.users):
        return None  # the ids also feed something else: they must stay as they are there
    segment: list[torch.fx.Node] = []
    inside = set(gathers)
    for node in graph.nodes:
        if node in inside:
            segment.append(node)
        elif node.op == "call_function" and any(a in inside for a in node.all_input_nodes) and row_wise(node, rows):
            inside.add(node)
            segment.append(node)
    outputs = [n for n in segment if any(u not in inside for u in n.users)]
    if not outputs or any(not isinstance(n.meta.get("val"), torch.Tensor) or not rows_of(n, rows) for n in outputs):
        return None
    inputs = list(dict.fromkeys(a for n in segment for a in n.all_input_nodes
                                if a not in inside and a is not ids and all(a is not gathered_weight(g) for g in gathers)))
    if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in inputs) or _downstream(graph, inside) & set(inputs):
        return None  # the segment would need something computed from its own results
    position = {n: k for k, n in enumerate(graph.nodes)}
    ready = max(position[a] for a in [ids, *inputs, *(gathered_weight(g) for g in gathers)])
    if ready > min(position[u] for n in outputs for u in n.users if u not in inside):
        return None  # one call cannot stand for it: an output is used before all its inputs exist
    row_inputs = tuple(a.meta["val"].dim() > 0 and a.meta["val"].shape[0] == rows for a in inputs)
    group = expert_weights[_stored(gathered_weight(gathers[0])).name]
    dispatch = Dispatch(
        ids.name, tuple(g.name for g in gathers), tuple(_stored(gathered_weight(g)).name for g in gathers),
        tuple(n.name for n in segment),
        tuple(a.name for a in inputs), row_inputs, tuple(n.name for n in outputs), rows, experts.pop(),
        sum(tensor_bytes(a.meta["val"]) for a, r in zip(inputs, row_inputs) if r),
        sum(tensor_bytes(n.meta["val"]) for n in outputs), getattr(group, "load", None),
        getattr(group, "relabel", None) is not None)
    if values is not None and not _rows_independent(graph, dispatch, values, memo):
        return None
    return dispatch


def _downstream(graph: torch.fx.Graph, inside: set) -> set:
    """Nodes outside ``inside`` that depend on it."""
    found: set = set()
    for node in graph.nodes:
        if node not in inside and any(a in inside or a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def segment_module(graph: torch.fx.Graph, dispatch: Dispatch) -> torch.fx.GraphModule:
    """The segment as a module: inputs (``dispatch.inputs`` in order), then one ids tensor per
    gather, then the gathered weights; returns the outputs as a tuple."""
    by_name = {n.name: n for n in graph.nodes}
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for name in dispatch.inputs:
        env[by_name[name]] = sub.placeholder(f"in_{name}")
    ids = {g: sub.placeholder(f"ids_{g}") for g in dispatch.gathers}
    weights = {g: sub.placeholder(f"w_{g}") for g in dispatch.gathers}
    for name in dispatch.segment:
        node = by_name[name]
        if name in ids and node.target is EXPERT_MM:
            env[node] = sub.call_function(EXPERT_MM, (env[node.args[0]], weights[name], ids[name]))
        elif name in ids:
            env[node] = sub.call_function(aten.index.Tensor, (weights[name], [ids[name]]))
        else:
            env[node] = sub.node_copy(node, lambda a: env[a])
        env[node].meta = dict(node.meta)
    sub.output(tuple(env[by_name[n]] for n in dispatch.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), sub)


def _rows_independent(graph, dispatch: Dispatch, values: dict[str, torch.Tensor], memo: dict | None) -> bool:
    """The segment on the example values, and on the same rows in reverse order: the outputs
    must be the same rows reversed (nothing mixes rows). True when values are missing."""
    by_name = {n.name: n for n in graph.nodes}
    memo = {} if memo is None else memo
    inputs = [evaluate(by_name[n], values, memo) for n in dispatch.inputs]
    ids = evaluate(by_name[dispatch.ids], values, memo)
    weights = [evaluate(gathered_weight(by_name[g]), values, memo) for g in dispatch.gathers]
    if any(v is None for v in [*inputs, ids, *weights]):
        return True
    module = segment_module(graph, dispatch)
    flip = torch.arange(dispatch.rows - 1, -1, -1, device=ids.device)
    with torch.no_grad():
        outs = module(*inputs, *[ids] * len(weights), *weights)
        flipped = module(*[x[flip] if r else x for x, r in zip(inputs, dispatch.row_inputs)],
                         *[ids[flip]] * len(weights), *weights)
    for a, b in zip(outs, flipped, strict=True):
        scale = float(a.abs().max()) if a.numel() else 0.0
        if a.shape != b.shape or float((a[flip] - b).abs().max()) > _RELATIVE_TOLERANCE * max(scale, 1e-12):
            return False
    return True


def add_expert_dispatch(graph: torch.fx.Graph, mesh_shape: tuple[int, ...]) -> None:
    """Twins for every dispatch region: the ids node ``D`` on a mesh dim of size n > 1 dividing
    the experts where it is split by rows; each gather taking those ids with its weight
    ``Shard(0)`` there (from its strategies with the weight replicated everywhere)."""
    by_name = {n.name: n for n in graph.nodes}
    for node in graph.nodes:
        dispatch = node.meta.get(DISPATCH_KEY)
        if dispatch is None or STRATEGIES_KEY not in node.meta:
            continue
        dims = [d for d, n in enumerate(mesh_shape) if n > 1 and dispatch.experts % n == 0]
        own = [s for s in node.meta[STRATEGIES_KEY] if s.exchange != EXPERT_DISPATCH]
        twins = [Strategy((pl.with_dim(out, d, pl.D),), s.inputs, exchange=EXPERT_DISPATCH)
                 for s in own for d in dims if len(s.outputs) == 1 and (out := s.outputs[0]) and out[d] is pl.Shard(0)]
        node.meta[STRATEGIES_KEY] = own + list(dict.fromkeys(twins))
        for name in dispatch.gathers:
            gather = by_name[name]
            own = [s for s in gather.meta[STRATEGIES_KEY] if s.exchange != EXPERT_DISPATCH]
            twins = []
            at = weight_position(gather)  # the weights, then the ids
            for s in own:
                weight, ids = s.inputs[at:at + 2]
                for d in dims:
                    if pl.is_replicated(weight) and ids[d] is pl.Shard(0) and s.outputs[0][d] is pl.Shard(0):
                        placed = (pl.with_dim(weight, d, pl.Shard(0)), pl.with_dim(ids, d, pl.D))
                        twins.append(Strategy(s.outputs, (*s.inputs[:at], *placed), exchange=EXPERT_DISPATCH))
            gather.meta[STRATEGIES_KEY] = own + list(dict.fromkeys(twins))


def dispatch_s(node: torch.fx.Node, strategy: Strategy, mesh: MeshSpec, device, links=None) -> float:
    """Time an ids twin adds: the rows to their owners and back, forward and backward (one
    all-to-all each way, on the mesh dim placed ``D``, after the counts' and the ids'), and the busiest owner's compute beyond
    the mean (the segment's work on rows split over the devices, times the load's max/mean − 1).
    The gathers' twins add nothing (their rows' exchange is this one)."""
    dispatch = node.meta.get(DISPATCH_KEY)
    if dispatch is None or strategy.exchange != EXPERT_DISPATCH:
        return 0.0
    links = links or mesh.links
    out = strategy.outputs[0]
    d = pl.index_of(out, pl.D)
    n = mesh.shape[d]
    others = math.prod(size for k, (p, size) in enumerate(zip(out, mesh.shape)) if k != d and p is not pl.R)
    # forward: the counts, the ids, the rows there and back; backward: the rows' gradients both ways
    ids_bytes = dispatch.rows * 8 / others
    exchange = (all_to_all_s(0.0, n, links[d]) + all_to_all_s(ids_bytes, n, links[d])
                + 2 * (all_to_all_s(dispatch.sent_bytes / others, n, links[d])
                       + all_to_all_s(dispatch.returned_bytes / others, n, links[d])))
    excess = imbalance_of(dispatch, n) - 1.0
    if excess <= 0 or device is None:
        return exchange
    by_name = {x.name: x for x in node.graph.nodes}
    split = others * n
    work = sum(3 * by_name[name].meta[COST_KEY].time_s(device, split) for name in dispatch.segment
               if name in by_name and COST_KEY in by_name[name].meta)
    return exchange + excess * work


def imbalance_of(dispatch: Dispatch, devices: int) -> float:
    """max / mean rows per owner with the experts in contiguous blocks over ``devices``: in the
    balanced order when the plan can place it, else in the model's order."""
    if dispatch.load is None or devices <= 1:
        return 1.0
    return _imbalance(dispatch.load, devices, dispatch.balanced)


@functools.lru_cache(maxsize=256)
def _imbalance(load: tuple[int, ...], devices: int, balanced: bool) -> float:
    order = balanced_order(load, devices) if balanced else list(range(len(load)))
    return imbalance(device_loads(load, order, devices))

