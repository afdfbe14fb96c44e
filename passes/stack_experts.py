"""Batch a ModuleList of identical experts into the grouped (stacked) form.

MoE layers written as ``torch.stack([expert(x[e]) for e, expert in enumerate(self.experts)])``
(DeepSpeed-MoE's and fairseq's experts, many hand-written capacity-based MoE layers) export as E copies
of the same chain of ops, each on one slice ``x[e]`` and its own expert's parameters. The
planner cannot split work across such copies: each is a separate piece of graph. This pass
finds them and rewrites them into one batched chain over the expert dim — the GShard form
passes.experts already plans (expert parallel, expert-internal tensor parallel or replicated):

    x[e] -> chain(x[e], w1[e], ...) for every e, then stack    becomes
    W1 = stack(w1[0], ..., w1[E-1]) ...;  torch.vmap(chain)(x, W1, ...)

The batched chain is traced from the first copy with ``torch.vmap`` and ``make_fx`` on the
program's fake tensors, in core ATen, so it costs and shards like any other graph. The
parameters stay the user's own (one placeholder per expert weight, stacked by an ``aten.stack``
node): names, state dicts and optimizers see the model as written.

A group is rewritten only when every copy is the same op sequence with the same constant
arguments, reads the shared tensor only through ``select(x, 0, e)`` and owns parameters of
the same shapes that nothing else reads; otherwise the copies stay as they are.

Expert parallelism then needs each expert's weights on one device only, which no DTensor
placement of a separate tensor expresses: the "O" placement below (planned by
:func:`add_owned_stacks` and passes.build_problem, lowered by passes.lower onto sub-meshes).

Writes ``node.meta["autopar.stacked_experts"] = (expert FQN prefixes…)`` on the stack nodes of
parameters it creates.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch._decomp import core_aten_decompositions
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import placements as pl
from autopar.passes.graph_edit import inherited_meta
from autopar.passes.strategies import STRATEGIES_KEY, Strategy

log = logging.getLogger(__name__)
aten = torch.ops.aten
STACKED_KEY = "autopar.stacked_experts"


def stack_expert_lists(program: torch.export.ExportedProgram) -> int:
    """Rewrite every ModuleList of identical experts in ``program``'s graph (in place); returns
    how many groups were batched."""
    graph = program.graph
    parameter_of = dict(program.graph_signature.inputs_to_parameters)
    fake_mode = detect_fake_mode([n.meta["val"] for n in graph.nodes
                                  if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)])
    if fake_mode is None:
        return 0
    done = 0
    for node in list(graph.nodes):
        if _combines_on_dim0(node):
            copies = _copies(parameter_of, node)
            if copies is None:
                log.debug("%s: its pieces are not identical experts over slices; left as is", node.name)
            else:
                _batch(graph, node, copies, fake_mode, parameter_of)
                done += 1
    if done:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return done


def _combines_on_dim0(node: torch.fx.Node) -> bool:
    """``stack(outs, 0)``, or what core ATen makes of it: ``cat(outs, 0)`` of same-shape pieces."""
    if node.op != "call_function" or node.target not in (aten.stack.default, aten.cat.default):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    pieces = node.args[0]
    shapes = {tuple(p.meta["val"].shape) for p in pieces if isinstance(p, torch.fx.Node)}
    return dim % node.meta["val"].dim() == 0 and len(shapes) == 1 and (
        node.target is aten.stack.default or len(next(iter(shapes))) > 0)


class _Copy:
    """One expert's chain: its nodes in graph order, the shared tensors it slices and its parameters."""

    def __init__(self, nodes: list[torch.fx.Node], sliced: list[torch.fx.Node], params: list[torch.fx.Node]):
        self.nodes, self.sliced, self.params = nodes, sliced, params


def _copies(parameter_of: dict[str, str], stack: torch.fx.Node) -> list[_Copy] | None:
    outs = list(stack.args[0])
    experts = len(outs)
    if experts < 2 or len(set(outs)) != experts or not all(isinstance(o, torch.fx.Node) for o in outs):
        return None
    ancestry = [_ancestors(o) for o in outs]
    shared_by = Counter(n for a in ancestry for n in a)  # a copy's own nodes are in its ancestry only
    copies = []
    for e, out in enumerate(outs):
        own = {n for n in ancestry[e] if shared_by[n] == 1}
        nodes = [n for n in stack.graph.nodes if n in own]
        if any(u is not stack and u not in own for n in nodes for u in n.users):
            return None  # a copy's intermediate is read outside it
        params = [n for n in nodes if n.op == "placeholder"]
        if any(n.name not in parameter_of for n in params):
            return None  # an input or buffer owned by one copy: not an expert's weights
        sliced = []
        for n in nodes:
            if n.op != "call_function":
                continue
            outside = [a for a in n.all_input_nodes if a not in own]
            if outside and not (n.target is aten.select.int and n.args[1] == 0 and n.args[2] == e
                                and n.args[0].meta["val"].shape[0] == experts):
                return None  # reads a shared tensor other than through its own slice
            sliced += outside
        if not sliced:
            return None
        copies.append(_Copy([n for n in nodes if n.op == "call_function"], sliced, params))
    return copies if _isomorphic(copies) else None


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _isomorphic(copies: list[_Copy]) -> bool:
    first = copies[0]
    for e, copy in enumerate(copies[1:], start=1):
        if (len(copy.nodes) != len(first.nodes) or len(copy.params) != len(first.params)
                or copy.sliced != first.sliced):
            return False
        mapping = dict(zip(first.params, copy.params))
        if any(a.meta["val"].shape != b.meta["val"].shape or a.meta["val"].dtype != b.meta["val"].dtype
               for a, b in mapping.items()):
            return False
        mapping.update(zip(first.nodes, copy.nodes))
        for a, b in zip(first.nodes, copy.nodes):
            if a.target != b.target or not _same_args(a.kwargs, b.kwargs, mapping, e):
                return False
            if not _same_args(a.args, b.args, mapping, e, select=a.target is aten.select.int):
                return False
    return True


def _same_args(a, b, mapping: dict, e: int, select: bool = False) -> bool:
    if select:  # select(shared, 0, expert)
        return a[0] is b[0] and a[1] == b[1] and b[2] == e
    flat_a, spec_a = torch.utils._pytree.tree_flatten(a)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(flat_a, flat_b):
        if isinstance(x, torch.fx.Node):
            if mapping.get(x, x) is not y:
                return False
        elif isinstance(y, torch.fx.Node) or x != y:
            return False
    return True


def _batch(graph: torch.fx.Graph, stack: torch.fx.Node, copies: list[_Copy], fake_mode,
           parameter_of: dict[str, str]) -> None:
    """Replace the copies by stacked parameters and the first copy's chain under ``torch.vmap``."""
    first = copies[0]
    experts = len(copies)
    selects = [n for n in first.nodes if n.target is aten.select.int and n.args[0] in first.sliced]
    shared = list(dict.fromkeys(n.args[0] for n in selects))
    chain = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for source in shared:
        env[source] = chain.placeholder(f"shared_{source.name}")
    for p in first.params:
        env[p] = chain.placeholder(p.name)
    for n in first.nodes:
        if n in selects:
            env[n] = env[n.args[0]]  # the slice: vmap hands each expert its own
        else:
            env[n] = chain.node_copy(n, env.__getitem__)
    chain.output(env[stack.args[0][0]])
    module = torch.fx.GraphModule(torch.nn.Module(), chain)

    with fake_mode:
        shared_vals = [torch.empty_like(s.meta["val"]) for s in shared]
        stacked_vals = [torch.empty((experts, *p.meta["val"].shape), dtype=p.meta["val"].dtype,
                                    device=p.meta["val"].device) for p in first.params]
        batched = make_fx(torch.vmap(module), decomposition_table=core_aten_decompositions())(
            *shared_vals, *stacked_vals)

    inherited = inherited_meta(stack)
    prefixes = tuple(_prefix(c, parameter_of) for c in copies)
    with graph.inserting_before(stack):
        inputs = list(shared)
        for k, p in enumerate(first.params):
            members = [c.params[k] for c in copies]
            weights = graph.call_function(aten.stack.default, (members, 0))
            with fake_mode:
                weights.meta["val"] = torch.stack([m.meta["val"] for m in members])
            weights.meta.update(inherited)
            weights.meta[STACKED_KEY] = prefixes
            inputs.append(weights)
        env = {}
        placeholders = iter(inputs)
        result = None
        for inner in batched.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                result = env[inner.args[0]]
            else:
                new = graph.node_copy(inner, env.__getitem__)
                new.meta.update(inherited)
                env[inner] = new
        if stack.target is aten.cat.default:  # (E, n, ...) -> (E·n, ...), as the concatenation
            shape = list(stack.meta["val"].shape)
            result = graph.call_function(aten.view.default, (result, shape))
            with fake_mode:
                result.meta["val"] = result.args[0].meta["val"].view(shape)
            result.meta.update(inherited)
    stack.replace_all_uses_with(result)
    graph.erase_node(stack)
    log.info("batched %d experts (%s, ...) into the grouped form", experts, prefixes[0])


def _prefix(copy: _Copy, parameter_of: dict[str, str]) -> str:
    """The expert's module path: the FQN prefix its parameters share."""
    fqns = [parameter_of[p.name].split(".") for p in copy.params]
    common = []
    for parts in zip(*fqns):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


# ---- expert parallelism for the batched experts: each expert's weights live on one device ----
#
# The experts' parameters stay separate tensors, so DTensor's Shard(0) cannot split them over
# devices. The ``O`` placement (autopar.placements.Owned; per mesh dim, like ``R`` or ``Shard(k)``) says: on this mesh dim each
# expert's tensor lives whole on one device, its owner — expert e on coordinate e // (E / n),
# the block Shard(0) of the stacked tensor would give that device — and nowhere else. The
# stack node then turns ``O`` weights into a Shard(0) stacked tensor without communication (every
# device stacks the experts it owns); gradients come back to the owners the same way, so the
# experts' weights need no gradient collective at all. Lowering keeps each weight as a DTensor
# on its owner's sub-mesh (passes.lower).

def expert_members(graph: torch.fx.Graph) -> dict[str, tuple[int, int]]:
    """Parameter placeholder name -> (expert index, experts) for the weights the stack nodes of
    batched experts gather (each weight read only by its stack)."""
    members = {}
    for node in graph.nodes:
        if STACKED_KEY in node.meta:
            weights = node.args[0]
            for e, w in enumerate(weights):
                if len(w.users) == 1:
                    members[w.name] = (e, len(weights))
    return members


def owned_leaf_options(specs: list[pl.Spec], experts: int, mesh_shape: tuple[int, ...]) -> list[pl.Spec]:
    """An expert weight's extra placements: ``O`` on one mesh dim whose size divides the
    experts, any of its ordinary placements on the others."""
    extra = []
    for d, size in enumerate(mesh_shape):
        if size > 1 and experts % size == 0:
            extra += [pl.with_dim(p, d, pl.O) for p in specs if p[d] is pl.R]
    return list(dict.fromkeys(extra))


def add_owned_stacks(graph: torch.fx.Graph, mesh_shape: tuple[int, ...]) -> None:
    """Give every stack node of batched experts, for each strategy that keeps the weights and
    the stack replicated on a mesh dim dividing the experts, a twin with the weights ``O`` and
    the stacked tensor ``Shard(0)`` on that dim."""
    for node in graph.nodes:
        if STACKED_KEY not in node.meta or STRATEGIES_KEY not in node.meta:
            continue
        experts = len(node.args[0])
        strategies = node.meta[STRATEGIES_KEY]  # DTensor's, fresh from enumerate_strategies
        twins = []
        for s in strategies:
            first = s.inputs[0]
            if any(i != first for i in s.inputs) or s.outputs[0] is None:
                continue
            for d, size in enumerate(mesh_shape):
                if size > 1 and experts % size == 0 and first[d] is pl.R and s.outputs[0][d] is pl.R:
                    owned = pl.with_dim(first, d, pl.O)
                    out = pl.with_dim(s.outputs[0], d, pl.Shard(0))
                    twins.append(Strategy((out,), tuple(owned for _ in s.inputs)))
        node.meta[STRATEGIES_KEY] = strategies + list(dict.fromkeys(twins))


def owner(expert: int, experts: int, devices: int) -> int:
    """The coordinate (on the ``O`` mesh dim) of the device that holds ``expert``: the block
    ``Shard(0)`` of the stacked experts gives it."""
    return expert // (experts // devices)
