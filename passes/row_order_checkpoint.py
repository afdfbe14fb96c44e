"""Stacked expert weights stored in a balanced order are checkpointed in the model's order.

Expert parallelism in a balanced order (passes.expert_order) stores row ``j`` of a stacked
``(E, ...)`` expert weight as expert ``order[j]``, so each device holds a block of the balanced
order. Checkpointed as it is, that DTensor would record its rows in the plan's order, and
only a plan with the same order could read it back. DCP asks each tensor of a state dict
where its local data sits in the whole tensor (the ``_Checkpointable`` protocol:
``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), and DTensor
forwards those questions to its local tensor when that tensor answers them. So the local
tensor of such a weight — and of each optimizer state shaped like it — is given answers in
the model's order: its rows cut into runs of consecutive experts, each run a chunk at its
rows' offset in the model. The checkpoint then holds the model's order, which any plan, any
world size or one process reads; nothing is gathered or copied, and loading writes each run
in place (``__get_tensor_shard__`` returns views).

Tensors made anew from these (``dcp.async_save``'s staging copies, ``get_state_dict``'s
``cpu_offload`` and ``full_state_dict`` options) carry no answers and record the plan's order
(docs/training.md says so). Parameters are marked by ``ParallelModule``'s state-dict hook;
optimizer states by a state-dict pre-hook on each optimizer, put there by a global optimizer
step hook the first time that optimizer steps (the optimizer is the user's: torch gives no
other place to reach it; its states exist only after a step, and ``get_state_dict`` steps a
fresh optimizer once to create them).
"""

from __future__ import annotations

import types
import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
# the local block of a DTensor in the whole tensor: the function DCP itself uses for DTensors
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.passes.runtime import ROW_ORDER_ATTR

_ANSWERS = "_autopar_model_order"  # the attribute of a marked local tensor holding its _Answers


class _Answers(NamedTuple):
    """What a marked local tensor answers DCP with."""

    order: list[int]  # the order its rows are stored in (slot j holds the model's row order[j])
    runs: list[tuple[int, ChunkStorageMetadata]]  # (first local row, chunk in the model's order)
    size: torch.Size  # the whole tensor's size


def model_order_runs(value: DTensor, order: list[int]) -> list[tuple[int, ChunkStorageMetadata]]:
    """(first local row, chunk in the model's order) for each run of this rank's rows of
    ``value`` (stored in ``order``) that are consecutive experts in the model."""
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    runs: list[tuple[int, ChunkStorageMetadata]] = []
    start = 0
    for row in range(1, sizes[0] + 1):
        if row < sizes[0] and order[offsets[0] + row] == order[offsets[0] + row - 1] + 1:
            continue
        chunk_offsets = torch.Size((order[offsets[0] + start], *offsets[1:]))
        runs.append((start, ChunkStorageMetadata(offsets=chunk_offsets, sizes=torch.Size((row - start, *sizes[1:])))))
        start = row
    return runs


def mark_model_order(value: DTensor, order: list[int]) -> None:
    """Make DCP save and load ``value`` (stored in ``order``) in the model's order; idempotent.
    The answers are methods bound to the local tensor rather than closures, so a deep copy (a
    snapshot) saves the values it was copied with, not the live tensor's later ones."""
    with torch.no_grad():
        local = value.to_local()  # the DTensor's own local tensor (no autograd wrapper)
    marked = getattr(local, _ANSWERS, None)
    if marked is not None and marked.order == order or not value.shape or value.shape[0] != len(order):
        return
    setattr(local, _ANSWERS, _Answers(list(order), model_order_runs(value, order), value.size()))
    for name, method in (("__create_write_items__", _create_write_items), ("__create_chunk_list__", _create_chunk_list),
                         ("__get_tensor_shard__", _get_tensor_shard)):
        setattr(local, name, types.MethodType(method, local))


def _create_write_items(local: torch.Tensor, fqn: str, _obj) -> list[WriteItem]:
    answers: _Answers = getattr(local, _ANSWERS)
    properties = TensorProperties.create_from_tensor(local)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=answers.size))
            for _start, chunk in answers.runs]


def _create_chunk_list(local: torch.Tensor) -> list[ChunkStorageMetadata]:
    return [chunk for _start, chunk in getattr(local, _ANSWERS).runs]


def _get_tensor_shard(local: torch.Tensor, index: MetadataIndex) -> torch.Tensor:
    for start, chunk in getattr(local, _ANSWERS).runs:
        if chunk.offsets == index.offset:
            return local.narrow(0, start, chunk.sizes[0])
    raise ValueError(f"{index.fqn}: no rows of this rank start at {tuple(index.offset)} in the model's order")


def mark_state_dict(module: torch.nn.Module, state_dict: dict, prefix: str, _local_metadata) -> None:
    """``module``'s state-dict post-hook: its reordered parameters' entries in the model's order."""
    for name, param in module.named_parameters(remove_duplicate=False):
        order = getattr(param, ROW_ORDER_ATTR, None)
        value = state_dict.get(prefix + name)
        if order is not None and isinstance(value, DTensor):
            mark_model_order(value, order)


_watched: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_hook = None


def watch_optimizers() -> None:
    """Register (once per process) the optimizer step hook that gives each optimizer its
    state-dict pre-hook (:func:`_watch`)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_post_hook(_watch)


def _watch(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """After an optimizer's step (its states exist now): once per optimizer, a state-dict
    pre-hook that marks them whenever they are read for a checkpoint."""
    if optimizer not in _watched:
        optimizer.register_state_dict_pre_hook(_mark_optimizer_states)
        _watched.add(optimizer)


def _mark_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Every DTensor state shaped like a reordered parameter, in that parameter's order."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            order = getattr(param, ROW_ORDER_ATTR, None)
            if order is None:
                continue
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, DTensor) and value.shape == param.shape:
                    mark_model_order(value, order)
