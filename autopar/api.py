"""Public API: ``plan``, ``apply``, ``parallelize``. Thin orchestration, keyword-only options.

>>> plan = autopar.plan(model, (x,), cluster="4xA100-80GB")        # doctest: +SKIP
>>> pmodel = autopar.apply(model, plan)   # in a process group of 4  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan

log = logging.getLogger(__name__)


def plan(model: nn.Module, example_inputs, cluster: "str | Cluster" = "8xH100", *,
         memory_limit: float | None = None, optimizer: str = "adamw", solver: str = "cpsat",
         time_limit_s: float = 60.0, mesh_shape: tuple[int, ...] | None = None,
         cluster_layers: bool = True) -> Plan:
    """Plan ``model`` for ``cluster`` without any process group; returns a :class:`Plan`.

    ``memory_limit`` (bytes per device) overrides the device's memory; ``optimizer`` sets how
    much state each parameter carries (sgd 0, momentum 1, adam/adamw 2 copies).
    ``cluster_layers`` lets identical layers share decisions (smaller problem, same plan shape).
    """
    from autopar.passes.capture import capture
    from autopar.planner import make_plan

    target = Cluster.from_spec(cluster, memory_limit_bytes=memory_limit)
    start = time.perf_counter()
    captured = capture(model, example_inputs)
    capture_s = time.perf_counter() - start
    result = make_plan(captured, target, optimizer=optimizer, solver=solver,
                       time_limit_s=time_limit_s, mesh_shape=mesh_shape, cluster_layers=cluster_layers)
    result.timings["capture_s"] = capture_s
    return result


def apply(model: nn.Module, plan: Plan) -> torch.fx.GraphModule:
    """Lower ``plan`` onto ``model`` inside an initialised process group of the plan's size.

    Every rank calls the returned module with the same full inputs and gets full outputs.
    """
    from autopar.passes.capture import capture

    if not isinstance(plan, Plan):
        raise AutoparError(ErrorKind.BAD_INPUT, f"apply() needs an autopar.Plan, got {type(plan).__name__}; "
                           "load one with autopar.load_plan(path)")
    _check_world(plan)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    inputs = tuple(torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device) for spec in plan.inputs)
    return _lower(capture(model, inputs), plan, model)


def parallelize(model: nn.Module, example_inputs, cluster: "str | Cluster | None" = None, **options) -> torch.fx.GraphModule:
    """Plan and apply in one call, inside a process group.

    ``cluster=None`` plans for the current world: one ``cpu`` device per rank. Rank 0 plans
    and broadcasts the plan, so every rank runs the same one.
    """
    from autopar.passes.capture import capture
    from autopar.planner import make_plan

    if not dist.is_available() or not dist.is_initialized():
        raise AutoparError(ErrorKind.WORLD_MISMATCH,
                           "parallelize() runs inside a process group (torchrun, or dist.init_process_group); "
                           "to plan without one use autopar.plan(...)")
    target = Cluster.from_spec(cluster or f"{dist.get_world_size()}xcpu", options.pop("memory_limit", None))
    captured = capture(model, example_inputs)
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = make_plan(captured, target, **options).to_json()
        except AutoparError as exc:  # every rank must learn about it, not only rank 0
            payload[0] = exc
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], AutoparError):
        raise payload[0]
    return _lower(captured, Plan.from_json(payload[0]), model)


def _check_world(plan: Plan) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise AutoparError(ErrorKind.WORLD_MISMATCH,
                           f"apply() needs an initialised process group of {plan.num_devices} ranks "
                           f"(e.g. torchrun --nproc-per-node {plan.num_devices})")
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise AutoparError(ErrorKind.WORLD_MISMATCH,
                           f"plan is for {plan.num_devices} devices (mesh {list(plan.mesh_shape)}) but the "
                           f"process group has {world} ranks; re-plan for {world} devices or launch "
                           f"{plan.num_devices} processes")


def _lower(captured, plan: Plan, model: nn.Module) -> torch.fx.GraphModule:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.passes.lower import lower

    _check_world(plan)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    return lower(captured, plan, mesh, model)
