"""Switch a running model to another plan without a checkpoint (issue 24, item 3).

``autopar.reshard(pmodel, new_plan, optimizer=opt)`` lowers ``new_plan`` in the same process
group and moves every parameter, buffer and optimizer state tensor from the running plan's
layout to the new one's: ``DTensor.redistribute`` where both live on one device mesh (the
collectives DTensor picks: a shard gathered, a replica sliced), else the whole value gathered
once and each rank keeping its own slice of it. Optimizer states shaped like their
parameter (AdamW's ``exp_avg``, ``exp_avg_sq``) move with it; scalars (``step``) are copied.
The new optimizer is the old one's class with its parameter groups and hyper-parameters.

Data-parallel replica plans switch too, either way: each group holds every parameter (on
its own mesh), so every rank can gather the whole value within its group and keep its slice
of the new layout. Under a pipeline plan a rank holds one stage: values then travel whole
from a rank that holds them (:mod:`.move_staged`).

What is not moved: gradients (call it between steps, after ``optimizer.step()``), and plans
with expert weights living on one device or in a balanced order (those switch through a
sharded checkpoint, ``torch.distributed.checkpoint``, for now).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.passes.runtime import OWNED_ATTR, ROW_ORDER_ATTR, full_value
from autopar.planning.move_staged import assign_local, local_slice, move_through_broadcast, state_like

log = logging.getLogger(__name__)


def reshard(pmodel: nn.Module, plan: Plan, model: nn.Module | None = None,
            optimizer: torch.optim.Optimizer | None = None):
    """``pmodel`` (a ParallelModule) switched to ``plan``: the new ParallelModule holding the
    same values, and with ``optimizer`` also the optimizer over its parameters holding the
    same state. ``model``: the module to lower ``plan`` on (its values are not read; a
    ``meta`` one will do); by default a meta copy of the one ``pmodel`` was lowered from.
    Collective: every rank calls it alike."""
    from autopar.planning import lower_plan

    _check_switch(pmodel, plan)
    source = model if model is not None else _meta_model(pmodel)
    new = lower_plan(plan, source, pmodel.loss_fn)
    old_parameters = dict(pmodel.named_parameters(remove_duplicate=False))
    _check_layouts(old_parameters.values(), "running")
    _check_layouts(new.parameters(), "new")
    if "pipeline" in (pmodel.plan.family, plan.family):  # a rank holds one stage: values travel whole
        switched = move_through_broadcast(pmodel, new, source, optimizer)
        return new if optimizer is None else (new, switched)
    with torch.no_grad():
        for name, target in new.named_parameters(remove_duplicate=False):
            assign_local(target, moved(old_parameters[name], target))
        old_buffers = dict(pmodel.named_buffers())
        for name, target in new.named_buffers():
            if name in old_buffers:
                assign_local(target, moved(old_buffers[name], target))
    if optimizer is None:
        return new
    return new, _moved_optimizer(optimizer, pmodel, new)


def moved(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a tensor of the running plan) in ``like``'s layout, as ``like``'s local
    tensor on this rank. Collective over the mesh."""
    if isinstance(value, DTensor) and isinstance(like, DTensor) and value.device_mesh == like.device_mesh:
        return value.redistribute(like.device_mesh, like.placements).to_local()
    return local_slice(full_value(value) if isinstance(value, DTensor) else value, like)


def _check_switch(pmodel: nn.Module, plan: Plan) -> None:
    running = getattr(pmodel, "plan", None)
    if not isinstance(running, Plan):
        raise AutoparError(ErrorKind.BAD_INPUT, f"reshard() switches a model autopar lowered (autopar.apply or "
                           f"autopar.parallelize), got {type(pmodel).__name__}")
    if not isinstance(plan, Plan):
        raise AutoparError(ErrorKind.BAD_INPUT, f"reshard() needs an autopar.Plan to switch to, got "
                           f"{type(plan).__name__}")
    if not _same_model(running, plan):
        raise AutoparError(ErrorKind.BAD_PLAN, f"the new plan was made for a different graph (fingerprint "
                           f"{plan.fingerprint}, the running model's {running.fingerprint}); plan this model")
    if running.num_devices != plan.num_devices:
        raise AutoparError(ErrorKind.WORLD_MISMATCH, f"the running plan spans {running.num_devices} devices and the "
                           f"new one {plan.num_devices}: a change of world size switches through a sharded "
                           "checkpoint (torch.distributed.checkpoint), not in place")


def _same_model(a: Plan, b: Plan) -> bool:
    """Whether two plans are of one model: the same graph; for plans over device groups
    (their graphs are a micro-batch's or one group's share), the same parameters, name by name
    and size by size."""
    if a.fingerprint == b.fingerprint:
        return True
    sizes = ({name: p.bytes for name, p in plan.parameters.items()} for plan in (a, b))
    return {a.family, b.family} != {"one_mesh"} and next(sizes) == next(sizes)


def _check_layouts(parameters, which: str) -> None:
    for p in parameters:
        if hasattr(p, OWNED_ATTR) or hasattr(p, ROW_ORDER_ATTR):
            raise AutoparError(ErrorKind.BAD_PLAN, f"the {which} plan keeps expert weights on one device or in a "
                               "balanced order: reshard() does not move those yet; switch through a sharded "
                               "checkpoint (torch.distributed.checkpoint)")


def _meta_model(pmodel: nn.Module) -> nn.Module:
    """A ``meta`` copy of the model ``pmodel`` was lowered from (the fake copy its relowering
    keeps): enough to lower another plan on, whose values are then moved in."""
    relowering = getattr(pmodel, "relowering", None)
    fake = getattr(relowering, "model", None)
    if fake is None:
        raise AutoparError(ErrorKind.BAD_INPUT, "reshard() has no copy of the model this one was lowered from; pass "
                           "it: autopar.reshard(pmodel, plan, model=model) (a meta-device model will do)")
    meta = copy.deepcopy(fake)
    made: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor
    for module in meta.modules():
        for slots, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, value in list(slots.items()):
                if value is not None:
                    if id(value) not in made:
                        empty = torch.empty(value.shape, dtype=value.dtype, device="meta")
                        made[id(value)] = nn.Parameter(empty, value.requires_grad) if parameter else empty
                    slots[name] = made[id(value)]
    return meta


def _moved_optimizer(optimizer: torch.optim.Optimizer, old: nn.Module, new: nn.Module) -> torch.optim.Optimizer:
    """``optimizer``'s class over ``new``'s parameters, its groups, hyper-parameters and
    state moved from ``old``'s."""
    names = {id(p): name for name, p in old.named_parameters()}
    targets = dict(new.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise AutoparError(ErrorKind.BAD_INPUT, f"the optimizer holds {len(missing)} tensor(s) that are not "
                               "parameters of the running model; reshard() moves an optimizer over "
                               "pmodel.parameters() only")
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [targets[names[id(p)]] for p in group["params"]]})
    switched = type(optimizer)(groups)
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not state:
                    continue
                target = targets[names[id(p)]]
                switched.state[target] = {key: _moved_state(value, p, target) for key, value in state.items()}
    return switched


def _moved_state(value, parameter: torch.Tensor, target: torch.Tensor):
    """One optimizer state entry: shaped like its parameter, moved as the parameter is; else
    (a step count) copied."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(parameter.shape):
        return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return state_like(moved(value, target), target)
