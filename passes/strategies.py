"""Strategy enumeration: candidate placements per node, taken from DTensor's own registry.

For each mesh dimension we ask DTensor which (output, input) placements an op supports on a
1-D mesh of that size — single-dim strategy functions, else the op strategy functions fed
with every candidate input placement — and the strategies on an N-D mesh are the products
of the per-dimension ones, filtered for even sharding. This is how DTensor itself expands
single-dim strategies, so the lowered program runs the placements the plan chose.
Ops DTensor has no rule for run replicated (a warning names them once).

Three prunings keep the problem small without losing plans worth having:
  * constants (nodes that depend on no input or parameter: causal masks, position ids) are
    never partial sums — a sum of pieces of a mask is never cheaper than the mask;
  * inputs in a non-sum partial state (``P(max)``, ``P(avg)``…) are not offered to
    consumers: DTensor's single-dim expansion proposes them for every linear op (e.g. a
    P(max) + P(max) add), they multiply a residual stream's placements by 2.5 on a 2-D
    mesh, and a producer that outputs one is still reduced to R or S by resharding;
  * the outer dim of a 3-D mesh splits the batch only (:func:`batch_only_dims`): there every
    op's tensors are replicated or split on their first dim, never partial — the data-parallel
    dim of HSDP + TP (torchtitan orders mesh dims data-parallel first). Parameters may still
    be sharded on it (FSDP over it; their placements are not pruned). Without this a 3-D mesh
    multiplies every op's strategies by a third factor of the same size (a small GPT on
    (2, 2, 2) planned in 30 s against 8 s with it, to the same optimum).

Writes ``node.meta["autopar.strategies"] = [Strategy, ...]`` on call_function nodes.
A strategy's placement of one tensor is a spec of autopar.placements values, one per mesh dim:
``(Shard(0), R)``; per dim ``R``, ``Shard(d)``, ``P`` (partial sum) or ``Partial(op)`` for
other partial reductions.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import (
    _fill_single_dim_strategy_placeholders,
    _insert_single_dim_replication_strategy,
)

from autopar import placements as pl
from autopar.passes.context_parallel import SEQUENCE_SPLIT, balanced_twins, context_rule
from autopar.passes.cost import FUSED_ATTENTION, attention_args
from autopar.passes.dtensor_ops import dtensor_placement, planned
from autopar.passes.bag_strategies import bag_number_strategies, split_ids_by_bags_only
from autopar.passes.embedding_bag import bag_split_inputs, id_indexed
from autopar.passes.sample_local import SAMPLE_LOCAL, sample_local_rules
from autopar.passes.strategy_types import Strategy, evenly_sharded, output_vals, tensor_args  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

STRATEGIES_KEY = "autopar.strategies"
FALLBACK_KEY = "autopar.fallback"
MEMO_KEY = "autopar.strategy_memo"  # {(mesh shape, constant): (fallback, strategies)}, opt-in

_warned_ops: set[str] = set()


def leaf_candidates(val: torch.Tensor, partial: bool) -> list[pl.Placement]:
    out = [pl.R] + [pl.Shard(d) for d in range(val.dim())]
    return out + [pl.P] if partial else out


@functools.lru_cache(maxsize=None)
def _mesh_1d(size: int) -> DeviceMesh:
    """A mesh object for strategy functions only: no process group is created."""
    return DeviceMesh("cpu", torch.arange(size, device="cpu"), _init_backend=False, _rank=0)


def _meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def _schema(node: torch.fx.Node, wrap) -> OpSchema:
    """A list of tensors wrapped as strategies becomes one TupleStrategy, as op strategy
    functions (cat, stack) expect."""
    def convert(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            return wrap(v) if isinstance(v, torch.Tensor) else v
        if isinstance(a, (list, tuple)):
            items = type(a)(convert(x) for x in a)
            if items and all(isinstance(x, OpStrategy) for x in items):
                return TupleStrategy(list(items))
            return items
        return a
    return OpSchema(node.target, tuple(convert(a) for a in node.args), {k: convert(v) for k, v in node.kwargs.items()})


def _from_single_dim(node, info, n_out, n_in) -> list[tuple]:
    schema = _schema(node, _meta)
    rules = info.func(node.target, schema.args_schema, schema.kwargs_schema)
    rules = _insert_single_dim_replication_strategy([list(r) for r in rules], n_out, n_in)
    rules = _fill_single_dim_strategy_placeholders({Shard(0)}, rules)
    return [(tuple(r[:n_out]), tuple(r[n_out:])) for r in rules]


def _from_op_strategy(node, func, size, by_bags: frozenset[str] = frozenset()) -> list[tuple]:
    mesh = _mesh_1d(size)
    ragged = {id(a.meta["val"]) for a in tensor_args(node) if a.name in by_bags}

    def candidates(val):  # only even shardings: some strategy functions raise on uneven ones
        return OpStrategy([OpSpec(DTensorSpec(mesh, (dtensor_placement(p),), tensor_meta=_meta(val)))
                           for p in leaf_candidates(val, partial=True)
                           if evenly_sharded(val.shape, (p,), (size,), id(val) in ragged)])

    try:
        specs = list(getattr(func(_schema(node, candidates)), "strategies", []))
    except Exception:
        if len(tensor_args(node)) != 1:
            raise
        # view functions raise on a whole candidate set when one candidate cannot flatten or
        # unflatten evenly: ask again one input placement at a time and keep those that work
        specs = []
        for one in candidates(tensor_args(node)[0].meta["val"]).strategies:
            try:
                specs += getattr(func(_schema(node, lambda _v, one=one: OpStrategy([one]))), "strategies", [])
            except Exception:
                continue
    rules = []
    for spec in specs:
        outs = spec.output_specs if isinstance(spec.output_specs, (list, tuple)) else (spec.output_specs,)
        rules.append((tuple(o.placements[0] if o is not None else None for o in outs),
                      tuple(i.placements[0] for i in (spec.input_specs or ()))))
    return rules


def one_dim_strategies(node: torch.fx.Node, size: int, by_bags: frozenset[str] = frozenset()
                       ) -> list[tuple[tuple, tuple]] | None:
    """(outputs, inputs) placements on a 1-D mesh of ``size``; None = no DTensor rule.
    ``by_bags``: arguments whose first dim splits by bags, evenly or not."""
    ins = tensor_args(node)
    outs = output_vals(node)
    if node.target is operator.getitem:
        val = node.meta["val"]
        return [((p,), (p,)) for p in leaf_candidates(val, partial=True)]
    if not ins:  # factory ops (arange, full, …) produce replicated constants
        return [(tuple(pl.R if isinstance(v, torch.Tensor) else None for v in outs), ())]
    if node.target is FUSED_ATTENTION:
        return _attention_rules(node)
    if node.target in SAMPLE_LOCAL:  # no DTensor rule; each device runs its samples (passes.sample_local)
        return sample_local_rules(node)
    prop = DTensor._op_dispatcher.sharding_propagator
    if not _backward_supported(node.target, prop):
        return None
    try:
        if node.target in prop.op_single_dim_strategy_funcs:
            raw = _from_single_dim(node, prop.op_single_dim_strategy_funcs[node.target], len(outs), len(ins))
        elif node.target in prop.op_strategy_funcs:
            raw = _from_op_strategy(node, prop.op_strategy_funcs[node.target], size, by_bags)
        else:
            return None
    except Exception as exc:  # a DTensor rule that cannot handle these args: treat as missing
        log.debug("strategy function for %s failed: %s", node.target, exc)
        return None
    rules = set()
    for out_p, in_p in raw:
        outs_s = tuple(None if p is None else planned(p) for p in out_p)
        ins_s = tuple(planned(p) for p in in_p)
        if node.target is torch.ops.aten.embedding.default and outs_s == (pl.Partial("mask"),):
            # row-wise lookup: DTensor masks the replicated indices locally (no communication)
            # and the masked rows make the result a plain partial sum; lowering does both
            # explicitly (runtime.rowwise_embedding), so plan it as indices R -> output P
            outs_s, ins_s = (pl.P,), (ins_s[0], pl.R)
        if len(ins_s) != len(ins) or any(p is None for p in ins_s) or any(
                o is None and p is not None for o, p in zip(outs_s, out_p)):
            continue
        rules.add((outs_s, ins_s))
    all_r = (tuple(pl.R if isinstance(v, torch.Tensor) else None for v in outs), (pl.R,) * len(ins))
    rules.add(all_r)
    return sorted(rules, key=lambda r: (r != all_r, r))


def _attention_rules(node: torch.fx.Node) -> list[tuple[tuple, tuple]]:
    """Fused attention on one mesh dim: replicated, split by batch (dim 0), or split by heads
    (dim 1 of 4-D query, key, value and output; key and value heads must split evenly too, so
    grouped-query heads stay with their queries). A mask splits along with them where it has
    those dims, else it is replicated. Every split is exact: each device runs the fused kernel
    on its own sequences or heads (passes.attention_runtime). Self-attention with no mask may
    also split its sequence (dim 2, passes.context_parallel). DTensor's own rules cover only
    the CUDA kernels; these hold for every device."""
    query, *_rest = attention_args(node)
    ins = tensor_args(node)
    mask = ins[3].meta["val"] if len(ins) > 3 else None
    rules = [((pl.R,), (pl.R,) * len(ins))]
    for dim in (0, 1) if query.meta["val"].dim() == 4 else (0,):
        split = pl.Shard(dim)
        mask_p = () if mask is None else (split if mask.dim() == 4 and mask.shape[dim] > 1 else pl.R,)
        rules.append(((split,), (split, split, split, *mask_p)))
    sequence = context_rule(node)  # context parallelism: keys and values gathered in the op
    return rules + ([sequence] if sequence else [])


def _has_rule(op, prop) -> bool:
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs or op in prop.op_to_rules


@functools.lru_cache(maxsize=None)
def _backward_supported(op, prop) -> bool:
    """False when ``aten.<name>_backward`` exists but DTensor has no rule for it (e.g. avg_pool2d):
    autograd would hit it on DTensors, so the op must run locally instead. A backward that is
    CompositeImplicitAutograd (``gather_backward``: zeros + scatter_add) never reaches DTensor
    as itself — it decomposes into ops with rules — so it does not count."""
    packet = getattr(op, "overloadpacket", None)
    if packet is None:
        return True
    candidates = [getattr(torch.ops.aten, f"{packet.__name__}{suffix}", None)
                  for suffix in ("_backward", "_dense_backward")]
    overloads = [getattr(c, name) for c in candidates if c is not None for name in c.overloads()]
    overloads = [o for o in overloads if not torch._C._dispatch_has_kernel_for_dispatch_key(
        o.name(), torch._C.DispatchKey.CompositeImplicitAutograd)]
    return not overloads or any(_has_rule(o, prop) for o in overloads)


def enumerate_strategies(graph: torch.fx.Graph, mesh_shape: tuple[int, ...],
                         skip: "set[str] | dict[str, str]" = frozenset()) -> None:
    """Attach the list of N-D strategies to every call_function node not in ``skip`` (copies
    of a repeated layer, which take their representative's)."""
    cache: dict = {}
    varying = {n.name for n in graph.nodes if n.op == "placeholder"}
    counts = id_indexed(graph)  # dim 0 a batch's id count: split by bags only
    by_bags = bag_split_inputs(graph)[1] if counts else set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        node.meta.pop(FALLBACK_KEY, None)
        node.meta.pop(STRATEGIES_KEY, None)
        if any(a.name in varying for a in node.all_input_nodes):
            varying.add(node.name)
        if node.name in skip:
            continue
        memo = node.meta.get(MEMO_KEY)  # shared by this node's copies in pipeline-stage graphs
        memo_key = (tuple(mesh_shape), node.name not in varying)
        if memo is not None and memo_key in memo:
            fallback, node.meta[STRATEGIES_KEY] = memo[memo_key]
            if fallback:
                node.meta[FALLBACK_KEY] = True
            continue
        if node.target is aten_repeat_interleave and node.name in by_bags:
            node.meta[STRATEGIES_KEY] = bag_number_strategies(node, mesh_shape)
        else:
            ragged = frozenset(n for n in (node.name, *(a.name for a in node.all_input_nodes)) if n in by_bags)
            _enumerate_node(node, mesh_shape, node.name not in varying, cache, ragged)
        if counts:
            node.meta[STRATEGIES_KEY] = split_ids_by_bags_only(node, node.meta[STRATEGIES_KEY], counts, by_bags)
        if memo is not None:
            memo[memo_key] = (node.meta.get(FALLBACK_KEY, False), node.meta[STRATEGIES_KEY])


def _enumerate_node(node: torch.fx.Node, mesh_shape: tuple[int, ...], constant: bool, cache: dict,
                    by_bags: frozenset[str] = frozenset()) -> None:
    """Strategies of one node on ``mesh_shape`` (``cache``: one-dim rules by op signature).
    ``by_bags``: its tensors (itself, its arguments) whose first dim splits by bags."""
    per_dim = []
    batch_only = batch_only_dims(mesh_shape)
    for dim, size in enumerate(mesh_shape):
        key = (_cache_key(node, size), by_bags)
        if key not in cache:
            cache[key] = one_dim_strategies(node, size, by_bags)
        rules = cache[key]
        if rules is not None and node.target is not operator.getitem:
            rules = [r for r in rules if _worth_planning(r, constant=constant)]
        if rules is not None and dim in batch_only:  # an op with no such rule keeps all of them
            rules = [r for r in rules if _splits_batch_only(r)] or rules
        per_dim.append(rules)
    custom = node.target in DTensor._op_dispatcher._custom_op_handlers
    if any(rules is None for rules in per_dim):
        _warn_fallback(node)
        node.meta[FALLBACK_KEY] = True
        node.meta[STRATEGIES_KEY] = [_replicated(node, mesh_shape)]
        return
    strategies = _combine(node, per_dim, mesh_shape, by_bags)
    if custom:  # DTensor's hand-written handlers (convolution) reject one dim sharded twice
        strategies = [s for s in strategies if not any(_shards_dim_twice(p) for p in (*s.outputs, *s.inputs))]
    if node.target is FUSED_ATTENTION:  # the sequence split on one mesh dim at most; causal: also balanced
        strategies = [s for s in strategies if sum(p == SEQUENCE_SPLIT for p in s.outputs[0]) <= 1]
        strategies += balanced_twins(node, strategies, mesh_shape)
    node.meta[STRATEGIES_KEY] = strategies


def batch_only_dims(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Mesh dims whose op placements are only replicated or split on the first tensor dim
    (the module docstring's third pruning): the outer dim of a 3-D mesh."""
    return (0,) if len(mesh_shape) == 3 else ()


def _splits_batch_only(rule: tuple[tuple, tuple]) -> bool:
    outputs, inputs = rule
    return all(p is None or p is pl.R or p == BATCH_SPLIT for p in (*outputs, *inputs))


BATCH_SPLIT = pl.Shard(0)
aten_repeat_interleave = torch.ops.aten.repeat_interleave.Tensor  # each id's bag number


def _worth_planning(rule: tuple[tuple, tuple], constant: bool) -> bool:
    """The two prunings of the module docstring, on one (outputs, inputs) rule of one mesh dim."""
    outputs, inputs = rule
    if constant:  # never partial
        return not any(p is not None and p.is_partial for p in (*outputs, *inputs))
    return not any(p.is_partial and p is not pl.P for p in inputs)  # no non-sum partial inputs


def _replicated(node: torch.fx.Node, mesh_shape: tuple[int, ...]) -> Strategy:
    everywhere = pl.replicated(len(mesh_shape))
    return Strategy(tuple(everywhere if isinstance(v, torch.Tensor) else None for v in output_vals(node)),
                    (everywhere,) * len(tensor_args(node)))


def _combine(node, per_dim, mesh_shape, by_bags: frozenset[str] = frozenset()) -> list[Strategy]:
    outs = output_vals(node)
    out_ragged = node.name in by_bags
    in_ragged = [a.name in by_bags for a in tensor_args(node)]
    # plain int tuples: a fake tensor's shape is rebuilt on every access
    out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in outs]
    in_shapes = [tuple(a.meta["val"].shape) for a in tensor_args(node)]
    result = []
    for combo in itertools.product(*per_dim):
        out_pl = tuple(None if combo[0][0][k] is None else tuple(c[0][k] for c in combo) for k in range(len(outs)))
        in_pl = tuple(tuple(c[1][k] for c in combo) for k in range(len(in_shapes)))
        if node.target is operator.getitem:  # its "input" is the producer's output it selects
            in_pl = out_pl
        ok = all(evenly_sharded(shape, p, mesh_shape, out_ragged) for shape, p in zip(out_shapes, out_pl)
                 if p is not None and shape is not None)
        ok = ok and all(evenly_sharded(shape, p, mesh_shape, ragged)
                        for shape, p, ragged in zip(in_shapes, in_pl, in_ragged))
        if ok:
            result.append(Strategy(out_pl, in_pl))
    return result


def _shards_dim_twice(spec: pl.Spec | None) -> bool:
    dims = [p for p in spec or () if p.is_shard]
    return len(dims) != len(set(dims))


def _cache_key(node: torch.fx.Node, size: int):
    def describe(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            return (tuple(v.shape), tuple(v.stride()), v.dtype) if isinstance(v, torch.Tensor) else repr(v)
        if isinstance(a, (list, tuple)):
            return tuple(describe(x) for x in a)
        return repr(a)
    out = describe(node) if node.target is operator.getitem else None
    return (node.target, describe(node.args), describe(node.kwargs), out, size)


def _warn_fallback(node: torch.fx.Node) -> None:
    name = str(node.target)
    if name not in _warned_ops:
        _warned_ops.add(name)
        log.warning("no usable DTensor sharding rule for %s (none registered, or it rejects these arguments; "
                    "first seen at node %s): it runs replicated", name, node.name)


def work_split(strategy: Strategy, mesh_shape: tuple[int, ...]) -> int:
    """Devices the node's work is divided over: mesh dims where its first output is not replicated."""
    first = next((p for p in strategy.outputs if p is not None), None)
    if first is None:
        return 1
    return math.prod(size for p, size in zip(first, mesh_shape) if p is not pl.R)
