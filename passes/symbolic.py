"""Costs as sympy expressions in the batch size, so a plan is re-costed at any batch size
without tracing the model again.

Every quantity the cost model reads from the graph — an op's FLOPs, bytes read and written,
the bytes of each tensor an edge carries — is a polynomial in the batch size for the models
we plan (products of dims, one of which scales with the batch). The model is traced at the
batch ``B0`` of its example inputs and at 2·B0 and 3·B0 (torch.export on fake tensors, the
same capture as planning); each quantity is interpolated exactly (rational coefficients) and
checked at 4·B0, so a quantity that is not a polynomial of degree ≤ 2 is refused by name
rather than extrapolated. With these expressions in place of the numbers, the problem builder
and the collective formulas (``autopar.comm``, sympy-aware ``min``/``max``) yield the step time
of a plan as one expression in ``batch``.

Writes ``node.meta["autopar.symbolic_cost"]`` (an OpCost of expressions) on ops and
``node.meta["autopar.symbolic_bytes"]`` (bytes of each tensor output) on every node.

Batch inputs are the example inputs whose dim 0 equals B0. Not symbolic: the sparse
exchange of embedding tables (its touched rows come from the data, they stay at B0's).
"""

from __future__ import annotations

import logging

import sympy
import torch
from torch import nn

from autopar.errors import AutoparError, ErrorKind
from autopar.passes.capture import Captured, capture, normalize_inputs
from autopar.passes.cost import COST_KEY, OpCost, annotate_costs, tensor_bytes
from autopar.passes.strategies import output_vals

log = logging.getLogger(__name__)
BATCH = sympy.Symbol("batch", positive=True, integer=True)
SYMBOLIC_COST_KEY = "autopar.symbolic_cost"
SYMBOLIC_BYTES_KEY = "autopar.symbolic_bytes"
_TRACES = (2, 3, 4)  # multiples of B0 traced besides B0; the last one checks the fit


def traced_batch(example_inputs) -> int:
    inputs = normalize_inputs(example_inputs)
    if not inputs or inputs[0].dim() == 0:
        raise AutoparError(ErrorKind.BAD_INPUT, "symbolic costs need a batch dim: the first example input has none")
    return int(inputs[0].shape[0])


def resized(example_inputs, batch: int) -> tuple:
    """The example inputs with every batch-first input (dim 0 = the traced batch) at ``batch``
    rows, zero-filled (index inputs stay valid)."""
    inputs = normalize_inputs(example_inputs)
    b0 = traced_batch(inputs)
    return tuple(torch.zeros((batch, *x.shape[1:]), dtype=x.dtype, device=x.device) if x.dim() and x.shape[0] == b0
                 else x for x in inputs)


def annotate_symbolic(captured: Captured, model: nn.Module, example_inputs) -> int:
    """Trace ``model`` at 2, 3 and 4 times the example batch, fit every cost quantity of
    ``captured``'s graph as a polynomial in :data:`BATCH` and attach it. Returns B0."""
    b0 = traced_batch(example_inputs)
    graph = captured.graph
    annotate_costs(graph)
    others = []
    for k in _TRACES:
        log.info("symbolic costs: tracing at batch %d", k * b0)
        other = capture(model, resized(example_inputs, k * b0), captured.compute_dtype, stack_traces=False).graph
        annotate_costs(other)
        others.append(other)
    for other, k in zip(others, _TRACES):
        mismatch = next(((a.name, str(a.target), b.name, str(b.target)) for a, b in zip(graph.nodes, other.nodes)
                         if a.name != b.name or a.target != b.target), None)
        if mismatch or len(graph.nodes) != len(other.nodes):
            raise AutoparError(ErrorKind.UNSUPPORTED_OP,
                               f"the graph traced at batch {k * b0} differs from the one at batch {b0} "
                               f"(first difference: {mismatch}): the model's structure depends on the batch "
                               "size, so its costs cannot be written as formulas of it; plan each batch size")
    nodes = [list(g.nodes) for g in (graph, *others)]
    sizes = [b0] + [k * b0 for k in _TRACES]
    for column in zip(*nodes):
        node = column[0]
        outs = [[v for v in output_vals(n) if isinstance(v, torch.Tensor)] for n in column]
        node.meta[SYMBOLIC_BYTES_KEY] = [
            _fit(node, f"bytes of output {k}", sizes, [tensor_bytes(o[k]) for o in outs])
            for k in range(len(outs[0]))]
        if node.op == "call_function":
            costs = [n.meta[COST_KEY] for n in column]
            first = costs[0]
            node.meta[SYMBOLIC_COST_KEY] = OpCost(
                _fit(node, "FLOPs", sizes, [c.flops for c in costs]),
                _fit(node, "bytes read", sizes, [c.bytes_read for c in costs]),
                _fit(node, "bytes written", sizes, [c.bytes_written for c in costs]),
                first.is_view, first.dtype, first.op_class)
    return b0


def _fit(node: torch.fx.Node, what: str, sizes: list[int], values: list[float]) -> sympy.Expr:
    """The polynomial of degree ≤ 2 through the first three points, checked on the last."""
    exact = [sympy.Integer(int(v)) if float(v).is_integer() else sympy.Rational(v) for v in values]
    if len(set(exact)) == 1:
        return exact[0]
    points = list(zip(sizes[:3], exact[:3]))
    expr = sympy.expand(sympy.interpolate(points, BATCH))
    if expr.subs(BATCH, sizes[3]) != exact[3]:
        raise AutoparError(ErrorKind.UNSUPPORTED_OP,
                           f"node {node.name} ({node.target}): its {what} at batch sizes {sizes} ({values}) are not "
                           "a polynomial of degree ≤ 2 in the batch size; plan each batch size instead")
    return expr


def formula(node: torch.fx.Node) -> dict[str, str]:
    """The node's cost quantities as text (for the plan and ``autopar explain``)."""
    cost = node.meta.get(SYMBOLIC_COST_KEY)
    if cost is None:
        return {}
    return {"flops": str(cost.flops), "bytes": str(sympy.expand(cost.bytes_read + cost.bytes_written))}
