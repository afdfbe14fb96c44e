"""Move training state into or out of pipeline stages (``autopar.reshard``; issue 24, item 3).

Under a pipeline plan a rank holds only its stage's parameters, so a value cannot be
resharded in place: for each parameter (every rank going through the model's names in one
order) the ranks that hold it under the running plan gather it whole within their mesh, the
first of them broadcasts it to every rank, and each rank that holds it under the new plan
keeps its slice. The optimizer state shaped like a parameter (AdamW's moments) travels the
same way; a step count is copied from the holder. One value at a time: no rank holds more
than one whole parameter beyond its own state.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.errors import AutoparError, ErrorKind
from autopar.passes.runtime import full_value


def move_through_broadcast(old: nn.Module, new: nn.Module, model: nn.Module,
                           optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """Copy every parameter and buffer of ``old`` (the running ParallelModule) into ``new``
    (the new plan's), and return ``optimizer`` rebuilt over ``new``'s parameters on this rank
    with its state moved (None without one). ``model``: what both were lowered from (its
    parameters' names, shapes and dtypes; a meta copy). Collective over the world."""
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters(remove_duplicate=False)}
    buffers = {name: (tuple(b.shape), b.dtype) for name, b in model.named_buffers()}
    shapes.update(buffers)
    held = dict(old.named_parameters(remove_duplicate=False)) | dict(old.named_buffers())
    targets = dict(new.named_parameters(remove_duplicate=False)) | dict(new.named_buffers())
    facts = _optimizer_facts(optimizer, old)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(held), facts))
    holder = {}
    for rank, (names, _) in enumerate(everyone):
        for name in names:
            holder.setdefault(name, rank)
    device = getattr(new, "device", torch.device("cpu"))  # where the new program's tensors live
    states = {}
    for _, rank_facts in everyone:
        for name, fact in rank_facts["state"].items():
            states.setdefault(name, fact)
    with torch.no_grad():
        for name, (shape, dtype) in shapes.items():
            if name not in holder:
                if name in buffers:
                    continue  # a buffer the running program folded into its graph: the new one has its own
                raise AutoparError(ErrorKind.BAD_PLAN, f"no rank holds {name} under the running plan: was it "
                                   "lowered from this model?")
            whole = _broadcast_whole(held.get(name), shape, dtype, holder[name], device)
            if name in targets:
                assign_local(targets[name], local_slice(whole, targets[name]))
    if optimizer is None:
        return None
    return _moved_optimizer(optimizer, old, new, shapes, holder, states, everyone, device)


def _broadcast_whole(value: torch.Tensor | None, shape: tuple, dtype: torch.dtype, source: int,
                     device: torch.device) -> torch.Tensor:
    """The whole ``value`` on every rank, on ``device``: gathered within the holders' mesh, sent
    from ``source``."""
    whole = full_value(value) if value is not None else None  # collective over the holders' mesh
    buffer = whole.detach().to(device, copy=True) if dist.get_rank() == source \
        else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buffer, src=source)
    return buffer


def _optimizer_facts(optimizer: torch.optim.Optimizer | None, old: nn.Module) -> dict:
    """What other ranks need of this rank's optimizer: each held parameter's group (its
    hyper-parameters) and state keys (the tensors' shapes, other values as they are)."""
    if optimizer is None:
        return {"groups": {}, "state": {}}
    names = {id(p): name for name, p in old.named_parameters()}
    groups, state = {}, {}
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if id(p) not in names:
                raise AutoparError(ErrorKind.BAD_INPUT, "the optimizer holds tensors that are not parameters of the "
                                   "running model; reshard() moves an optimizer over pmodel.parameters() only")
            groups[names[id(p)]] = settings
            state[names[id(p)]] = {key: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                                   and v.dim() else ("value", copy.deepcopy(v.item() if isinstance(v, torch.Tensor)
                                                                           else v), getattr(v, "dtype", None))
                                   for key, v in optimizer.state.get(p, {}).items()}
    return {"groups": groups, "state": state}


def _moved_optimizer(optimizer, old: nn.Module, new: nn.Module, shapes: dict, holder: dict, states: dict,
                     everyone: list, device: torch.device) -> torch.optim.Optimizer:
    """``optimizer``'s class over this rank's new parameters, grouped and set as the holder of
    each had them, its state moved one tensor at a time (through ``device``)."""
    settings = {}
    for _, rank_facts in everyone:
        for name, group in rank_facts["groups"].items():
            settings.setdefault(name, group)
    mine = dict(new.named_parameters())
    grouped: dict[str, dict] = {}
    for name, target in mine.items():
        group = settings.get(name)
        if group is None:
            continue  # a parameter the old optimizer did not step: neither does the new one
        key = repr(sorted(group.items()))
        grouped.setdefault(key, {**group, "params": []})["params"].append(target)
    switched = type(optimizer)(list(grouped.values()) or [{"params": []}])
    old_params = dict(old.named_parameters())
    with torch.no_grad():
        for name in shapes:
            for key, (kind, *rest) in states.get(name, {}).items():
                if kind == "value":
                    value, dtype = rest
                    if name in mine and name in settings:
                        # a step count: torch's optimizers keep it on the CPU (not capturable nor fused)
                        entry = torch.tensor(value, dtype=dtype, device="cpu") if dtype is not None else value
                        switched.state[mine[name]][key] = entry
                    continue
                shape, dtype = rest
                ours = old_params.get(name)
                value = optimizer.state[ours][key] if ours is not None and ours in optimizer.state else None
                whole = _broadcast_whole(value, shape, dtype, holder[name], device)
                if name in mine and name in settings:
                    switched.state[mine[name]][key] = state_like(local_slice(whole, mine[name]), mine[name])
    return switched


def local_slice(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``whole`` in ``like``'s layout. Every rank holds the whole value:
    each keeps its own slice, no data sent (src_data_rank=None)."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()


def assign_local(target: torch.Tensor, local: torch.Tensor) -> None:
    """Copy ``local`` into ``target``'s piece on this rank."""
    (target.to_local() if isinstance(target, DTensor) else target).copy_(local)


def state_like(local: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor for ``target`` from this rank's piece ``local``: a DTensor of
    ``target``'s layout, or a plain copy."""
    if not isinstance(target, DTensor):
        return local.clone()
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                              shape=target.shape, stride=target.stride())
