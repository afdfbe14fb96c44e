"""Build the :class:`ShardingProblem` for one mesh from an annotated graph.

Problem nodes are the graph's placeholders (parameters, buffers, user inputs), its
call_function nodes and one sink for the outputs (which are gathered to full tensors).

Costs of one training step, per device:
  * compute: roofline time of the node on its share of the work, ×3 for nodes on the
    gradient path (forward + two backward matmuls' worth), ×1 otherwise;
  * resharding on an edge, per mesh dim of n devices over its link (ring formulas in
    autopar.comm), forward then backward:
      forward  S→R all-gather · S(i)→S(j) all-to-all · P→R all-reduce · P→S reduce-scatter ·
               R→S and R→P free (local; R→P lets a replicated bias join a row-parallel matmul) ·
               S→P and any other reduction into a partial forbidden;
      backward the gradient arrives in the consumer's input placement, or as a partial sum
               when the input was replicated but the consumer's work is split on that dim, and
               is converted back to the producer's placement by the same table. This is also
               where data-parallel gradient all-reduce of a replicated parameter is paid.
  * memory: parameters + gradients + optimizer states (by their sharding), the user
    inputs, and the forward outputs autograd keeps for backward (passes.memory) by their
    sharding. Partial outputs count in full.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from autopar import placements as pl
from autopar.comm import DDP_BUCKET_BYTES
from autopar.devices import DeviceSpec
from autopar.mesh import MeshSpec
from autopar.plan_types import LOSS_SPLIT_DIMS
from autopar.problem import Edge, ShardingProblem, any_overlap
from autopar.passes.bag_strategies import split_ids_by_bags_only
from autopar.passes.capture import Captured
from autopar.passes.context_parallel import causal_imbalance, gathered_kv_bytes, kv_exchange_s
from autopar.passes.cost import COST_KEY, FUSED_ATTENTION, tensor_bytes
from autopar.passes.embedding_bag import bag_split_inputs, id_indexed
from autopar.passes.expert_dispatch import add_expert_dispatch
from autopar.passes.layer_recompute import recomputed_layers
from autopar.passes.memory import SAVED_KEY
from autopar.passes.problem_edges import edge_args, follows, make_edge, tensor_index
from autopar.passes.node_memory import (
    OPTIMIZER_STATES, ParameterBytes, kept_bytes, leaving_bytes, loss_bytes, output_bytes, parameter_bytes, zero_twins)
from autopar.passes.sparse import add_sparse_exchange, add_table_wise, owned_table_options, table_wise_tables
from autopar.passes.stack_experts import add_owned_stacks, expert_members, owned_leaf_options
from autopar.passes.symbolic import SYMBOLIC_BYTES_KEY, SYMBOLIC_COST_KEY
from autopar.passes.stages import layer_order, node_layer, outside_layers
from autopar.passes.strategy_exchanges import exchange_s
from autopar.passes.strategies import (
    FALLBACK_KEY, STRATEGIES_KEY, enumerate_strategies, leaf_candidates, work_split)
from autopar.passes.strategy_types import Strategy, evenly_sharded, output_vals

SAVED_CLASSES = ("matmul", "attention")  # what selective recomputation keeps (passes.recompute saves them)
OUTPUT = "<output>"


@dataclass
class ProblemIndex:
    """What each problem node stands for, so a solution maps back to the graph."""

    names: list[str]  # graph node name (of the representative copy), or OUTPUT
    strategies: list[list[Strategy]]
    kinds: list[str]  # "param", "buffer", "input", "op", "output"
    node_of: dict[str, int]  # every graph node name (copies included) -> problem node
    edge_of: dict[tuple[str, str, int], int]  # graph edge (producer, consumer, arg) -> problem edge
    fallback: list[bool]  # op runs replicated for lack of a DTensor rule
    # parameter node -> its bytes per strategy by kind (master, gradient, states, working copy)
    parameter_memory: dict[int, list[ParameterBytes]] = dataclasses.field(default_factory=dict)
    # recomputation: node -> per strategy, the activation bytes it would keep without it, and
    # the forward time it reruns in backward (what recomputing saves and costs)
    kept_without_recompute: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    rerun_s: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    # node -> per strategy, the bytes of its memory that are one recomputed layer's activations,
    # live in backward while that layer reruns (not handed from forward to backward)
    rerun_buffer: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # overlap group id -> the layer it is ("" outside every layer), in the order the graph runs them
    group_names: list[str] = dataclasses.field(default_factory=list)


def build_problem(captured: Captured, mesh: MeshSpec, device: DeviceSpec, memory_limit_bytes: int,
                  optimizer: str = "adamw", repeated: dict[str, str] | None = None, activation_copies: int = 1,
                  symbolic: bool = False, tables_whole: bool = False,
                  recompute: str | None = None, zero: bool = True,
                  loss_on_outputs: bool = False, overlap_efficiency: float = 0.0, prefetch: bool = True,
                  collective_overlap: tuple[tuple[str, float], ...] = (), bucket_bytes: int = DDP_BUCKET_BYTES,
                  edges_without_fit: bool = True, edges: bool = True, held_layers: int = 1
                  ) -> tuple[ShardingProblem, ProblemIndex]:
    """``repeated`` maps nodes of repeated layers to their representative (passes.layers):
    only representatives become problem nodes, and identical edges are merged with a count.
    ``activation_copies``: micro-batches whose activations a pipeline stage holds at once.
    ``symbolic``: times as sympy expressions in the batch size, from the quantities
    passes.symbolic attached (memory stays in numbers); for evaluating a plan, not solving.
    Batched experts' weights may also take the "O" placement (passes.stack_experts; the
    stack nodes' twins come from :func:`add_owned_stacks`), and so may sparse tables whose
    lookups have table-wise twins (passes.sparse.add_table_wise). A table-wise table counts
    1/n of its bytes on each of the n devices of its dim (owners spread the tables; the
    planner checks the owners it picks, :func:`passes.strategy_exchanges.table_wise_by_owners`), or with ``tables_whole``
    all of them on every device (a bound that holds whatever the owners). ``recompute="full"``:
    every layer is checkpointed whole (passes.recompute): its nodes run forward twice and keep only
    what leaves the layer, plus, counted once, the activations of one layer while it reruns;
    ``"selective"``: the same, except that matmul and attention outputs are kept and not
    recomputed (torchtitan's op-level selective checkpointing); ``"full:N"``: every N-th layer
    checkpointed whole, the others keep their activations (passes.layer_recompute; a node
    standing for copies in several layers is charged the share of them recomputed), the rerun
    buffer counted only where a list's last layer reruns; ``"block:K"``: the first K layers
    checkpointed whole, charged the same way. ``zero``: parameters may also take
    ZeRO-2 twins (:func:`passes.node_memory.zero_twins`). ``loss_on_outputs``: the outputs feed
    the training step's loss here (a one-mesh plan; autopar.parallel): they may stay split along
    their batch dim (dim 0) where the work was, and the loss's fp32 copies of them are counted
    (passes.node_memory.loss_bytes); else they are gathered whole and nothing is counted for them
    (a pipeline stage sends them on). ``overlap_efficiency`` and ``collective_overlap`` (η per
    collective kind, any ≠ 0): each layer (the nodes outside every layer: one more group) is an
    overlap group — its parameters' collectives (weight gathers, prefetched one layer ahead as
    FSDP2 does, and gradient reductions, issued during backward as DDP's buckets are) run beside
    its compute for the fraction η of their kind (autopar.problem, solvers.formulation), and so
    does the backward re-gather of a weight freed after forward (FSDP2 prefetches it); every
    other collective stays on the critical path. One copy of the first layer's collectives hides
    behind nothing (its gathers run before any compute, its gradients' reduction after the last).
    Without ``prefetch`` a weight is gathered where it is read: its forward gathers are exposed.
    ``bucket_bytes``: the lowered program's gradient buckets (each pays one collective's latency).
    A weight gathered for use (FSDP's unsharded parameter) is held while its layer runs, and so
    are those of the ``held_layers`` − 1 layers prefetched ahead of it: the memory counts the
    most any ``held_layers`` consecutive layers gather (weights outside every layer: one run
    before the first layer, one after the last; none in a ``symbolic`` problem).
    Without ``edges_without_fit``, a problem that cannot fit even with every node at its least
    memory (:meth:`ShardingProblem.min_memory`, which edges do not change) gets no edges: no
    solver needs them to call it infeasible, and they are most of a problem's building. Without
    ``edges`` none are built at all: the nodes' memory of a choice is all a caller wants."""
    graph = captured.graph
    repeated = repeated or {}
    grad_nodes = gradient_path(graph, captured)
    members = expert_members(graph)
    tables = table_wise_tables(graph)
    id_counts = id_indexed(graph)
    by_bags = bag_split_inputs(graph)[1] if id_counts else set()
    names, strategies, kinds, costs, memory, counts, fallback = [], [], [], [], [], [], []
    own_comm, forward_compute, node_group, group_of = [], [], [], {}  # overlap (autopar.problem)
    parameter_memory: dict[int, list[ParameterBytes]] = {}
    recomputed: dict[int, tuple[list[int], list[int], bool, float]] = {}
    kept_without_recompute: dict[int, list[int]] = {}
    rerun_s: dict[int, list[float]] = {}
    rerun_buffer: dict[int, list[int]] = {}
    ordered_layers = layer_order(graph)
    checkpointed = recomputed_layers(ordered_layers, recompute)
    buffered = _rerun_buffer_layers(ordered_layers, checkpointed)
    copy_layers = _copy_layers(graph, repeated) if checkpointed else {}
    position: dict[str, int] = {}
    states = OPTIMIZER_STATES[optimizer]

    for node in graph.nodes:
        if node.name in repeated:
            continue
        if node.op == "placeholder":
            kind = ("param" if node.name in captured.parameter_of else
                    "buffer" if node.name in captured.buffer_of else "input")
            val = node.meta["val"]
            options = split_ids_by_bags_only(node, _leaf_strategies(val, mesh.shape, node.name in by_bags), id_counts,
                                             by_bags) if kind != "buffer" \
                else [Strategy((pl.replicated(len(mesh.shape)),), ())]
            if node.name in members:  # a batched expert's weight may live on its owner only
                options += [Strategy((p,), ()) for p in owned_leaf_options(
                    [s.outputs[0] for s in options], members[node.name][1], mesh.shape)]
            if node.name in tables:  # a table may live whole on one device of a dim (table-wise)
                options += [Strategy((p,), ()) for p in owned_table_options(mesh.shape)]
            if kind == "param":
                trainable = node.name not in captured.frozen
                if zero and trainable:  # ZeRO-2: used as placed, master, gradient and states split further
                    options += zero_twins(options, val, mesh.shape)
                whole = tables_whole and node.name in tables
                held = [parameter_bytes(val, s, mesh.shape, states, captured.master_itemsize.get(node.name),
                                        1 if whole and pl.O in s.outputs[0] else None, trainable) for s in options]
                parameter_memory[len(names)] = held
                mem = [h.total for h in held]
            else:
                copies = activation_copies if kind == "input" else 1
                mem = [copies * tensor_bytes(val) // _shards(s.outputs[0], mesh.shape) for s in options]
            cost = [0.0] * len(options)
            exchange, forward, group = cost, cost, -1
        elif node.op == "call_function":
            kind, options = "op", node.meta[STRATEGIES_KEY]
            op_cost = node.meta[COST_KEY]
            # the layers this node stands for (its own, and its copies' where it represents them),
            # and the share of them run again in backward
            layers = [node_layer(node), *copy_layers.get(node.name, ())] if checkpointed else []
            share = sum(layer in checkpointed for layer in layers) / len(layers) if layers else 0.0
            stored = share > 0 and recompute == "selective" and op_cost.op_class in SAVED_CLASSES
            rerun = share if not stored else 0.0
            factor = (3 if node.name in grad_nodes else 1) + rerun
            timed = node.meta[SYMBOLIC_COST_KEY] if symbolic else op_cost
            forward = [timed.time_s(device, work_split(s, mesh.shape) * causal_imbalance(node, s, mesh.shape))
                       for s in options]
            exchange = [exchange_s(node, s, mesh, device) for s in options]
            if rerun and node.target is FUSED_ATTENTION:  # recomputed: its forward gathers run again
                exchange = [x + rerun * kv_exchange_s(node, s, mesh, forward_only=True)
                            for x, s in zip(exchange, options)]
            cost = [factor * f + x for f, x in zip(forward, exchange)]
            group = group_of.setdefault(node_layer(node) or "", len(group_of))
            if rerun:
                rerun_s[len(names)] = [rerun * f for f in forward]
            saved = node.meta[SAVED_KEY]
            mem = [0 if op_cost.is_view else kept_bytes(node, s, saved, mesh.shape, activation_copies)
                   + gathered_kv_bytes(node, s, mesh.shape, activation_copies) for s in options]
            if stored:  # selective: the checkpoint caches matmul and attention outputs, all of them
                cached = [0 if op_cost.is_view else output_bytes(node, s, mesh.shape, activation_copies)
                          + gathered_kv_bytes(node, s, mesh.shape, activation_copies) for s in options]
                recomputed[len(names)] = (cached, mem, False, 1.0)
            elif rerun:  # keeps what leaves the layer; one layer's activations while it reruns
                layer = layers[0]
                leaves = [0 if op_cost.is_view else leaving_bytes(node, s, layer, mesh.shape, activation_copies)
                          for s in options]
                buffer = any(other and buffered.get(other.rsplit(".", 1)[0]) == other for other in layers)
                recomputed[len(names)] = (leaves, mem, buffer, rerun)
        else:
            continue
        position[node.name] = len(names)
        names.append(node.name)
        strategies.append(options)
        kinds.append(kind)
        costs.append(cost)
        own_comm.append(exchange)
        forward_compute.append(forward)
        node_group.append(group)
        memory.append(mem)
        counts.append(1)
        fallback.append(bool(node.meta.get(FALLBACK_KEY, False)))
    for name, rep in repeated.items():
        position[name] = position[rep]
        counts[position[rep]] += 1
    for q, (leaves, whole, buffer, share) in recomputed.items():  # one layer's worth, over its copies
        kept_without_recompute[q] = whole
        if buffer:
            rerun_buffer[q] = [full // counts[q] for full in whole]
        memory[q] = [(kept if share == 1.0 else round(share * kept + (1 - share) * full)) + extra
                     for kept, full, extra in zip(leaves, whole, rerun_buffer.get(q, [0] * len(leaves)))]

    out_node = graph.output_node()
    out_args = [a for a in torch.utils._pytree.tree_flatten(out_node.args)[0]
                if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    position[OUTPUT] = len(names)
    names.append(OUTPUT)
    strategies.append(_sink_strategies(graph, captured, out_args, mesh.shape, loss_on_outputs))
    kinds.append("output")
    costs.append([0.0] * len(strategies[-1]))
    own_comm.append(costs[-1])
    forward_compute.append(costs[-1])
    node_group.append(-1)
    memory.append([activation_copies * loss_bytes(out_args, sink, mesh.shape) if loss_on_outputs else 0
                   for sink in strategies[-1]])
    counts.append(1)
    fallback.append(False)

    first_layer = next(iter(layer_order(graph)), None)
    problem = ShardingProblem(names, costs, memory, [], memory_limit_bytes, node_count=counts,
                              node_group=node_group, node_comm=own_comm, node_forward=forward_compute,
                              overlap_efficiency=overlap_efficiency, collective_overlap=collective_overlap,
                              prefetch=prefetch, exposed_group=group_of.get(first_layer, -1))
    index = ProblemIndex(names, strategies, kinds, position, {}, fallback, parameter_memory,
                         kept_without_recompute, rerun_s, rerun_buffer, list(group_of))
    if not edges or not edges_without_fit and problem.min_memory() > memory_limit_bytes:
        return problem, index
    weights = _parameter_views(graph, captured)
    held_layer, held_windows = ({}, ()) if symbolic else _held_layers(graph, repeated, held_layers, weights)
    overlaps = any_overlap(overlap_efficiency, collective_overlap)
    edges: list[Edge] = []
    edge_at: dict[tuple, int] = {}  # identical graph edges (same representatives) -> one problem edge
    edge_of = index.edge_of
    for node in list(graph.nodes):
        if node.op == "call_function":
            consumer, args = node, edge_args(node)
        elif node is out_node:
            consumer, args = None, [(a, 0) for a in out_args]
        else:
            continue
        j = position[OUTPUT] if consumer is None else position[consumer.name]
        for a, (producer, out_index) in enumerate(args):
            i = position[producer.name]
            key = (i, j, a, out_index, producer.name in grad_nodes, producer.name in weights)
            if key not in edge_at:
                nbytes = (producer.meta[SYMBOLIC_BYTES_KEY][tensor_index(producer, out_index)] if symbolic
                          else tensor_bytes(output_vals(producer)[out_index]))
                edge_at[key] = len(edges)
                edges.append(make_edge(i, j, a, out_index, strategies[i], strategies[j], nbytes, key[4], key[5], mesh,
                                   follow=consumer is not None and follows(consumer, a),
                                   sync_nbytes=_master_grad_bytes(captured, producer, out_index, nbytes)
                                   if key[5] else None,
                                   group=node_group[j] if key[5] and overlaps else -1,
                                   bucket_bytes=bucket_bytes, by_bags_only=producer.name in id_counts,
                                   held_layer=held_layer.get(consumer.name, -1) if key[5] and consumer is not None
                                   else -1))
            else:
                k = edge_at[key]
                edges[k] = dataclasses.replace(edges[k], count=edges[k].count + 1)
            edge_of[(producer.name, OUTPUT if consumer is None else consumer.name, a)] = edge_at[key]

    return dataclasses.replace(problem, edges=edges, held_windows=held_windows), index


def _held_layers(graph: torch.fx.Graph, repeated: dict[str, str], width: int, weights: set[str]
                 ) -> tuple[dict[str, int], tuple[tuple[int, ...], ...]]:
    """The runs of ops whose gathered weights are held together (passes.reshard's ``_Layer``):
    each op's run — its layer, the copies of a repeated layer as their representative's, ops
    outside every layer as the run before the first layer or the one after it — and every
    ``width`` consecutive runs of ops reading ``weights`` in the order the graph runs them
    (backward meets the same sets), each set once: the layers held at once, the running one
    and those prefetched. (A residual add between layers reads no weight: no run.)"""
    by_name = {node.name: node for node in graph.nodes}
    runs: dict[str, int] = {}
    group_of: dict[str, int] = {}
    order: list[int] = []  # the run of every layer, or stretch outside layers, as the graph meets it
    current, seen_layer = None, False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        layer = node_layer(node)
        seen_layer = seen_layer or bool(layer)
        label = node_layer(by_name[repeated[node.name]]) if node.name in repeated else layer
        group = group_of[node.name] = runs.setdefault(label or outside_layers(seen_layer), len(runs))
        if (layer, group) != current and any(a.name in weights for a in node.all_input_nodes):
            current = (layer, group)
            order.append(group)
    windows = {tuple(sorted(order[k:k + width])) for k in range(max(1, len(order) - width + 1))}
    return group_of, tuple(sorted(windows))


def _sink_strategies(graph: torch.fx.Graph, captured: Captured, out_args: list[torch.fx.Node],
                     mesh_shape: tuple[int, ...], split: bool) -> list[Strategy]:
    """How the outputs may be delivered: whole on every device, and with ``split`` also split
    along dim 0 on any mesh dims — when every output's dim 0 is a batch dim (the size of a
    user input's dim 0) that splits evenly — or along dim 1, the sequence (a user input's dim 1
    of that size, in outputs of 3 dims or more: a token-level loss, e.g. next-token
    cross-entropy, on logits no device holds whole; passes.split_loss). All outputs are
    placed alike."""
    whole = Strategy((), tuple(pl.replicated(len(mesh_shape)) for _ in out_args))
    users = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"
             and n.name not in captured.parameter_of and n.name not in captured.buffer_of
             and isinstance(n.meta.get("val"), torch.Tensor)]
    vals = [a.meta["val"] for a in out_args]
    if not split or not vals:
        return [whole]
    splits = [pl.R]
    for dim in LOSS_SPLIT_DIMS:
        sizes = {v.shape[dim] for v in users if v.dim() > dim}
        # the batch needs the dim; a sequence (dim 1) a feature dim after it too: a (batch,
        # features) output's dim 1 is no sequence
        least_dims = dim + 1 if dim == 0 else dim + 2
        if all(v.dim() >= least_dims and v.shape[dim] in sizes for v in vals):
            splits.append(pl.Shard(dim))
    options = [whole]
    for combo in itertools.product(splits, repeat=len(mesh_shape)):
        if pl.is_replicated(combo):
            continue
        if all(evenly_sharded(v.shape, combo, mesh_shape) for v in vals):
            options.append(Strategy((), tuple(tuple(combo) for _ in out_args)))
    return options


def _rerun_buffer_layers(layers: list[str], checkpointed: dict[str, str]) -> dict[str, str]:
    """ModuleList -> the recomputed layer whose nodes count, once, the activations of one layer
    while it reruns in backward: only where the list's last layer is recomputed. Backward meets
    the highest recomputed layer first; a kept layer above it has by then freed its whole
    activations (as large as the rerun's), so the rerun adds nothing to the peak there."""
    members: dict[str, list[str]] = {}
    for layer in layers:
        members.setdefault(layer.rsplit(".", 1)[0], []).append(layer)
    return {parent: next(layer for layer in listed if layer in checkpointed)
            for parent, listed in members.items() if listed[-1] in checkpointed}


def _copy_layers(graph: torch.fx.Graph, repeated: dict[str, str]) -> dict[str, list[str | None]]:
    """Representative node -> the layers of the copies it stands for (passes.layers folds
    repeated layers onto one): what a mode recomputing only some layers charges it."""
    copies: dict[str, list[str | None]] = {}
    if repeated:
        for node in graph.nodes:
            if node.name in repeated:
                copies.setdefault(repeated[node.name], []).append(node_layer(node))
    return copies


def _master_grad_bytes(captured: Captured, producer: torch.fx.Node, out_index: int, nbytes):
    """Bytes of a weight's gradient where it is all-reduced: on the fp32 master gradient under
    mixed precision (passes.grad_sync), else as the edge carries it; None when they agree."""
    val = output_vals(producer)[out_index]
    if captured.compute_dtype is None or not isinstance(val, torch.Tensor) or val.dtype != captured.compute_dtype \
            or not captured.master_itemsize:  # a model already in the compute dtype has no fp32 masters
        return None
    return nbytes * (torch.finfo(torch.float32).bits // torch.finfo(val.dtype).bits)


def annotate_strategies(captured: Captured, mesh_shape: tuple[int, ...], skip: dict[str, str] | None = None) -> None:
    """Every node's strategies on a mesh of ``mesh_shape`` in node.meta: DTensor's
    (passes.strategies), and the twins autopar adds — sparse exchanges and table-wise
    lookups (passes.sparse), experts on their owners (passes.stack_experts), dispatched
    experts (passes.expert_dispatch). ``skip``: nodes of repeated layers (not enumerated)."""
    enumerate_strategies(captured.graph, mesh_shape, skip=skip or frozenset())
    add_sparse_exchange(captured.graph)
    add_table_wise(captured.graph, mesh_shape)
    add_owned_stacks(captured.graph, mesh_shape)
    add_expert_dispatch(captured.graph, mesh_shape)


def _leaf_strategies(val: torch.Tensor, mesh_shape: tuple[int, ...], by_bags: bool = False) -> list[Strategy]:
    options = []
    for combo in itertools.product(*[leaf_candidates(val, partial=False)] * len(mesh_shape)):
        if evenly_sharded(val.shape, combo, mesh_shape, by_bags):
            options.append(Strategy((tuple(combo),), ()))
    return options


def _shards(spec: pl.Spec, mesh_shape: tuple[int, ...]) -> int:
    """Devices a tensor's bytes are divided over (``O``: each expert's weight on one of them;
    ``D``: rows split, as by ``Shard(0)``)."""
    return pl.divided_over(spec, mesh_shape)


def _parameter_views(graph: torch.fx.Graph, captured: Captured) -> set[str]:
    """Parameters and views of them (a transposed weight is still the weight)."""
    names = set(captured.parameter_of)
    for node in graph.nodes:
        if node.op == "call_function" and node.meta[COST_KEY].is_view and any(
                a.name in names for a in node.all_input_nodes):
            names.add(node.name)
    return names


def gradient_path(graph: torch.fx.Graph, captured: Captured) -> set[str]:
    """Nodes whose floating-point output depends on a parameter (they get a backward)."""
    on_path = (set(captured.parameter_of) - captured.frozen) | set(captured.grad_inputs)
    for node in graph.nodes:
        if node.op == "call_function" and any(a.name in on_path for a in node.all_input_nodes):
            vals = [v for v in output_vals(node) if isinstance(v, torch.Tensor)]
            if any(v.dtype.is_floating_point for v in vals):
                on_path.add(node.name)
    return on_path


