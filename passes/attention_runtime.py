"""Fused attention in the lowered program: each device's piece of
``F.scaled_dot_product_attention`` as the plan splits it (passes.strategies' attention rules,
passes.context_parallel's sequence split). Split by batch or heads the kernel runs locally;
split by sequence the keys and values are gathered first and, for a load-balanced causal
split, the query half-chunks travel to the devices computing them.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.passes.runtime import GradInLayout, dim_order, in_layout, placements
from autopar.plan_types import ATTENTION_SEQUENCE_DIM as SEQUENCE_DIM


def local_attention(mesh, spec: str, traced: tuple[tuple, tuple] | None, balanced: bool, query, key, value,
                    attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> DTensor:
    """Fused attention on this device's shard. Split by batch or by heads
    (passes.strategies), each device's piece is attention of its own sequences or heads: the
    fused kernel runs locally and nothing is communicated, forward or backward. Split by
    sequence (passes.context_parallel), the keys and values are all-gathered on those mesh
    dims first (their gradients come back reduce-scattered) and the local queries attend to
    every key before them (causal: the keys up to the chunk's end, a lower-right causal
    mask, :func:`_lower_right_causal`) or to all of them. ``balanced`` (causal, one mesh
    dim): the query half-chunks are computed where torchtitan's load balancer would place
    them (:func:`_balanced_causal`).
    Returns the output placed ``spec`` with the ``traced`` (shape, stride) and its local piece
    laid out in the same dim order: the kernel chosen here may lay it out otherwise, and the
    graph's views after it were traced on that layout."""
    out_placements = placements(spec)
    sequence = [d for d, p in enumerate(out_placements) if isinstance(p, Shard) and p.dim == SEQUENCE_DIM]

    def local(t, gather: bool = False):
        if not isinstance(t, DTensor):
            return t
        if gather and sequence:
            t, grad = _gathered_sequence(t, sequence)
            piece = t.to_local(grad_placements=grad)
        else:
            piece = t.to_local()
        return GradInLayout.apply(piece, dim_order(t.stride())) if t.requires_grad else piece

    q, k, v = local(query), local(key, gather=True), local(value, gather=True)
    if sequence and is_causal and balanced:
        (d,) = sequence
        out = _balanced_causal(q, k, v, mesh.get_group(d), mesh.get_local_rank(d), mesh.size(d),
                               dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        return _attention_output(out, mesh, out_placements, traced)
    if sequence and is_causal:
        _, offset = compute_local_shape_and_global_offset(query.shape, mesh, query.placements)
        seen = offset[SEQUENCE_DIM] + q.shape[SEQUENCE_DIM]  # keys up to this chunk's last query
        k, v = k.narrow(SEQUENCE_DIM, 0, seen), v.narrow(SEQUENCE_DIM, 0, seen)
        attn_mask, is_causal = _lower_right_causal(q.shape[SEQUENCE_DIM], seen, q.device), False
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=local(attn_mask), dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa)
    return _attention_output(out, mesh, out_placements, traced)


def _attention_output(out: torch.Tensor, mesh, out_placements, traced) -> DTensor:
    """The local output as the DTensor the graph traced (shape, stride and memory order)."""
    if traced is None:
        return DTensor.from_local(out, mesh, out_placements, run_check=False)
    shape, stride = traced
    out = in_layout(out, dim_order(stride))
    return DTensor.from_local(out, mesh, out_placements, run_check=False, shape=torch.Size(shape), stride=stride)


def _balanced_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, rank: int, n: int,
                     **sdpa) -> torch.Tensor:
    """Causal attention of this device's contiguous query chunk (chunk ``rank`` of ``n``)
    against the whole gathered keys and values, computed load-balanced: the sequence is
    2n half-chunks, device j computes halves j and 2n−1−j (each as much work as any other
    device's pair). The halves travel to the devices computing them in one all-to-all and
    their outputs come back in another (autograd sends the gradients the same ways)."""
    half = q.shape[SEQUENCE_DIM] // 2

    def computer(h: int) -> int:  # the device computing half-chunk h
        return h if h < n else 2 * n - 1 - h

    held = [2 * rank, 2 * rank + 1]  # halves this device holds, in sequence order
    send = sorted(range(2), key=lambda i: (computer(held[i]), held[i]))
    to_each = [sum(computer(held[i]) == j for i in range(2)) for j in range(n)]
    computed = sorted((rank, 2 * n - 1 - rank), key=lambda h: (h // 2, h))  # arrivals, by sender
    from_each = [sum(h // 2 == j for h in computed) for j in range(n)]
    pieces = q.split(half, dim=SEQUENCE_DIM)
    outgoing = torch.stack([pieces[i] for i in send]).contiguous()
    arrived = all_to_all_single_autograd(outgoing, from_each, to_each, group)
    outputs = []
    for queries, h in zip(arrived.unbind(0), computed):
        seen = (h + 1) * half  # keys up to this half's last query
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            queries, k.narrow(SEQUENCE_DIM, 0, seen), v.narrow(SEQUENCE_DIM, 0, seen),
            attn_mask=_lower_right_causal(half, seen, queries.device), **sdpa))
    returned = all_to_all_single_autograd(torch.stack(outputs).contiguous(), to_each, from_each, group)
    ordered = [None, None]
    for slot, i in enumerate(send):
        ordered[i] = returned[slot]
    return torch.cat(ordered, dim=SEQUENCE_DIM)


def _gathered_sequence(t: DTensor, dims: list[int]) -> tuple[DTensor, list]:
    """``t`` whole on the mesh ``dims`` (an all-gather of its sequence), and the placements
    its local gradient has there: partial, each device's queries having added their part."""
    whole = [Replicate() if d in dims else p for d, p in enumerate(t.placements)]
    grad = [Partial() if d in dims else p for d, p in enumerate(t.placements)]
    if t.requires_grad:  # the reduce-scattered gradient goes back laid out as ``t`` says (GradInLayout)
        piece = GradInLayout.apply(t.to_local(), dim_order(t.stride()))
        t = DTensor.from_local(piece, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return t.redistribute(t.device_mesh, whole), grad


def _lower_right_causal(queries: int, keys: int, device) -> torch.Tensor:
    """The (queries, keys) boolean mask of the last ``queries`` positions of a causal
    sequence of ``keys``: query i sees keys up to ``keys - queries + i``. A plain tensor, not
    torch.nn.attention.bias.causal_lower_right: that tensor subclass cannot be saved and
    rebuilt by activation checkpointing (torch 2.13), and on CPU it materialises this same
    mask."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
