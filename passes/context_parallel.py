"""Context parallelism: fused attention with the sequence split over the devices of a mesh
dim (issue 21), so a sequence too long for one device's activations is planned at all.

Each device holds a contiguous chunk of the queries, keys and values (``Shard(2)`` of the
(B, H, T, E) tensors; every other op of the model splits its sequence dim by DTensor's own
rules). Attention all-gathers the keys and values over that mesh dim and runs the fused
kernel on its own queries against every key before (causal) or all of them: the scheme
Llama 3 was trained with (all-gather context parallelism), chosen over a ring because with
grouped-query attention the keys and values are a fraction of the queries and one gather
is one collective, and because the runtime needs no kernel-specific log-sum-exp merging
(torch's ring attention dispatches only the CUDA kernels). Backward reduce-scatters the
keys' and values' gradients (DTensor: a partial gradient back onto the shard).

Costed here, read by passes.build_problem: the gather and the reduce-scatter on the mesh
dim's link, the gathered keys and values kept for backward, and the busiest device's
attention work. Chunks are contiguous, so under a causal mask the device with the last chunk
computes its queries against the whole sequence: 2/n of causal attention instead of 1/n.
The balanced twin of a causal split (``exchange="balanced_causal"``) evens that out as
torchtitan's load balancer does — device r computes query half-chunks r and 2n−1−r — but
inside the op: the query halves travel to the device computing them and their outputs come
back (one all-to-all each way, and again for the gradients), so the rest of the model keeps
its contiguous sequence order. The search takes whichever is faster.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from autopar import placements as pl
from autopar.comm import all_gather_s, reduce_scatter_s
from autopar.mesh import MeshSpec
from autopar.passes.cost import FUSED_ATTENTION, attention_args, tensor_bytes
from autopar.plan_types import ATTENTION_SEQUENCE_DIM as SEQUENCE_DIM

SEQUENCE_SPLIT = pl.Shard(SEQUENCE_DIM)
BALANCED_CAUSAL = "balanced_causal"  # Strategy.exchange of a causal split's load-balanced twin


def context_rule(node: torch.fx.Node) -> tuple[tuple, tuple] | None:
    """The one-mesh-dim rule splitting ``node``'s sequence (outputs, inputs), or None where
    it does not apply: attention of a sequence with itself (as many keys as queries). An
    explicit (…, L, S) mask — Hugging Face models pass their causal mask so — splits its
    query rows with the queries (each device reads the rows of its own queries against every
    key); one with a single query row (a padding mask) stays whole."""
    if node.target is not FUSED_ATTENTION:
        return None
    query, key, value, mask, *_ = attention_args(node)
    if query.meta["val"].dim() != 4 or query.meta["val"].shape[SEQUENCE_DIM] != key.meta["val"].shape[SEQUENCE_DIM]:
        return None
    if mask is None:
        return (SEQUENCE_SPLIT,), (SEQUENCE_SPLIT,) * 3
    rows = mask.meta["val"].shape[-2] if mask.meta["val"].dim() >= 2 else 1
    if mask.meta["val"].dim() != 4 and rows > 1:
        return None  # a 2-D or 3-D mask: its query dim is not the queries' dim 2
    return (SEQUENCE_SPLIT,), (SEQUENCE_SPLIT,) * 3 + (SEQUENCE_SPLIT if rows > 1 else pl.R,)


def context_dims(node: torch.fx.Node, strategy) -> list[int]:
    """Mesh dims on which ``strategy`` of ``node`` splits attention's sequence."""
    if node.target is not FUSED_ATTENTION or not strategy.outputs or strategy.outputs[0] is None:
        return []
    return [d for d, p in enumerate(strategy.outputs[0]) if p == SEQUENCE_SPLIT]


def _is_causal(node: torch.fx.Node) -> bool:
    return bool(attention_args(node)[5])


def causal_imbalance(node: torch.fx.Node, strategy, mesh_shape: tuple[int, ...]) -> float:
    """What a causal sequence split over n devices keeps of the even split of ``node``'s
    work (strategies.work_split), as its busiest device sees it; 1 for every other strategy.
    In contiguous chunks the last device's queries see every key: T²/n of the T²/2 pairs, a
    split of n/2 (a factor 1/2). Balanced, each device computes two half-chunks,
    (2n+1)·(T/2n)² pairs (whole blocks, the diagonal ones too): a split of 2n²/(2n+1)
    (a factor 2n/(2n+1))."""
    factor = 1.0
    if node.target is FUSED_ATTENTION and _is_causal(node):
        for d in context_dims(node, strategy):
            n = mesh_shape[d]
            if n > 1:
                factor *= 2 * n / (2 * n + 1) if strategy.exchange == BALANCED_CAUSAL else 0.5
    return factor


def balanced_twins(node: torch.fx.Node, strategies: list, mesh_shape: tuple[int, ...]) -> list:
    """The load-balanced twin of every causal sequence split of ``node`` with no explicit
    mask, whose local chunks halve evenly."""
    if node.target is not FUSED_ATTENTION or not _is_causal(node) or attention_args(node)[3] is not None:
        return []
    return [dataclasses.replace(s, exchange=BALANCED_CAUSAL) for s in strategies
            if context_dims(node, s) and _evenly_halved(node, s, mesh_shape)]


def _evenly_halved(node: torch.fx.Node, strategy, mesh_shape: tuple[int, ...]) -> bool:
    length = attention_args(node)[0].meta["val"].shape[SEQUENCE_DIM]
    parts = math.prod(mesh_shape[d] for d in context_dims(node, strategy))
    return length % (2 * parts) == 0


def _kv_bytes(node: torch.fx.Node, strategy, mesh_shape: tuple[int, ...], gathered_dim: int) -> float:
    """Bytes of keys plus values one device holds once they are gathered on ``gathered_dim``
    (still split on every other dim their placement splits)."""
    total = 0.0
    for arg, spec in zip(attention_args(node)[1:3], strategy.inputs[1:3]):
        parts = math.prod(size for d, (p, size) in enumerate(zip(spec, mesh_shape)) if d != gathered_dim
                          and p is not pl.R)
        total += tensor_bytes(arg.meta["val"]) / parts
    return total


def kv_exchange_s(node: torch.fx.Node, strategy, mesh: MeshSpec, links=None, forward_only: bool = False) -> float:
    """Time of the keys' and values' all-gather (forward) and their gradients'
    reduce-scatter (backward) on each mesh dim the sequence is split on; balanced, also the
    query half-chunks sent to the devices computing them and their outputs back, and the
    same for the gradients (each device sends at most its whole query chunk each time).
    ``forward_only``: the forward's part (what a recomputed layer runs again)."""
    links = links or mesh.links
    total = 0.0
    for d in context_dims(node, strategy):
        n = mesh.shape[d]
        nbytes = _kv_bytes(node, strategy, mesh.shape, d)
        total += all_gather_s(nbytes, n, links[d]) + (0.0 if forward_only else reduce_scatter_s(nbytes, n, links[d]))
        if strategy.exchange == BALANCED_CAUSAL and n > 1:
            query = tensor_bytes(attention_args(node)[0].meta["val"]) / pl.divided_over(strategy.inputs[0], mesh.shape)
            sends = 2 if forward_only else 4
            total += sends * (query / links[d].bandwidth_Bps + 2 * links[d].latency_s) / links[d].efficiency("all_to_all")
    return total


def gathered_kv_bytes(node: torch.fx.Node, strategy, mesh_shape: tuple[int, ...], copies: int) -> int:
    """Bytes of the gathered keys and values the kernel keeps for backward, beyond the
    producers' own shards (counted with the producers), for ``copies`` micro-batches."""
    extra = 0.0
    for d in context_dims(node, strategy):
        extra += _kv_bytes(node, strategy, mesh_shape, d) * (1 - 1 / mesh_shape[d])
    return int(copies * extra)
