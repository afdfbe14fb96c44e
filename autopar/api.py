"""Public API: ``plan``, ``apply``, ``parallelize``. Thin orchestration, keyword-only options.

>>> plan = autopar.plan(model, (x,), cluster="4xA100-80GB")        # doctest: +SKIP
>>> pmodel = autopar.apply(model, plan)   # in a process group of 4  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.parallel import ParallelModule
from autopar.plan import Plan

log = logging.getLogger(__name__)


def plan(model: nn.Module, example_inputs, cluster: "str | Cluster" = "8xH100", *,
         memory_limit: float | None = None, optimizer: str = "adamw", solver: str = "cpsat",
         time_limit_s: float = 60.0, mesh_shape: tuple[int, ...] | None = None,
         cluster_layers: bool = True, pipeline: bool | None = None, micro_batches: int | None = None,
         schedule: str = "1F1B", replicas: bool | None = None, batch_split: tuple[int, ...] | None = None,
         configuration: str | None = None, sparsity: dict[str, float] | None = None,
         symbolic: bool = False) -> Plan:
    """Plan ``model`` for ``cluster`` without any process group; returns a :class:`Plan`.

    ``memory_limit`` (bytes per device) overrides the device's memory; ``optimizer`` sets how
    much state each parameter carries (sgd 0, momentum 1, adam/adamw 2 copies).
    ``cluster_layers`` lets identical layers share decisions (smaller problem, same plan shape).
    On a cluster with several device groups (regions), the planner also tries pipeline stages
    over the groups and data-parallel replicas on the groups (the batch split by their speed),
    and keeps the fastest; ``pipeline=True`` or ``replicas=True`` forces one of them, ``False``
    rules it out. ``micro_batches`` pins the pipeline's micro-batch count, ``batch_split`` the
    replicas' rows per group. ``configuration="ddp"`` (or fsdp, megatron_tp, tp_dp) returns
    that hand-written configuration, costed and lowerable like any plan.
    Embedding tables read by one lookup are planned as sparse parameters (dense all-reduce,
    all-gather of touched rows, or row-wise sharding): their access density comes from the
    example inputs' values, or from ``sparsity={"emb.weight": 0.01}`` (fraction of rows one
    device touches per step), else uniform random access is assumed.
    ``symbolic=True`` also traces the model at 2–4× the batch and stores the step time as a
    formula of the batch size, so ``plan.predict(batch_size=…)`` re-costs the plan without
    the model (one mesh only; not for pipeline or replica plans).
    """
    from autopar.passes.capture import capture
    from autopar.passes.experts import annotate_experts
    from autopar.passes.sparse import annotate_lookups

    target = Cluster.from_spec(cluster, memory_limit_bytes=memory_limit)
    start = time.perf_counter()
    captured = capture(model, example_inputs)
    annotate_lookups(captured, example_inputs, sparsity)
    annotate_experts(captured, example_inputs)
    capture_s = time.perf_counter() - start
    result = _choose(model, example_inputs, target, captured, pipeline=pipeline, micro_batches=micro_batches,
                     schedule=schedule, replicas=replicas, batch_split=batch_split, sparsity=sparsity,
                     optimizer=optimizer, solver=solver, time_limit_s=time_limit_s,
                     mesh_shape=mesh_shape, cluster_layers=cluster_layers, configuration=configuration)
    result.timings["capture_s"] = capture_s
    if symbolic:
        result = _with_symbolic_costs(result, captured, target, model, example_inputs)
    return result


def _with_symbolic_costs(result: Plan, captured, target: Cluster, model: nn.Module, example_inputs) -> Plan:
    from autopar.costing import symbolic_costs

    if result.stages or result.replicas:
        raise AutoparError(ErrorKind.BAD_INPUT, "symbolic costs are made for plans over one mesh; this plan uses "
                           f"{'pipeline stages' if result.stages else 'replicas'} — plan with pipeline=False, "
                           "replicas=False, or re-plan each batch size")
    start = time.perf_counter()
    timings = result.timings
    result = dataclasses.replace(result, symbolic=symbolic_costs(captured, result, target, model, example_inputs))
    object.__setattr__(result, "timings", {**timings, "symbolic_s": time.perf_counter() - start})
    return result


def _choose(model: nn.Module, example_inputs, target: Cluster, captured, *, pipeline: bool | None = None,
            micro_batches: int | None = None, schedule: str = "1F1B", replicas: bool | None = None,
            batch_split: tuple[int, ...] | None = None, sparsity: dict[str, float] | None = None,
            **options) -> Plan:
    """The fastest of one mesh over every device, pipeline stages over the device groups, and
    data-parallel replicas on the groups (see :func:`plan` for the flags)."""
    from autopar.pipeline_planner import pipeline_ready, plan_pipeline
    from autopar.planner import make_plan
    from autopar.replica_planner import plan_replicas

    reason = pipeline_ready(target)
    for flag, value in (("pipeline", pipeline), ("replicas", replicas)):
        if value and reason:
            raise AutoparError(ErrorKind.BAD_INPUT, f"{flag}=True, but {target.describe()} cannot host it: {reason}")
    if pipeline and replicas:
        raise AutoparError(ErrorKind.BAD_INPUT, "pipeline=True and replicas=True exclude each other; force one")
    if reason or options.get("mesh_shape") or options.get("configuration") or (pipeline is False and replicas is False):
        return make_plan(captured, target, **options)
    group_options = {k: options[k] for k in ("optimizer", "solver", "time_limit_s") if k in options}
    makers = {
        "uniform_mesh": (None if pipeline or replicas else lambda: make_plan(captured, target, **options)),
        "pipeline": (None if pipeline is False or replicas else lambda: plan_pipeline(
            model, example_inputs, target, micro_batches=micro_batches, schedule=schedule, sparsity=sparsity,
            **group_options)),
        "replicas": (None if replicas is False or pipeline else lambda: plan_replicas(
            model, example_inputs, target, batch_split=batch_split, sparsity=sparsity, **group_options)),
    }
    found: dict[str, Plan] = {}
    skipped: dict[str, str] = {}
    error = None
    for name, make in makers.items():
        if make is None:
            continue
        try:
            found[name] = make()
        except AutoparError as exc:
            alone = len([m for m in makers.values() if m]) == 1
            if alone or (name == "uniform_mesh" and exc.kind is not ErrorKind.INFEASIBLE_MEMORY):
                raise
            if exc.kind is ErrorKind.INFEASIBLE_MEMORY:
                error = error or exc
            else:  # not applicable to this model (batch, layers, tied weights …): say why, go on
                skipped[name] = exc.message
                log.info("%s plans skipped: %s", name, exc.message)
    if not found:
        raise error
    entry = {name: {"predicted_step_s": p.predicted_step_s, "feasible": True} for name, p in found.items()}
    for name, make in makers.items():  # tried: did not fit in memory, or not applicable
        if make is not None:
            entry.setdefault(name, {"predicted_step_s": None, "feasible": False,
                                    **({"skipped": skipped[name]} if name in skipped else {})})
    base = found["uniform_mesh"].baselines if "uniform_mesh" in found else {}
    best = min(found.values(), key=lambda p: p.predicted_step_s)
    return dataclasses.replace(best, baselines={**base, **entry})


def apply(model: nn.Module, plan: Plan, *, loss_fn: Callable | None = None) -> ParallelModule:
    """Lower ``plan`` onto ``model`` inside an initialised process group of the plan's size.

    Every rank calls the returned module with the same full inputs and gets full outputs;
    ``pmodel.step(*inputs, target=t)`` trains with ``loss_fn(output, target)``.
    """
    if not isinstance(plan, Plan):
        raise AutoparError(ErrorKind.BAD_INPUT, f"apply() needs an autopar.Plan, got {type(plan).__name__}; "
                           "load one with autopar.load_plan(path)")
    _check_world(plan)
    return _lower(None if plan.replicas else _capture_for(model, plan), plan, model, loss_fn)


def _capture_for(model: nn.Module, plan: Plan):
    """Capture ``model`` on zeros shaped like the plan's inputs (one micro-batch for a pipeline)."""
    from autopar.passes.capture import capture

    from autopar.passes.materialize import on_meta

    device = torch.device("meta") if on_meta(model) else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    inputs = tuple(torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device) for spec in plan.inputs)
    return capture(model, inputs)


def parallelize(model: nn.Module, example_inputs, cluster: "str | Cluster | None" = None, *,
                loss_fn: Callable | None = None, **options) -> ParallelModule:
    """Plan and apply in one call, inside a process group.

    ``cluster=None`` plans for the current world: one ``cpu`` device per rank. Rank 0 plans
    and broadcasts the plan, so every rank runs the same one. Options are :func:`plan`'s.
    """
    from autopar.passes.capture import capture
    from autopar.passes.experts import annotate_experts
    from autopar.passes.sparse import annotate_lookups

    if not dist.is_available() or not dist.is_initialized():
        raise AutoparError(ErrorKind.WORLD_MISMATCH,
                           "parallelize() runs inside a process group (torchrun, or dist.init_process_group); "
                           "to plan without one use autopar.plan(...)")
    target = Cluster.from_spec(cluster or f"{dist.get_world_size()}xcpu", options.pop("memory_limit", None))
    captured = capture(model, example_inputs)
    sparsity = options.pop("sparsity", None)
    annotate_lookups(captured, example_inputs, sparsity)
    annotate_experts(captured, example_inputs)
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = _choose(model, example_inputs, target, captured, sparsity=sparsity, **options).to_json()
        except AutoparError as exc:  # every rank must learn about it, not only rank 0
            payload[0] = exc
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], AutoparError):
        raise payload[0]
    chosen = Plan.from_json(payload[0])
    if chosen.replicas:
        return _lower(None, chosen, model, loss_fn)
    return _lower(_capture_for(model, chosen) if chosen.stages else captured, chosen, model, loss_fn)


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


def _lower(captured, plan: Plan, model: nn.Module, loss_fn: Callable | None) -> ParallelModule:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.passes.lower import lower

    _check_world(plan)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if plan.stages:
        from autopar.passes.pipeline_lower import lower_pipeline

        module, runtime = lower_pipeline(captured, plan, model, loss_fn, device_type)
        return ParallelModule(module, plan, loss_fn, runtime)
    if plan.replicas:
        from autopar.passes.replica_lower import lower_replicas

        module, runtime = lower_replicas(model, plan, loss_fn, device_type)
        return ParallelModule(module, plan, loss_fn, runtime)
    mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    return ParallelModule(lower(captured, plan, mesh, model), plan, loss_fn)
