"""Time of resharding a tensor between two placements on a mesh, forward and backward (the
table in passes.build_problem's docstring; ring formulas in autopar.comm), and the same as
bytes sent (on :func:`unit_links`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from autopar import placements as pl
from autopar.comm import DDP_BUCKET_BYTES, smallest, all_gather_s, all_reduce_s, all_to_all_s, reduce_scatter_s
from autopar.mesh import MeshSpec
from autopar.passes.sparse import UNIT_LINK


@functools.lru_cache(maxsize=64)
def unit_links(mesh: MeshSpec) -> MeshSpec:
    """``mesh`` with every link at 1 byte/s and no latency: a collective's time is its volume."""
    return dataclasses.replace(mesh, links=(UNIT_LINK,) * len(mesh.shape))


class Parts(NamedTuple):
    """A parameter reshard's time by what it is (autopar.problem's overlap model): the forward
    gathers (prefetched a layer ahead), the backward re-gather of a weight freed after forward
    (FSDP2 prefetches it a layer ahead in backward), and the gradient's reduction (of kind
    ``reduction_kind``, issued as gradients become ready). Every other reshard has none of
    these: all of it is on the critical path."""
    total: float
    forward: float
    regather: float
    reduction: float
    reduction_kind: str  # "all_reduce" (bucketed) or "reduce_scatter"


@functools.lru_cache(maxsize=1 << 18)
def reshard_s(src: pl.Spec, dst: pl.Spec, split: tuple[bool, ...], nbytes: int,
              needs_grad: bool, mesh: MeshSpec, regather: bool = False, sync_nbytes=None,
              state: pl.Spec | None = None, bucket_bytes: int = DDP_BUCKET_BYTES) -> float | None:
    """Forward (+ backward) time to turn placement ``src`` into ``dst``; None if impossible
    (:func:`reshard_parts`, summed)."""
    parts = reshard_parts(src, dst, split, nbytes, needs_grad, mesh, regather, sync_nbytes, state, bucket_bytes)
    return None if parts is None else parts.total


@functools.lru_cache(maxsize=1 << 18)
def reshard_parts(src: pl.Spec, dst: pl.Spec, split: tuple[bool, ...], nbytes: int,
                  needs_grad: bool, mesh: MeshSpec, regather: bool = False, sync_nbytes=None,
                  state: pl.Spec | None = None, bucket_bytes: int = DDP_BUCKET_BYTES) -> Parts | None:
    """Forward (+ backward) time to turn placement ``src`` into ``dst``, by part; None if impossible.

    ``regather`` (parameter edges): a sharded parameter gathered for use is gathered again for
    backward (FSDP frees the full weight after forward), so S→R pays two all-gathers; and a
    gradient that only needs all-reduces (a replicated parameter's partial sums) joins the
    flat gradient buckets of ``bucket_bytes`` (passes.grad_sync: DDP's bucket_cap_mb), so it
    pays the share of a bucket's latency its bytes take (a linear stand-in for
    ⌈bytes / bucket⌉ latencies over all such gradients); ``sync_nbytes`` is that gradient's
    size there when it differs from the edge's (mixed precision all-reduces the fp32 master
    gradient).

    ``state`` (a ZeRO-2 parameter): where the parameter's gradient and master live instead of
    ``src``: its gradient is reduce-scattered there, and the updated master all-gathered back
    to ``src`` once per step (both one by one, as lowered).

    Under mixed precision a gathered weight's gradient is reduced at ``sync_nbytes`` too: the
    gather casts the fp32 master before it moves and reduces the gradient in float32 onto it
    (FSDP2's ``reduce_dtype``; passes.lower); other reshards move the compute dtype both ways.
    """
    ahead = reshard_forward_s(src, dst, nbytes, mesh, state if needs_grad else None)
    if ahead is None or not needs_grad:
        return None if ahead is None else Parts(ahead, ahead if regather else 0.0, 0.0, 0.0, "all_reduce")
    grad = tuple(b if b.is_shard or b is pl.O or b is pl.D else (pl.P if split and split[d] and b is pl.R else pl.R)
                 for d, b in enumerate(dst))
    if state is not None:
        back = _sequential_s(grad, state, sync_nbytes or nbytes, mesh, mesh.links)
        if back is None:
            return None
        reduction, kind = back, "reduce_scatter"
    else:
        want = tuple(pl.R if a.is_partial else a for a in src)
        bucketed = regather and all(g is w or (g is pl.P and w is pl.R) for g, w in zip(grad, want))
        gathered = regather and any(a.is_shard and b is pl.R for a, b in zip(src, dst))
        grad_nbytes = sync_nbytes if sync_nbytes and (bucketed or gathered) else nbytes
        share = smallest(1.0, grad_nbytes / bucket_bytes)
        links = tuple(dataclasses.replace(link, latency_s=link.latency_s * share) for link in mesh.links) \
            if bucketed else mesh.links
        reduction = _sequential_s(grad, want, grad_nbytes, mesh, links)
        kind = "all_reduce" if bucketed or not any(w.is_shard and g is not w for g, w in zip(grad, want)) \
            else "reduce_scatter"
    if not regather:
        return Parts(ahead + reduction, 0.0, 0.0, 0.0, kind)
    again = _sequential_s(tuple(a if a.is_shard else pl.R for a in src),
                          tuple(pl.R if a.is_shard and b is pl.R else (a if a.is_shard else pl.R)
                                for a, b in zip(src, dst)), nbytes, mesh, mesh.links)
    return Parts(ahead + reduction + again, ahead, again, reduction, kind)


@functools.lru_cache(maxsize=1 << 16)
def reshard_forward_s(src: pl.Spec, dst: pl.Spec, nbytes: int, mesh: MeshSpec,
                      state: pl.Spec | None = None) -> float | None:
    """The part of :func:`reshard_s` a parameter edge pays outside backward: the gather for
    use (prefetched before the layer runs) and, for a ZeRO-2 parameter, the all-gather of the
    updated master after the optimizer step (ahead of the next forward)."""
    if src != dst and (pl.O in src or pl.O in dst):
        return None  # an expert weight on its owner feeds its stack as it lives (runtime.stack_owned)
    forward = _sequential_s(src, dst, nbytes, mesh, mesh.links)
    if forward is None or state is None:
        return forward
    update = _sequential_s(state, src, nbytes, mesh, mesh.links)
    return None if update is None else forward + update


def _sequential_s(src: pl.Spec, dst: pl.Spec, nbytes: int, mesh: MeshSpec, links) -> float | None:
    """Convert one mesh dim at a time, innermost first; each collective moves the tensor
    as currently sharded on the other dims (a 2-D all-gather costs ¼ + ½ of the bytes)."""
    shape = mesh.shape
    sharded = 1  # devices the tensor is currently split over (the product of its sharded dims)
    for p, size in zip(src, shape):
        if p.is_shard:
            sharded *= size
    total = 0.0
    for d in range(len(src) - 1, -1, -1):
        a, b = src[d], dst[d]
        if a is b:
            continue
        size = shape[d]
        others = sharded // size if a.is_shard else sharded  # split over the other dims
        step = _transition_s(a, b, nbytes / others, size, links[d])
        if step is None:
            return None
        total += step
        sharded = (sharded // size if a.is_shard else sharded) * (size if b.is_shard else 1)
    return total


def _transition_s(a: pl.Placement, b: pl.Placement, nbytes: float, n: int, link) -> float | None:
    if a is b:
        return 0.0
    if a is pl.O or b is pl.O or a is pl.D or b is pl.D:
        return None  # an owned expert weight only feeds its stack; dispatched ids only their gathers
    if a is pl.R and (b is pl.P or b.is_shard):
        return 0.0  # local: slice, or keep the value on one rank and zeros elsewhere (R→P)
    if b.is_partial:
        return None
    if a.is_shard:
        return all_gather_s(nbytes, n, link) if b is pl.R else all_to_all_s(nbytes, n, link)
    return all_reduce_s(nbytes, n, link) if b is pl.R else reduce_scatter_s(nbytes, n, link)
