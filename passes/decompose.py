"""Decompose an exported (training-IR) program to core ATen, once per distinct op signature.

``ExportedProgram.run_decompositions()`` retraces the whole program and costs about 0.4 s per
transformer layer on this machine (12 s for a 32-layer Llama shape), although every layer
decomposes the same way. Here each call node is decomposed on its own with ``make_fx`` and
the core-ATen table, the result is cached by (op, argument shapes/strides/dtypes, constant
arguments) and spliced into the graph in place of the node. Layers after the first cost a
dictionary lookup per node.

The graph comes out as ``run_decompositions(decomposition_table())`` would produce it (same
ops in the same order, checked by tests/test_decompose.py on every test model). Fused
attention (``aten.scaled_dot_product_attention``) stays one op: decomposed, it would hold
B·H·T² scores per layer that the fused kernel never materialises (passes.strategies plans it
split by batch and heads; the lowered program calls the fused kernel on each shard). Programs this splice cannot treat
exactly — in-place ops or mutated inputs (which need functionalization), higher-order ops,
constants created inside a decomposition — take ``run_decompositions()``.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._decomp import core_aten_decompositions
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.passes.graph_edit import inherited_meta

log = logging.getLogger(__name__)

KEPT_FUSED = {torch.ops.aten.scaled_dot_product_attention.default}  # ops that stay as the model wrote them



class _NeedsFullRetrace(Exception):
    """The splice cannot reproduce run_decompositions() for this program."""


def decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Core-ATen version of ``program`` (the input program is modified in place when possible)."""
    if not _spliceable(program):
        return program.run_decompositions(decomposition_table())
    graph = program.graph_module.graph
    placeholders = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([v for v in placeholders if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return program.run_decompositions(decomposition_table())
    table = {**core_aten_decompositions(), **OVERRIDES}
    cache: dict = {}
    try:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is not operator.getitem and node.target not in KEPT_FUSED:
                _splice(graph, node, cache, table, fake_mode)
    except _NeedsFullRetrace as why:  # every splice so far is exact: the graph is still valid
        log.info("decomposing by full retrace: %s", why)
        program.graph_module.recompile()
        return program.run_decompositions(decomposition_table())
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    log.debug("decomposed %d distinct op signatures", len(cache))
    return program


def decomposition_table() -> dict:
    """torch.export's default decompositions to core ATen, less the fused ops we keep, plus
    :data:`OVERRIDES`."""
    table = torch.export.default_decompositions()
    for op in KEPT_FUSED:
        table.pop(op, None)
    return {**table, **OVERRIDES}


def _slice_scatter_by_cat(input, src, dim=0, start=None, end=None, step=1):
    """``slice_scatter`` with step 1 as the concatenation of the kept slices and ``src``.

    Why: autograd's backward of ``slice_scatter`` builds the zero gradient for the scattered
    slice with a plain ``zeros`` tensor, which a DTensor gradient cannot be mixed with
    (``aten.slice_scatter.default got mixed torch.Tensor and DTensor`` in backward; DeepSeek-V3's
    attention builds its keys by slice assignment into ``new_empty``). ``cat`` and ``slice``
    have DTensor rules both ways. Other steps stay as they are (NotImplemented)."""
    if step != 1:
        return NotImplemented
    dim = dim % input.dim()
    size = input.shape[dim]
    start = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    end = size if end is None else min(max(end + size if end < 0 else end, start), size)
    pieces = [torch.ops.aten.slice.Tensor(input, dim, 0, start)] if start > 0 else []
    pieces.append(src)
    if end < size:
        pieces.append(torch.ops.aten.slice.Tensor(input, dim, end, size))
    return torch.ops.aten.cat.default(pieces, dim) if len(pieces) > 1 else torch.ops.aten.clone.default(src)


def _copy_by_clone(self, src, non_blocking=False):
    """Functional ``copy`` (what functionalization makes of ``out[...] = value``) as ``src``
    converted to ``self``'s dtype, broadcast to its shape and cloned: autograd has no
    derivative for ``aten::copy`` (the lowered program's backward fails on it) and DTensor
    no rule; the forms here have both. ``self`` is overwritten whole, so nothing reads it."""
    value = src if src.dtype == self.dtype else torch.ops.aten._to_copy.default(src, dtype=self.dtype)
    if tuple(value.shape) != tuple(self.shape):
        value = torch.ops.aten.expand.default(value, list(self.shape))
    return torch.ops.aten.clone.default(value)


# our decompositions, on top of core ATen's
OVERRIDES = {torch.ops.aten.slice_scatter.default: _slice_scatter_by_cat,
             torch.ops.aten.copy.default: _copy_by_clone}


def _spliceable(program: torch.export.ExportedProgram) -> bool:
    sig = program.graph_signature
    if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
        return False
    for node in program.graph.nodes:
        if node.op == "get_attr" or node.op == "call_module":
            return False  # submodules of higher-order ops
        if node.op == "call_function" and node.target is not operator.getitem:
            if not isinstance(node.target, torch._ops.OpOverload) or node.target._schema.is_mutable:
                return False
    return True


def _signature(node: torch.fx.Node, flat: list) -> tuple:
    def describe(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("tensor", tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device))
            raise _NeedsFullRetrace(f"{node.name}: argument {a.name} is not a tensor ({type(v).__name__})")
        return ("const", repr(a))
    return (node.target, tuple(describe(a) for a in flat))


def _trace(node: torch.fx.Node, flat: list, spec, table, fake_mode) -> torch.fx.GraphModule | None:
    """The op's decomposition as a graph over its tensor arguments; None when it stays as is."""
    positions = [k for k, a in enumerate(flat) if isinstance(a, torch.fx.Node)]

    def call(*tensors):
        items = list(flat)
        for k, t in zip(positions, tensors):
            items[k] = t
        args, kwargs = tree_unflatten(items, spec)
        return node.target(*args, **kwargs)

    with fake_mode:  # fresh inputs: make_fx identifies arguments by tensor identity
        inputs = [torch.empty_strided(flat[k].meta["val"].shape, flat[k].meta["val"].stride(),
                                      dtype=flat[k].meta["val"].dtype, device=flat[k].meta["val"].device)
                  for k in positions]
        sub = make_fx(call, decomposition_table=table)(*inputs)
    calls = [n for n in sub.graph.nodes if n.op == "call_function"]
    if len(calls) == 1 and calls[0].target == node.target:
        return None
    if any(n.op not in ("placeholder", "call_function", "output") for n in sub.graph.nodes):
        raise _NeedsFullRetrace(f"decomposition of {node.target} creates constants")
    return sub


def _splice(graph: torch.fx.Graph, node: torch.fx.Node, cache: dict, table, fake_mode) -> None:
    flat, spec = tree_flatten((node.args, node.kwargs))
    key = (_signature(node, flat), spec)
    if key not in cache:
        cache[key] = _trace(node, flat, spec, table, fake_mode)
    sub = cache[key]
    if sub is None:
        return
    multi = isinstance(next(n for n in sub.graph.nodes if n.op == "output").args[0], (list, tuple))
    if multi and any(user.target is not operator.getitem for user in node.users):
        raise _NeedsFullRetrace(f"{node.name}: multi-output op used without getitem")
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    tensor_args = iter(a for a in flat if isinstance(a, torch.fx.Node))
    result = None
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(tensor_args)
            elif inner.op == "output":
                result = torch.fx.node.map_arg(inner.args[0], env.__getitem__)
            else:
                new = graph.node_copy(inner, env.__getitem__)
                new.meta.update(inherited_meta(node))
                env[inner] = new
    if isinstance(result, (list, tuple)):
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
