"""Real values of graph nodes, computed from the example inputs (and the model's weights when
they are real), for the passes that need the data and not only the shapes: the rows a lookup
touches (passes.sparse), the tokens a router sends to each expert (passes.experts)."""

from __future__ import annotations

import torch

from autopar.passes.capture import Captured


def real_values(captured: Captured, example_inputs=None, parameters: bool = False) -> dict[str, torch.Tensor]:
    """Placeholder name -> real CPU tensor for every user input that holds values (not meta,
    not fake) and, with ``parameters``, every parameter and buffer that does."""
    real: dict[str, torch.Tensor] = {}
    if example_inputs is not None:
        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        for spec, value in zip(captured.inputs, inputs):
            if _holds_values(value):  # in the dtype the graph computes in (mixed precision casts)
                real[spec.name] = value.detach().cpu().to(getattr(torch, spec.dtype))
    if parameters:
        state = captured.program.state_dict
        constants = getattr(captured.program, "constants", {})
        graph_dtype = {n.name: n.meta["val"].dtype for n in captured.graph.nodes
                       if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
        for placeholder, fqn in {**captured.parameter_of, **captured.buffer_of}.items():
            value = state.get(fqn, constants.get(fqn))
            if _holds_values(value):  # a master parameter as the graph computes with it
                real[placeholder] = value.detach().cpu().to(graph_dtype.get(placeholder, value.dtype))
    return real


def _holds_values(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type != "meta"
            and not isinstance(value, torch._subclasses.FakeTensor))


def evaluate(node: torch.fx.Node, values: dict[str, torch.Tensor], memo: dict | None = None):
    """The value of ``node`` computed on CPU from ``values`` (placeholder name -> tensor), or
    None when it depends on a placeholder without a value. ``memo`` shares work between calls."""
    memo = {} if memo is None else memo
    needed, stack = set(), [node]
    while stack:  # the node's ancestors not known yet
        n = stack.pop()
        if n.name in needed or n.name in memo or n.name in values:
            continue
        if n.op != "call_function" or not callable(n.target):
            return None  # a placeholder without a value (or something we cannot run)
        needed.add(n.name)
        stack.extend(n.all_input_nodes)
    try:
        with torch.no_grad():
            for n in node.graph.nodes:  # topological order
                if n.name not in needed:
                    continue
                args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: memo.get(a.name, values.get(a.name)))
                kwargs = dict(kwargs)
                if "device" in kwargs:  # constants (position ids) traced on the model's device: make them here
                    kwargs["device"] = torch.device("cpu")
                result = n.target(*args, **kwargs)
                if isinstance(result, torch.Tensor) and result.device.type != "cpu":
                    return None
                memo[n.name] = result
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    return memo.get(node.name, values.get(node.name))
