"""Lowering: rewrite the captured graph so it runs the plan on DTensor.

The emitted module is ``ExportedProgram.module()`` with
  * parameters and buffers replaced by DTensors with the planned placements (parameters are
    distributed from rank 0, so all ranks start from the same weights);
  * a ``distribute_input`` node after every user input (each rank slices the full input);
  * a ``redistribute`` node wherever a consumer was planned with a placement its producer
    does not give (these are the collectives of the plan, visible in ``pmodel.code``);
  * ``replicate_constant`` after factory ops, ``local_call`` for ops with no DTensor rule;
  * ``relabel_experts`` after a router whose experts are placed in a balanced order
    (passes.expert_order; their stacks then list the experts in that order, stacked expert
    weights hold their rows in that order);
  * ``dispatch_experts`` (passes.expert_runtime) for experts gathered per token whose rows go to their owners
    (passes.expert_dispatch: the region they run through becomes one call);
  * ``table_wise_lookups`` for lookups in tables that live whole on one device (table-wise):
    every owner pools its tables' bags, one all-to-all for all of them;
  * ``sparse_embedding`` for lookups planned to exchange their table's gradient as rows,
    ``rowwise_embedding`` for lookups in a table sharded by rows;
  * ``bag_input``, ``bag_numbers`` and ``pool_bags`` (passes.bag_runtime) where bags of varying
    size split by bags: each device cuts its bags' ids from the full inputs, numbers them by
    its own bags and pools them into those;
  * ``to_full`` on every output, so callers get plain full tensors.
A sharded weight's gather is issued asynchronously a layer ahead of its reader (passes.reshard,
passes.prefetch: FSDP2's prefetch), its gradient reduce-scattered asynchronously in backward.
Gradients of parameters are brought to the parameter's placement during the backward pass
(passes.grad_sync: a replicated parameter's partial gradient is all-reduced once per step, in
buckets as DistributedDataParallel's, issued as they fill; every collective waited for when
backward ends).
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from autopar import placements as pl
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.passes import bag_runtime, expert_runtime, mode_ops, runtime
from autopar.passes.bag_lower import BagLowering
from autopar.passes.capture import Captured, compute_dtype_of, reduce_dtype_of
from autopar.passes.attention_runtime import local_attention
from autopar.passes.context_parallel import BALANCED_CAUSAL
from autopar.passes.cost import FUSED_ATTENTION, is_view_op, view_chain
from autopar.passes.dtensor_ops import relabel_experts
from autopar.passes.embedding_bag import count_free_inputs
from autopar.passes.recompute import checkpoint_layers
from autopar.passes.expert_order import Relabel, apply_relabel
from autopar.passes.fuse import bag_pools, fuse_dispatches, fuse_table_wise
from autopar.passes.place_state import distribute_state
from autopar.passes.sample_local import SAMPLE_LOCAL
from autopar.passes.prefetch import prefetch_gathers
from autopar.passes.reshard import WEIGHT_GATHERS_ATTR, WeightGathers, install
from autopar.passes.sparse import TABLE_WISE
from autopar.passes.stages import node_layer

MESH_ATTR = "_autopar_mesh"


def lower(captured: Captured, plan: Plan, mesh: DeviceMesh, model: nn.Module,
          same_graph: bool = False) -> torch.fx.GraphModule:
    """``same_graph``: the caller has checked that ``captured`` is the planned graph at other
    input shapes (passes.relower), whose fingerprint differs by its shapes."""
    if not same_graph and captured.fingerprint != plan.fingerprint:
        raise AutoparError(ErrorKind.BAD_PLAN,
                           f"plan was made for a different graph (fingerprint {plan.fingerprint}, this model "
                           f"captures as {captured.fingerprint}); re-plan this model")
    gm = captured.program.module()
    if count_free_inputs(captured.graph):
        # every id count is read from the ids (bag_runtime.id_count): the exported module's checks
        # of the inputs' sizes would only refuse other id counts. passes.relower decides which
        # shapes this program serves; torch's flag for callers that validate inputs themselves.
        gm = captured.program.module(check_guards=False)
        gm.validate_inputs = False
    lower_module(gm, [spec.name for spec in plan.inputs], plan, mesh, model, captured)
    if plan.recompute:
        checkpoint_layers(gm, plan.recompute)
    return gm


def lower_module(gm: torch.fx.GraphModule, input_names: list[str], plan: Plan, mesh: DeviceMesh, model: nn.Module,
                 captured: Captured, sync_on_accumulate: bool = True,
                 owner_meshes: dict[int, list[DeviceMesh]] | None = None) -> None:
    """Rewrite ``gm`` (the whole model, or one pipeline stage) in place for ``mesh``.
    ``input_names``: the plan's node for each placeholder, in order. Without
    ``sync_on_accumulate`` the caller brings gradients to their placements itself
    (:func:`sync_grads`, once after all micro-batches). ``owner_meshes``: ``mesh``'s sub-meshes
    for expert weights placed "O" (:func:`owner_submeshes`), when the caller built them —
    needed where not every rank lowers this mesh (pipeline stages)."""
    distribute_state(gm, plan, mesh, model, captured, sync_on_accumulate, owner_meshes)
    setattr(gm, MESH_ATTR, mesh)
    overlap = plan.options.get("overlap", True)  # off: the program's collectives wait where issued
    gathers = WeightGathers(overlap, plan.options.get("prefetch_layers", 1))
    setattr(gm, WEIGHT_GATHERS_ATTR, gathers)
    _relabel_experts(gm, plan)
    # parameters computing in their own dtype under mixed precision (batch norm's: capture)
    own_dtype = {fqn for name, fqn in captured.parameter_of.items() if name not in captured.master_itemsize}
    _rewrite(gm, plan, input_names, own_dtype)
    _follow_mode(gm)
    if overlap:
        prefetch_gathers(gm.graph, set(plan.recompute), plan.options.get("prefetch_layers", 1))
    gm.recompile()
    if any(n.op == "call_method" and n.target == "gather" for n in gm.graph.nodes):
        install(gm, gathers)


_MODE_OPS = {torch.ops.aten.native_dropout.default: mode_ops.dropout,
             torch.ops.aten._native_batch_norm_legit_functional.default: mode_ops.batch_norm}


def _follow_mode(gm: torch.fx.GraphModule) -> None:
    """The graph is captured in training mode; ops that behave otherwise in evaluation
    (dropout, batch norm) follow the lowered module's mode at run time (``pmodel.eval()``):
    ``mode_ops.dropout`` and ``mode_ops.batch_norm`` read it — and ``mode_ops.dropout_mask`` where
    a dropout was captured decomposed (``bernoulli_(keep)`` then ``div_(keep)``: torch.export
    writes some so, and timm's drop-path is written so) — and the buffers a training forward
    updates (batch norm's running statistics; ``copy_`` nodes torch.export's module adds at the
    end) are written back only in training, through ``mode_ops.update_buffer``, which does not
    bump the version autograd checks: the op that read a buffer may have saved it for backward
    (batch norm saves its running statistics)."""
    graph = gm.graph
    buffers = {name for name, _ in gm.named_buffers()}
    mode = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        buffer_update = (node.target is torch.ops.aten.copy_.default and isinstance(node.args[0], torch.fx.Node)
                         and node.args[0].op == "get_attr" and node.args[0].target in buffers)
        if buffer_update:
            replacement = mode_ops.update_buffer
        elif node.target is torch.ops.aten.bernoulli_.float and _divided_by_its_probability(node):
            replacement = mode_ops.dropout_mask
            node.args, node.kwargs = (node.args[0], _probability(node)), {}
        elif node.target in _MODE_OPS:
            replacement = _MODE_OPS[node.target]
        else:
            continue
        if mode is None:
            with graph.inserting_before(next(iter(graph.nodes))), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a plain attribute, not a tensor
                mode = graph.get_attr("training")
        node.target = replacement
        node.args = (*node.args, mode)


def _probability(node: torch.fx.Node) -> float:
    """The probability of a ``bernoulli_.float`` node, given by position or by name."""
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)


def _divided_by_its_probability(node: torch.fx.Node) -> bool:
    """A ``bernoulli_(keep)`` whose mask is then divided by ``keep``: a dropout's mask."""
    keep = _probability(node)
    return any(user.target is torch.ops.aten.div_.Scalar and user.args[0] is node and user.args[1] == keep
               for user in node.users)


def _relabel_experts(gm: torch.fx.GraphModule, plan: Plan) -> None:
    """Routers of experts placed in a balanced order speak in slots (passes.expert_order)."""
    held = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    for module, layer in plan.experts.items():
        if not layer.get("order_applied"):
            continue
        relabel = Relabel.from_plan(layer["relabel"])
        if not apply_relabel(gm.graph, relabel, layer["order"]) and held & set(relabel.permuted):
            raise AutoparError(ErrorKind.BAD_PLAN,
                               f"MoE layer {module}: its experts' weights are stored in the balanced order, but "
                               f"this graph lacks the router node {relabel.node} that must follow that order (a "
                               "pipeline stage cut between them?); re-plan this model")


def _rewrite(gm: torch.fx.GraphModule, plan: Plan, input_names: list[str], own_dtype: set[str]) -> None:
    graph = gm.graph
    first = next(iter(graph.nodes))
    with graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mesh is a plain attribute, not a tensor
        mesh_node = graph.get_attr(MESH_ATTR)
        gathers = graph.get_attr(WEIGHT_GATHERS_ATTR)
    produced: dict[str, str | None] = {}  # node name -> placement it carries at run time
    weights: set[str] = set()  # parameters, their compute copies and views: gathered ones are resharded
    compute_dtype = compute_dtype_of(plan)  # mixed precision: weights and inputs cast for compute
    reduce_dtype = reduce_dtype_of(plan)  # ... and gathered weights' gradients reduced in this
    user_inputs = [n for n in graph.nodes if n.op == "placeholder"]
    bag_lowering = BagLowering(graph)  # bags of varying size, read before the inputs' uses are rewritten
    bags = bag_pools(graph)  # ... and what a table-wise table's owner pools them from
    for node, name in zip(user_inputs, input_names, strict=True):
        planned = plan.nodes[name].outputs[0]
        traced = node.meta.get("val")
        cast = traced.dtype if compute_dtype is not None and isinstance(traced, torch.Tensor) else None
        new = bag_lowering.distribute(node, mesh_node, planned, cast) or _insert_after(
            graph, node, runtime.distribute_input, (node, mesh_node, planned, cast))
        produced[new.name] = planned
    replicated = pl.format_spec(pl.replicated(len(plan.mesh_shape)))  # as the graph's code writes it
    bag_lowering.after_inputs(mesh_node, replicated, produced)
    fuse_dispatches(gm, plan, mesh_node, produced)
    table_wise: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.name not in (mesh_node.name, gathers.name):
            pplan = plan.parameters.get(node.target)
            produced[node.name] = pl.format_spec(pplan.state_spec) if pplan else replicated
            chain = [node]  # the weight as read, cast for compute, gathered once (ZeRO-2)
            cast = None if node.target in own_dtype else compute_dtype
            if pplan and pplan.zero:  # ZeRO-2: gathered once for use (cast first), kept until backward
                chain.append(_insert_after(graph, chain[-1], runtime.redistribute,
                                           (chain[-1], mesh_node, pplan.placement, cast, reduce_dtype)))
                produced[chain[-1].name] = pplan.placement
            elif cast is not None and pplan:
                chain.append(_insert_after(graph, chain[-1], runtime.compute_copy, (chain[-1], cast)))
                produced[chain[-1].name] = produced[node.name]
            if pplan:
                weights.update(n.name for n in chain)
        if node.target is relabel_experts:  # keeps its input's placement
            produced[node.name] = produced.get(node.args[0].name)
        if node.op != "call_function" or node.target in _RUNTIME_FUNCS:
            continue
        nplan = plan.nodes.get(node.name)
        if nplan is None:  # nodes only the runnable module has (guards, asserts)
            continue
        if node.target is operator.getitem:
            source = plan.nodes[node.args[0].name].outputs[node.args[1]]
            produced[node.name] = source
            if source != nplan.inputs[0]:
                new = _insert_after(graph, node, runtime.redistribute, (node, mesh_node, nplan.inputs[0]))
                produced[new.name] = nplan.inputs[0]
            continue
        for arg, want in zip(tensor_args_of(node), nplan.inputs):
            have = produced.get(arg.name)
            if have != want:
                with graph.inserting_before(node):
                    if arg.name in weights and _gathers(have, want):  # FSDP: gathered again for backward
                        moved = _gather_weight(graph, arg, have, want, produced, (gathers, mesh_node),
                                               compute_dtype, reduce_dtype, node_layer(node), own_dtype)
                    else:
                        moved = graph.call_function(runtime.redistribute, (arg, mesh_node, want))
                    moved.meta["val"] = arg.meta.get("val")
                produced[moved.name] = want
                node.replace_input_with(arg, moved)
        if is_view_op(node) and any(a.name in weights for a in tensor_args_of(node)[:1]):
            weights.add(node.name)
        if node.target is torch.ops.aten.stack.default and any(
                pl.owned_dim(nplan.input_spec(k)) is not None for k in range(len(nplan.inputs))):
            node.args = (node.args[0], mesh_node, nplan.outputs[0])  # experts stacked where they live
            node.target = runtime.stack_owned
        elif nplan.exchange == "sparse_allgather":  # the lookup exchanges its table's gradient itself
            node.args = (*node.args[:2], mesh_node, nplan.outputs[0])
            node.target = runtime.sparse_embedding
        elif nplan.exchange == TABLE_WISE:  # its table lives on its owner: fused below with the others
            table_wise.append(node)
        elif node.target is FUSED_ATTENTION:  # the fused kernel on each device's sequences or heads
            traced = node.meta.get("val")
            like = (tuple(traced.shape), tuple(traced.stride())) if isinstance(traced, torch.Tensor) else None
            node.args = (mesh_node, nplan.outputs[0], like, nplan.exchange == BALANCED_CAUSAL, *node.args)
            node.target = local_attention
        elif bag_lowering.rewrite(node, nplan.outputs[0], mesh_node):  # bags of varying size
            pass
        elif node.target is torch.ops.aten.embedding.default and pl.Shard(0) in nplan.input_spec(0):
            node.args = (*node.args[:2], mesh_node, nplan.outputs[0])  # rows sharded: masked local lookup
            node.target = runtime.rowwise_embedding
        elif node.target in SAMPLE_LOCAL:  # no DTensor rule: each device computes its own samples
            node.args = (node.target, mesh_node, SAMPLE_LOCAL[node.target], tuple(nplan.outputs), *node.args)
            node.target = runtime.sample_local_call
        elif nplan.fallback:
            for i in runtime.written_args(node.target):
                if len(node.args[i].users) > 1:
                    raise AutoparError(ErrorKind.UNSUPPORTED_OP,
                                       f"node {node.name}: in-place {node.target} has no sharding rule and writes "
                                       f"{node.args[i].name}, which other nodes also read; it cannot run on a "
                                       "replicated copy. Rewrite that step of the model out of place")
            node.args = (node.target, mesh_node, *node.args)
            node.target = runtime.local_call
        produced[node.name] = nplan.outputs[0] if len(nplan.outputs) == 1 else None
        if not nplan.inputs and nplan.outputs:
            new = _insert_after(graph, node, runtime.replicate_constant, (node, mesh_node))
            produced[new.name] = produced[node.name]
    fuse_table_wise(graph, plan, mesh_node, table_wise, bags)
    for node in reversed(graph.nodes):  # compute copies (and their views) every gather now bypasses
        if node.name in weights and not node.users and node.op == "call_function" and (
                node.target is runtime.compute_copy or is_view_op(node)):
            graph.erase_node(node)
    if not gathers.users:
        graph.erase_node(gathers)
    out = graph.output_node()
    flat, _ = tree_flatten(out.args)
    returned = list(dict.fromkeys(a for a in flat if isinstance(a, torch.fx.Node)))
    if plan.outputs:  # left split where the work was, for the step's loss (autopar.parallel)
        want = plan.outputs[0]  # the plan places every output alike
        for arg in returned:
            if isinstance(arg.meta.get("val"), torch.Tensor) and produced.get(arg.name) != want:
                with graph.inserting_before(out):
                    moved = graph.call_function(runtime.redistribute, (arg, mesh_node, want))
                out.replace_input_with(arg, moved)
    else:
        for arg in returned:
            with graph.inserting_before(out):
                full = graph.call_function(runtime.to_full, (arg,))
            out.replace_input_with(arg, full)
    graph.lint()


def _gather_weight(graph: torch.fx.Graph, weight: torch.fx.Node, have: str, want: str, produced: dict,
                   attrs: tuple[torch.fx.Node, torch.fx.Node], compute_dtype, reduce_dtype,
                   layer: str | None, own_dtype: set[str] = frozenset()) -> torch.fx.Node:
    """A sharded weight (or a view of it, a transposed matrix) gathered for its reader, as
    FSDP2 does: the parameter as it is stored is gathered — a plain all-gather along its
    sharded dims, which can run asynchronously (a transposed shard would need its pieces
    interleaved, which waits for them) — and the reader's views are replayed on the whole
    weight; a last reshard (a no-op unless the views move a dim the gather left sharded)
    gives the reader its planned placement. Under mixed precision the gather reads not the
    compute copy but the fp32 master, so it casts before it moves the shard and its backward
    reduces the gradient in ``reduce_dtype`` onto the master (FSDP2's
    ``MixedPrecisionPolicy``). Inserted before the reader; passes.prefetch moves the gather a
    layer ahead. ``layer``: the reader's, with which backward gathers the weight again
    (passes.reshard, backward prefetch). ``own_dtype``: parameters that compute in their own
    dtype (batch norm's under mixed precision): gathered without a cast."""
    gathers, mesh_node = attrs
    root, views = view_chain(weight)  # stops at a compute copy (no view)
    stored = produced.get(root.name)
    if root.op == "call_function" and root.target is runtime.compute_copy:
        root = root.args[0]
    if stored is None:  # not a placement lowering knows: gather the weight as read
        root, views, stored = weight, [], have
    if root.op == "get_attr" and root.target in own_dtype:
        compute_dtype = None
    whole = tuple(pl.R if a.is_shard and b is pl.R else s for a, b, s in
                  zip(pl.parse_spec(have), pl.parse_spec(want), pl.parse_spec(stored)))
    value = graph.call_method("gather", (gathers, root, mesh_node, pl.format_spec(whole), compute_dtype,
                                         reduce_dtype, layer))
    for view in reversed(views):
        replayed = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
        replayed.meta = {k: v for k, v in view.meta.items() if k != "nn_module_stack"}
        value = replayed
    if all(p is pl.R for p in whole) and want == pl.format_spec(whole):  # views of a whole weight are whole
        return value
    return graph.call_function(runtime.redistribute, (value, mesh_node, want))


_RUNTIME_FUNCS = {runtime.distribute_input, runtime.compute_copy, runtime.redistribute, runtime.replicate_constant,
                  runtime.to_full, runtime.local_call, runtime.sample_local_call, runtime.sparse_embedding,
                  runtime.rowwise_embedding, runtime.stack_owned, relabel_experts,
                  runtime.table_wise_lookups, expert_runtime.dispatch_experts, local_attention,
                  bag_runtime.bag_input, bag_runtime.bag_numbers, bag_runtime.pool_bags, bag_runtime.id_count}


def _gathers(have: str | None, want: str) -> bool:
    """Whether resharding ``have`` to ``want`` gathers a sharded dim whole."""
    return have is not None and any(a.is_shard and b is pl.R for a, b in zip(pl.parse_spec(have), pl.parse_spec(want)))


def tensor_args_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor arguments, as in planning; get_attr nodes carry no ``val`` in the runnable module."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, torch.fx.Node)
            and (isinstance(a.meta.get("val"), torch.Tensor) or a.op == "get_attr")]


def _insert_after(graph, node, fn, args) -> torch.fx.Node:
    with graph.inserting_after(node):
        new = graph.call_function(fn, args)
    new.meta["val"] = node.meta.get("val")
    for user in list(node.users):
        if user is not new:
            user.replace_input_with(node, new)
    return new
