"""Hand-written parallel configurations, expressed as fixed placements of parameters and
inputs; the ILP fills in the remaining ops, so each baseline is costed by the same model.

``leaf_options[i]`` lists, for problem node i, the placement (autopar.placements spec) of each
strategy of an input node, and of a parameter node the :class:`Kept` pair (its placement, where
its optimizer states live) (empty for other nodes); ``roles[i]`` says which Megatron role a
parameter plays ("column_weight", "column_bias", "row_weight", "row_bias", "table" for a
sparse embedding table, or None);
``batch_dims[i]`` is the batch dimension of an input (None: the input has no batch dim and
stays replicated). In the rules, ``BATCH`` stands for "shard on the batch dim".
``BASELINES`` are for a 1-D mesh over all devices, ``BASELINES_2D`` for a 2-D mesh whose
inner dimension lies inside a host.

>>> options = [(R,), (Shard(0),)]
>>> kept = [Kept(o, o) for o in options]
>>> ddp(["param", "input", "op"], [kept, options, []], [None, None, None], [None, 0, None])
{0: 0, 1: 1}
"""

from __future__ import annotations

from typing import NamedTuple

from autopar.placements import R, Shard, Spec

BATCH = object()  # in a rule: Shard(batch dim) for an input with one, R for an input without
SEQUENCE = object()  # in a rule: Shard(the dim after the batch dim) for an input with one, R for others


class Kept(NamedTuple):
    """A parameter option: placed ``use`` for compute, its master weight, gradient and
    optimizer states placed ``state`` (the same, except under ZeRO-2). A rule's plain spec
    wants the two equal."""

    use: Spec
    state: Spec


def _pick(options: list, wanted: list) -> int | None:
    for w in wanted:
        if w in options:
            return options.index(w)
    return None


def _fix(kinds, leaf_options, batch_dims, param_wanted, input_wanted, roles=None,
         by_role=None) -> dict[int, int] | None:
    fixed = {}
    for i, (kind, options) in enumerate(zip(kinds, leaf_options)):
        wanted = param_wanted if kind == "param" else input_wanted if kind == "input" else None
        if kind == "param" and by_role and roles[i] in by_role:
            wanted = by_role[roles[i]]
        if wanted is None:
            continue
        if kind == "input":
            batch = batch_dims[i] if batch_dims else 0
            on_batch = R if batch is None else Shard(batch)
            on_sequence = R if batch is None else Shard(batch + 1)  # absent from options when it has no such dim
            wanted = [tuple(on_batch if p is BATCH else on_sequence if p is SEQUENCE else p for p in w)
                      for w in wanted]
        else:
            wanted = [w if isinstance(w, Kept) else Kept(w, w) for w in wanted]
        choice = _pick(options, wanted)
        if choice is None:
            return None  # e.g. a batch not divisible by the data-parallel degree
        fixed[i] = choice
    return fixed


def ddp(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None) -> dict[int, int] | None:
    """DDP: parameters replicated, inputs split on the batch dim."""
    return _fix(kinds, leaf_options, batch_dims, [(R,)], [(BATCH,)])


def fsdp(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None) -> dict[int, int] | None:
    """FSDP / ZeRO-3: parameters sharded on dim 0 (replicated when too small), batch split."""
    return _fix(kinds, leaf_options, batch_dims, [(Shard(0),), (R,)], [(BATCH,)])


def zero2(kinds: list[str], leaf_options: list[list], roles, batch_dims=None) -> dict[int, int] | None:
    """ZeRO-2 (DeepSpeed; FSDP2 without resharding after forward): parameters used replicated,
    their master weights, gradients and optimizer states split on the first dim that splits
    evenly (replicated when none does), batch split."""
    return _fix(kinds, leaf_options, batch_dims, [Kept((R,), (Shard(0),)), Kept((R,), (Shard(1),)), (R,)],
                [(BATCH,)])


MEGATRON_ROLES = {"column_weight": [(Shard(0),)], "column_bias": [(Shard(0),)], "row_weight": [(Shard(1),)],
                  "row_bias": [(R,)]}


def megatron_tp(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None) -> dict[int, int] | None:
    """Megatron tensor parallelism over all devices: linear layers alternate column-parallel
    (weight rows and bias sharded) and row-parallel (weight columns sharded, bias replicated);
    everything else replicated, inputs replicated. Infeasible when no linear layer exists."""
    if not any(role in MEGATRON_ROLES for role in roles):
        return None
    return _fix(kinds, leaf_options, batch_dims, [(R,)], [(R,)], roles, MEGATRON_ROLES)


def row_wise(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None) -> dict[int, int] | None:
    """Every sparse embedding table sharded by rows (replicated when its rows do not split
    evenly; lookups routed to the owner of each row,
    TorchRec's row-wise sharding), dense parameters replicated, batch split. Not applicable
    to a model without sparse tables."""
    if "table" not in roles:
        return None
    return _fix(kinds, leaf_options, batch_dims, [(R,)], [(BATCH,)], roles, {"table": [(Shard(0),), (R,)]})


def context_parallel(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None
                     ) -> dict[int, int] | None:
    """Context parallelism as torchtitan runs it on one mesh dim (its ``dp_shard_cp``):
    parameters sharded on dim 0 as by FSDP (replicated when too small), every input split on
    its sequence dim (the one after the batch dim; replicated when it has none or it does
    not split evenly); attention then splits its sequence too (passes.context_parallel).
    Not applicable when no input has a sequence dim to split."""
    fixed = _fix(kinds, leaf_options, batch_dims, [(Shard(0),), (R,)], [(SEQUENCE,), (R,)])
    if fixed is None or all(leaf_options[i][c] == (R,) for i, c in fixed.items() if kinds[i] == "input"):
        return None
    return fixed


BASELINES = {"ddp": ddp, "zero2": zero2, "fsdp": fsdp, "megatron_tp": megatron_tp, "row_wise": row_wise}


def tp_dp(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None) -> dict[int, int] | None:
    """Megatron inside a host (inner mesh dim) × data parallel across hosts (outer dim)."""
    if not any(role in MEGATRON_ROLES for role in roles):
        return None
    by_role = {role: [(R, *p[0])] for role, p in MEGATRON_ROLES.items()}
    return _fix(kinds, leaf_options, batch_dims, [(R, R)], [(BATCH, R)], roles, by_role)


def fsdp_tp(kinds: list[str], leaf_options: list[list[Spec]], roles, batch_dims=None) -> dict[int, int] | None:
    """FSDP across hosts (outer mesh dim: parameters sharded on dim 0, the batch split) ×
    Megatron inside a host (inner dim): FSDP2 + TP, torchtitan's 2-D layout (its 405B run
    on 128 H100 is FSDP 16 × TP 8). A parameter too small to split on the outer dim stays
    whole there."""
    if not any(role in MEGATRON_ROLES for role in roles):
        return None
    by_role = {role: [(Shard(0), *p[0]), (R, *p[0])] for role, p in MEGATRON_ROLES.items()}
    return _fix(kinds, leaf_options, batch_dims, [(Shard(0), R), (R, R)], [(BATCH, R)], roles, by_role)


BASELINES_2D = {"tp_dp": tp_dp}
# configurations pinned only on request (``configuration=``), not costed beside every plan: each
# costed baseline is one more pinned solve per mesh (these two added 4 s of the 10.6 s the
# 8×8 Llama-8B case plans in)
ON_REQUEST = {"context_parallel": context_parallel}
ON_REQUEST_2D = {"fsdp_tp": fsdp_tp}


def configurations(mesh_dims: int) -> dict:
    """Every hand-written configuration ``configuration=`` may pin on a mesh of ``mesh_dims``."""
    return {**BASELINES, **ON_REQUEST} if mesh_dims == 1 else {**BASELINES_2D, **ON_REQUEST_2D}


CONFIGURATIONS = tuple({**BASELINES, **ON_REQUEST, **BASELINES_2D, **ON_REQUEST_2D})
