"""Functions the lowered graph calls. Thin wrappers over DTensor's public API.

They are plain module-level functions so ``print(pmodel.code)`` shows each collective
by name, e.g. ``redistribute(addmm, self._autopar_mesh, 'R,S(1)')``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._redistribute import Redistribute
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_map

from autopar.passes.dtensor_ops import dtensor_placements, inverse_order
from autopar.placements import parse_spec


def placements(spec: str) -> tuple:
    """DTensor placements of a spec as the lowered graph's code writes it (``'S(0),R'``)."""
    return dtensor_placements(parse_spec(spec))


def distribute_input(x: torch.Tensor, mesh, spec: str, dtype: torch.dtype | None = None) -> DTensor:
    """A full input that every rank holds -> DTensor; each rank slices its shard, no
    communication. Differentiable: a pipeline stage's input gets its gradient back. ``dtype``
    (mixed precision): a floating input is cast to the dtype the graph computes in first."""
    if dtype is not None and x.is_floating_point() and x.dtype != dtype:
        x = x.to(dtype)
    replicated = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements(spec))


def compute_copy(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight's working copy in the mixed-precision compute dtype: each rank casts its own
    shard (no communication), so gathers planned after it move ``dtype`` bytes; backward casts
    the gradient back onto the fp32 master. An expert weight living on its owner keeps saying
    where it lives (:data:`OWNED_ATTR`)."""
    if not param.is_floating_point() or param.dtype == dtype:
        return param
    copy = param.to(dtype)
    if hasattr(param, OWNED_ATTR):
        setattr(copy, OWNED_ATTR, getattr(param, OWNED_ATTR))
    return copy


def redistribute(x: DTensor, mesh, spec: str, dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, async_op: bool = False) -> DTensor:
    """Reshard to the placements the consumer was planned with (a collective, or a local slice).
    Mixed precision's weight gather (FSDP2's): ``dtype`` casts the fp32 master's shard before
    the collective, ``reduce_dtype`` is what the gradient's reduction runs in (torch's
    ``forward_dtype`` / ``backward_dtype``); the gradient comes back in the master's dtype.
    ``async_op``: the collective is issued and not waited for — the result's local tensor is
    an ``AsyncCollectiveTensor`` that waits where it is first read — and so is its backward's
    (a weight's gradient reduce-scattered while backward goes on; passes.grad_sync waits). On
    CPU meshes only the backward's is (:class:`_GatherNowReduceLater`)."""
    target = placements(spec)
    if tuple(x.placements) == target:
        return x if dtype is None else compute_copy(x, dtype)
    # A collective's backward hands the gradient back labelled with the input's strides but laid
    # out as the collective makes it (gathered: contiguous; sliced: a strided piece); the views
    # traced in front of the input then fail on it whenever the two disagree (a head split of a
    # projection, permuted; a column shard). Reshard a contiguous copy, and take the gradient
    # back contiguous too.
    if not x.to_local().is_contiguous():
        x = x.contiguous()
    if x.requires_grad and not any(p.is_partial() for p in x.placements):
        x = _contiguous_grad(x)
    # Redistribute (the autograd function behind DTensor.redistribute) also takes
    # Replicate→Partial (a replicated bias into a row-parallel matmul), which the public method
    # refuses ("internal use only"). Dtypes as DTensor.redistribute's forward_dtype /
    # backward_dtype: the gradient comes back in the input's dtype.
    # (to Partial, the gradient's collective runs in ``dtype`` unless told otherwise.)
    forward = dtype or x.dtype
    to_partial = any(p.is_partial() and p != q for p, q in zip(target, x.placements))
    backward = reduce_dtype or (forward if to_partial else x.dtype)
    options = {"op_dtype": forward, "out_dtype": forward,
               "backward_options": {"op_dtype": backward, "out_dtype": x.dtype}}
    # gloo's in-flight all-gathers are not safe (below), on CPU tensors or CUDA ones alike
    gloo = mesh.device_type == "cpu" or dist.get_backend() == "gloo"
    function = _GatherNowReduceLater if async_op and gloo else Redistribute
    return function.apply(x, mesh, target, async_op, options)


class _GatherNowReduceLater(Redistribute):
    """DTensor's redistribute whose forward waits for its collective and whose backward's does
    not: how an asynchronous weight gather runs under gloo (CPU meshes, or CUDA tensors over
    gloo). Gloo's all-gather, issued through
    functional collectives and left in flight, corrupts the heap now and then (``malloc():
    unaligned tcache chunk``, or a segfault in the next op that reads it — 3 of ~30 stress runs
    of 4 ranks × 600 rounds × 8 gathers in flight, and once in CI's test_any_batch); waited for
    at once, and reduce-scatters left in flight, it has not. So on CPU the gathers run where they
    are issued (CPU gloo computes on the same cores anyway) and the gradients' reduce-scatters
    still overlap backward, as FSDP2's do."""

    @staticmethod
    def forward(ctx, input, device_mesh, placements, async_op, dtype_config):  # type: ignore[override]
        output = Redistribute.forward(ctx, input, device_mesh, placements, False, dtype_config)
        ctx.async_op = async_op  # read by Redistribute.backward
        return output


def _contiguous_grad(x: DTensor) -> DTensor:
    """``x`` unchanged; its gradient comes back with a contiguous local piece. (Partial inputs
    are left alone: their gradient is replicated, and this wrapper's backward would convert it
    to ``x``'s placements.)"""
    piece = x.to_local()
    local = GradInLayout.apply(piece, dim_order(piece.stride()))
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


def replicate_constant(x, mesh):
    """Constants created inside forward (arange, masks) become replicated DTensors."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return x


def to_full(x):
    """Plan outputs are returned as plain full tensors on every rank (differentiable)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def written_args(op) -> list[int]:
    """Positions of the arguments an in-place op writes (from its schema; none for others)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def local_call(op, mesh, *args, **kwargs):
    """Run an op DTensor has no rule for on replicated local tensors; outputs are replicated.
    An in-place op (the ``as_strided_`` adaptive pooling decomposes into) writes a copy: a
    DTensor's local view may not be modified in place. Lowering checks that nothing else
    reads what it writes, so the copy changes no result."""
    def unwrap(a):
        return a.to_local() if isinstance(a, DTensor) else a

    local = list(tree_map(unwrap, args))
    for i in written_args(op):
        local[i] = local[i].clone()
    out = op(*local, **tree_map(unwrap, kwargs))
    return tree_map(lambda t: replicate_constant(t, mesh), out)


def sample_local_call(op, mesh, batch_arg: int | None, outputs: tuple[str, ...], *args):
    """Run an op that computes each sample (dim 0) on its own, and that DTensor has no rule
    for, on each device's samples (passes.sample_local): the inputs' local pieces in, the
    outputs placed as ``outputs`` (each a placement spec) out. ``batch_arg``: the position of
    the op's batch-size argument (group norm's N), set to this device's count. On the mesh dims
    where the samples are split, a replicated input's (a weight's) gradient is this device's
    share of a sum: it goes back partial, and is reduced as a data-parallel weight's is."""
    split = next((tuple(d for d, p in enumerate(a.placements) if p == Shard(0))
                  for a in args if isinstance(a, DTensor)), ())

    def local(a):
        if not isinstance(a, DTensor):
            return a
        grads = [Partial() if d in split and p.is_replicate() else p for d, p in enumerate(a.placements)]
        return a.to_local(grad_placements=grads)

    local_args = [local(a) for a in args]
    if batch_arg is not None:
        local_args[batch_arg] = local_args[0].shape[0]
    out = op(*local_args)
    values = out if isinstance(out, (tuple, list)) else (out,)
    placed = tuple(DTensor.from_local(v, mesh, dtensor_placements(parse_spec(spec)), run_check=False)
                   if isinstance(v, torch.Tensor) and spec is not None else v for v, spec in zip(values, outputs))
    return placed if isinstance(out, (tuple, list)) else placed[0]


def dim_order(stride: tuple[int, ...]) -> tuple[int, ...]:
    """The dims of a tensor with these strides in memory order, outermost first."""
    return tuple(sorted(range(len(stride)), key=lambda d: (-stride[d], d)))


def in_layout(x: torch.Tensor, layout: tuple[int, ...]) -> torch.Tensor:
    """``x`` with its memory in dim order ``layout`` (a copy only when it is not already)."""
    if dim_order(x.stride()) == tuple(layout):
        return x
    return x.permute(layout).contiguous().permute(inverse_order(list(layout)))


class GradInLayout(torch.autograd.Function):
    """Identity; the gradient goes back in memory order ``layout`` — the strides its DTensor
    claims (``to_local``'s backward gives the gradient the forward DTensor's strides). The
    fused kernel's backward picks its own layout, and the views in front of it (a head split
    is a view of the projection) only work on gradients laid out as their DTensor says."""

    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return in_layout(grad, ctx.layout), None


def send_slice(x: torch.Tensor, lanes, dim: int) -> torch.Tensor:
    """A stage's full boundary output -> this lane's slice of ``dim`` (sent to the same lane of
    the next stage), so each value crosses the link between groups once. Backward gathers the
    gradient slices of every lane back into the full gradient."""
    whole = DTensor.from_local(x, lanes, [Replicate()], run_check=False)
    return whole.redistribute(lanes, [Shard(dim)]).to_local()


def receive_slice(x: torch.Tensor, lanes, dim: int) -> torch.Tensor:
    """The slice this lane received -> the full boundary input (an all-gather inside the
    receiving group). Backward keeps this lane's slice of the (replicated) gradient."""
    part = DTensor.from_local(x, lanes, [Shard(dim)], run_check=False)
    return part.redistribute(lanes, [Replicate()]).to_local()


def sparse_embedding(weight: DTensor, indices: DTensor, mesh, spec: str) -> DTensor:
    """A lookup in a replicated table whose gradient is exchanged as the rows each rank
    touched (Parallax's sparse path) instead of an all-reduce of the dense gradient: one
    all-gather of (row id, row) pairs per mesh dim the indices are split on. Every rank then
    holds the same full gradient, so the table stays replicated."""
    groups = [mesh.get_group(d) for d, p in enumerate(indices.placements) if p.is_shard()]
    local = _SparseLookup.apply(weight.to_local(), indices.to_local(), groups)
    return _lookup_result(local, weight, indices, mesh, spec)


def _lookup_result(local: torch.Tensor, weight: DTensor, indices: DTensor, mesh, spec: str) -> DTensor:
    """A lookup's local rows as a DTensor of the lookup's global shape (indices' shape, then
    the table's row shape), given, not inferred from the local piece: ids split by bags
    (passes.bag_runtime) are split unevenly."""
    shape = (*indices.shape, *weight.shape[1:])
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, placements(spec), run_check=False, shape=shape, stride=stride)


def rowwise_embedding(weight: DTensor, indices: DTensor, mesh, spec: str) -> DTensor:
    """A lookup in a table sharded by rows (Parallax's partitioned parameter server as a
    collective): each rank looks up the indices its rows own, zeros the others, and the
    result is a partial sum over the mesh dims the rows are split on (reduced where it is
    used). The same as DTensor's row-wise rule, whose mask is only applied at that later
    reduction — too late when views and sums come between. The table's gradient stays local."""
    local_weight = weight.to_local()
    _, offsets = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    ids = indices.to_local()
    mine = (ids >= offsets[0]) & (ids < offsets[0] + local_weight.shape[0])
    local_ids = torch.where(mine, ids - offsets[0], torch.zeros_like(ids))
    rows = torch.nn.functional.embedding(local_ids, local_weight) * mine.unsqueeze(-1).to(local_weight.dtype)
    return _lookup_result(rows, weight, indices, mesh, spec)


class _SparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table: torch.Tensor, ids: torch.Tensor, groups: list):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.groups = table.shape[0], groups
        return torch.nn.functional.embedding(ids, table)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        rows, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        values = grad.new_zeros(rows.numel(), grad.shape[1]).index_add_(0, inverse, grad)
        for group in ctx.groups:
            rows, values = all_gather_rows(rows, values, group)
        return grad.new_zeros(ctx.rows, grad.shape[1]).index_add_(0, rows, values), None, None


def sum_touched_rows(grad: torch.Tensor, group) -> torch.Tensor:
    """A table's gradient summed over ``group`` by exchanging only its non-zero rows (Parallax's
    sparse exchange, between replica groups). Every rank adds the same rows in the same order,
    so the sums agree to the bit; a touched row whose gradient is exactly zero adds nothing."""
    rows = (grad != 0).reshape(grad.shape[0], -1).any(dim=1).nonzero().reshape(-1)
    rows, values = all_gather_rows(rows, grad[rows].reshape(rows.numel(), -1), group)
    return torch.zeros_like(grad).index_add_(0, rows, values.reshape(-1, *grad.shape[1:]))


def all_gather_rows(rows: torch.Tensor, values: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (row ids, rows), concatenated in rank order; pieces differ in size, so
    they are padded to the largest for the collective."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=rows.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows.numel()], device=rows.device), group=group)
    longest = max(int(s) for s in sizes)
    padded_rows = torch.zeros(longest, dtype=rows.dtype, device=rows.device)
    padded_rows[:rows.numel()] = rows
    padded_values = values.new_zeros(longest, values.shape[1])
    padded_values[:rows.numel()] = values
    all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
    all_values = [torch.empty_like(padded_values) for _ in range(world)]
    dist.all_gather(all_rows, padded_rows, group=group)
    dist.all_gather(all_values, padded_values, group=group)
    return (torch.cat([r[:int(n)] for r, n in zip(all_rows, sizes)]),
            torch.cat([v[:int(n)] for v, n in zip(all_values, sizes)]))


# on an expert weight that lives on its owner's sub-mesh: (the mesh it is planned on, the mesh
# dim placed "O", the owner's coordinate on that dim)
OWNED_ATTR = "_autopar_owned"
# on stacked (E, ...) expert weights stored in a balanced order (passes.expert_order): the
# order, row j holding expert ``order[j]``
ROW_ORDER_ATTR = "_autopar_row_order"


def stack_owned(weights: list[DTensor], mesh, spec: str) -> DTensor:
    """Expert weights that each live on their owner's sub-mesh (placement "O") -> their stack,
    a DTensor on ``mesh`` placed ``spec`` (``Shard(0)`` over the owners): every device stacks
    the experts it holds, in expert order; nothing is communicated, forward or backward (the
    gradient of each expert's slice goes back to that expert's weight on its owner)."""
    mine = [w.to_local() for w in weights if w.device_mesh.get_coordinate() is not None]
    local = torch.stack(mine)
    shape = torch.Size((len(weights), *weights[0].shape))
    return DTensor.from_local(local, mesh, placements(spec), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def full_value(param: torch.Tensor, grad: bool = False) -> torch.Tensor | None:
    """The whole parameter (or its gradient) on every rank of its mesh, in the model's layout:
    a DTensor gathered, an expert weight that lives on its owner sent from there, stacked
    experts stored in a balanced order put back in the model's. Collective: every rank of the
    mesh calls it, in the same order."""
    value = param.grad if grad else param
    if not isinstance(param, DTensor):
        return value
    if not hasattr(param, OWNED_ATTR):
        full = value.full_tensor() if isinstance(value, DTensor) else value
        order = getattr(param, ROW_ORDER_ATTR, None)
        if order is None or full is None:
            return full
        return full[inverse_order(order)]
    mesh, dim, owner = getattr(param, OWNED_ATTR)
    held = param.device_mesh.get_coordinate() is not None
    full = value.full_tensor() if held and isinstance(value, DTensor) else None
    coordinate = list(mesh.get_coordinate())
    coordinate[dim] = owner  # the device of my row along ``dim`` that holds the weight
    box = [full.detach() if full is not None else None]
    dist.broadcast_object_list(box, src=int(mesh.mesh[tuple(coordinate)]), group=mesh.get_group(dim))
    return box[0]


def table_wise_lookups(weights: list[DTensor], ids: list[DTensor], mesh, dim: int, pools: list, rests: list,
                       specs: list[str]) -> tuple[DTensor, ...]:
    """Lookups in tables that each live whole on one device of mesh dim ``dim`` (placement
    "O", passes.sparse.add_table_wise), with their bags pooled, as one exchange: each owner
    looks up and pools its tables' bags for the whole batch it sees (``pools[t]``: (dims,
    mean) for bags of one size; ("bags", offsets, per-sample weights or None,
    include_last_offset) for bags of varying size, the full inputs every rank holds, summed by
    torch's ``embedding_bag``), then one all-to-all sends every device of the dim its batch
    shard of every table's pooled rows (``rests[t]``: a pooled row's shape). Backward sends the
    gradients back the same way; a table's gradient never leaves its owner. Returns DTensors
    placed ``specs[t]``."""
    me = mesh.get_local_rank(dim)
    owners = tuple(getattr(w, OWNED_ATTR)[2] for w in weights)
    local_ids = [i.to_local() if isinstance(i, DTensor) else i for i in ids]
    batch = _bags(pools[0]) if pools[0][0] == "bags" else local_ids[0].shape[0]
    pooled = []
    for t, weight in enumerate(weights):
        if owners[t] == me and pools[t][0] == "bags":
            _, offsets, scale, last = pools[t]
            table = weight.to_local()
            scale = None if scale is None else scale.to(table.dtype)
            pooled.append(torch.nn.functional.embedding_bag(local_ids[t], table, offsets, mode="sum",
                                                            per_sample_weights=scale, include_last_offset=last))
        elif owners[t] == me:
            rows = torch.nn.functional.embedding(local_ids[t], weight.to_local())
            dims, mean = pools[t]
            pooled.append(rows.mean(dims) if mean else rows.sum(dims))
    # a device that owns no table still takes part in backward's all-to-all: an input that
    # requires grad on every device makes autograd call it everywhere
    anchor = torch.zeros(0, dtype=weights[0].dtype, device=local_ids[0].device, requires_grad=True)
    outs = _TableExchange.apply(mesh.get_group(dim), mesh.size(dim), me, owners, tuple(map(tuple, rests)), batch,
                                (weights[0].dtype, local_ids[0].device), anchor, *pooled)
    return tuple(DTensor.from_local(o, mesh, placements(spec), run_check=False) for o, spec in zip(outs, specs))


def _bags(pool: tuple) -> int:
    """How many bags a ("bags", offsets, weights, include_last_offset) pooling makes."""
    _, offsets, _, last = pool
    return offsets.shape[0] - (1 if last else 0)


class _TableExchange(torch.autograd.Function):
    """Owners' pooled rows (whole batch) -> every device's batch shard of every table, one
    ``all_to_all_single``; backward the reverse. Rows travel as (shard rows, width) blocks,
    each owner's tables side by side in table order."""

    @staticmethod
    def forward(ctx, group, n: int, me: int, owners: tuple, rests: tuple, batch: int, kind: tuple, anchor, *pooled):
        dtype, device = kind
        widths = [math.prod(r) for r in rests]
        per = batch // n
        held = [sum(w for w, o in zip(widths, owners) if o == r) for r in range(n)]
        ctx.group, ctx.n, ctx.me, ctx.owners, ctx.rests, ctx.batch, ctx.held = group, n, me, owners, rests, batch, held
        ctx.kind = kind
        flat = [p.reshape(batch, -1) for p in pooled]
        send = (torch.cat([torch.cat([f[r * per:(r + 1) * per] for f in flat], 1).reshape(-1) for r in range(n)])
                if flat else torch.empty(0, dtype=dtype, device=device))
        received = torch.empty(per * sum(held), dtype=dtype, device=device)
        dist.all_to_all_single(received, send.contiguous(), [per * h for h in held], [per * held[me]] * n, group=group)
        outs: list = [None] * len(owners)
        offset = 0
        for r in range(n):
            block = received[offset:offset + per * held[r]].view(per, held[r])
            offset += per * held[r]
            column = 0
            for t in (t for t, o in enumerate(owners) if o == r):
                outs[t] = block[:, column:column + widths[t]].reshape(per, *rests[t])
                column += widths[t]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n, me, owners, held, batch = ctx.n, ctx.me, ctx.owners, ctx.held, ctx.batch
        per = batch // n
        widths = [math.prod(r) for r in ctx.rests]
        dtype, device = ctx.kind
        flat = [g.reshape(per, -1) if g is not None else torch.zeros(per, widths[t], dtype=dtype, device=device)
                for t, g in enumerate(grads)]
        send = torch.cat([torch.cat([flat[t] for t, o in enumerate(owners) if o == r], 1).reshape(-1)
                          if held[r] else flat[0].new_empty(0) for r in range(n)])
        received = send.new_empty(n * per * held[me])
        dist.all_to_all_single(received, send.contiguous(), [per * held[me]] * n, [per * h for h in held],
                               group=ctx.group)
        blocks = received.view(n, per, held[me]).reshape(batch, held[me])  # rows in rank order: the whole batch
        pooled_grads, column = [], 0
        for t in (t for t, o in enumerate(owners) if o == me):
            pooled_grads.append(blocks[:, column:column + widths[t]].reshape(batch, *ctx.rests[t]))
            column += widths[t]
        return (None,) * 8 + tuple(pooled_grads)
