"""The expert dispatch at run time: a MoE layer's rows sent to the owners of their experts,
the layer's segment run there, the results sent back (passes.expert_dispatch plans it,
passes.fuse puts one ``dispatch_experts`` call in the lowered graph)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from autopar.passes.dtensor_ops import dtensor_placements
from autopar.passes.runtime import placements
from autopar.placements import replicated


def dispatch_experts(segment, mesh, dim: int, experts: int, ids: DTensor, inputs: list, row_inputs: list[bool],
                     weights: list[DTensor], weight_specs: list[str], row_spec: str, out_specs: list[str]
                     ) -> tuple[DTensor, ...]:
    """Run ``segment`` (passes.expert_dispatch) on the owners of the rows' experts: every
    device sends each of its rows — one per (token, choice), ``ids`` their experts — to the
    device of mesh dim ``dim`` that holds that expert (``Shard(0)`` of the gathered
    ``weights``: E/n experts each), the owner runs the segment on what it received with its
    own experts' weights, and the results return to the rows' devices in the rows' order.
    Row inputs travel with their rows; the others are used whole. Backward is the reverse
    exchange (``_RowExchange``); a weight's gradient stays with its owner, summed over the
    other mesh dims the rows are split on (``Partial`` there, as DTensor's own ops leave it).
    Returns the segment's outputs placed ``out_specs``."""
    rows = placements(row_spec)
    ids = _placed(ids, mesh, rows)
    local_ids = ids.to_local()
    n, me, group = mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim)
    per = experts // n
    owner = torch.div(local_ids, per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    sent = torch.bincount(owner, minlength=n)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    send, receive = tuple(sent.tolist()), tuple(received.tolist())
    ids_there = local_ids.new_empty(sum(receive))
    dist.all_to_all_single(ids_there, local_ids[order].contiguous(), list(receive), list(send), group=group)

    def partial_grads(x: DTensor):  # a replicated value used by split rows gets a partial gradient
        return [Partial() if p.is_replicate() and r.is_shard() else p for p, r in zip(x.placements, rows)]

    local_inputs = []
    whole = dtensor_placements(replicated(mesh.ndim))
    for x, is_rows in zip(inputs, row_inputs):
        if not isinstance(x, DTensor):
            local_inputs.append(x)
        elif is_rows:
            local_inputs.append(_RowExchange.apply(group, send, receive, _placed(x, mesh, rows).to_local()[order]))
        else:
            x = _placed(x, mesh, whole)
            local_inputs.append(x.to_local(grad_placements=partial_grads(x)))
    local_weights = []
    for w, spec in zip(weights, weight_specs):
        w = _placed(w, mesh, placements(spec))
        local_weights.append(w.to_local(grad_placements=partial_grads(w)))
    outs = segment(*local_inputs, *[ids_there - me * per] * len(local_weights), *local_weights)
    back = torch.argsort(order)
    results = []
    for out, spec in zip(outs, out_specs):
        mine = _RowExchange.apply(group, receive, send, out)[back]
        results.append(_placed(DTensor.from_local(mine, mesh, rows, run_check=False), mesh, placements(spec)))
    return tuple(results)


def _placed(x: DTensor, mesh, target: tuple) -> DTensor:
    return x if tuple(x.placements) == tuple(target) else x.redistribute(mesh, target)


class _RowExchange(torch.autograd.Function):
    """Rows (dim 0) to other devices of ``group``: ``send[r]`` of them to rank r, ``receive[r]``
    from it (``all_to_all_single``); backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, group, send: tuple, receive: tuple, x: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(receive), list(send), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), list(ctx.send), list(ctx.receive), group=ctx.group)
        return None, None, None, out
