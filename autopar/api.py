"""Public API: ``plan``, ``replan``, ``apply``, ``parallelize``. Thin orchestration, keyword-only options.

>>> plan = autopar.plan(model, (x,), cluster="4xA100-80GB")        # doctest: +SKIP
>>> pmodel = autopar.apply(model, plan)   # in a process group of 4  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
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
         time_limit_s: float = 60.0, mesh_shape: tuple[int, ...] | None = None, mesh_dims: int = 2,
         cluster_layers: bool = True, pipeline: bool | None = None, micro_batches: int | None = None,
         schedule: str = "auto", replicas: bool | None = None, batch_split: tuple[int, ...] | None = None,
         configuration: str | None = None, sparsity: dict[str, float] | None = None,
         symbolic: bool = False, mixed_precision=None, recompute: str = "auto", overlap: bool = True,
         bucket_cap_mb: float = 25.0, prefetch_layers: int = 1) -> Plan:
    """Plan ``model`` for ``cluster`` without any process group; returns a :class:`Plan`.

    ``memory_limit`` (bytes per device) overrides the device's memory; ``optimizer`` sets how
    much state each parameter carries (sgd 0, momentum 1, adam/adamw 2 copies).
    ``cluster_layers`` lets identical layers share decisions (smaller problem, same plan shape).
    On a cluster with several device groups (regions), the planner also tries pipeline stages
    over the groups and data-parallel replicas on the groups (the batch split by their speed),
    and keeps the fastest; ``pipeline=True`` or ``replicas=True`` forces one of them, ``False``
    rules it out. ``micro_batches`` pins the pipeline's micro-batch count, ``schedule`` its
    schedule ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble" — the interleaved ones
    with 2 or 4 chunks of layers per stage —, "ZBVZeroBubble": two chunks per stage in a V;
    "auto" tries 1F1B and interleaved zero bubble with 2, and keeps the faster),
    ``batch_split`` the
    replicas' rows per group. ``configuration="ddp"`` (or zero2, fsdp, megatron_tp, tp_dp,
    fsdp_tp, context_parallel) returns
    that hand-written configuration, costed and lowerable like any plan.
    Embedding tables read by one lookup are planned as sparse parameters (dense all-reduce,
    all-gather of touched rows, or row-wise sharding): their access density comes from the
    example inputs' values, or from ``sparsity={"emb.weight": 0.01}`` (fraction of rows one
    device touches per step), else uniform random access is assumed.
    ``symbolic=True`` also traces the model at 2–4× the batch and stores the step time as a
    formula of the batch size, so ``plan.predict(batch_size=…)`` re-costs the plan without
    the model (one mesh only; not for pipeline or replica plans).
    ``mixed_precision``: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (or ``"bf16"``,
    ``"fp16"``, ``"fp32"``) with FSDP2's meaning: compute, activations and weight gathers in
    ``param_dtype``, fp32 master weights, gradients and optimizer states.
    ``recompute``: activation checkpointing (``torch.utils.checkpoint``) — ``"none"``;
    ``"selective"`` (every layer's cheap ops rerun, matmul and attention outputs kept);
    ``"full"`` (every layer rerun whole); ``"full:N"`` (every N-th layer rerun whole, as
    torchtitan's layer-wise option N); ``"block:K"`` (the first K layers rerun whole, Megatron's
    block method); ``"auto"``: none when a plan keeping every activation fits, else the faster
    of the best selective plan and the best full plan cut to the first layers its placements
    need (``block:K``; docs/training.md).
    ``overlap``: cost each layer's parameter collectives (weight gathers prefetched, gradient
    reductions during backward) as hidden behind its compute, for the fraction the device
    reaches (its ``overlap_efficiency``: 0.9 for GPUs, 0 for the uncalibrated ``cpu``; ``autopar
    profile`` measures a host, per collective kind); ``False`` adds every collective to the
    step. ``bucket_cap_mb``: the lowered program all-reduces replicated parameters' gradients
    in buckets of this many MiB, each as soon as it fills during backward
    (DistributedDataParallel's default, 25); each bucket pays one all-reduce's latency.
    ``prefetch_layers``: how many layers ahead it gathers a sharded weight, in forward and
    again in backward (FSDP2's 1; 0: where the weight is read, and those gathers are costed as
    exposed).
    """
    from autopar.planning import ModelGraphs, PlanOptions, Precision, choose

    target = Cluster.from_spec(cluster, memory_limit_bytes=memory_limit)
    options = PlanOptions(optimizer=optimizer, solver=solver, time_limit_s=time_limit_s, mesh_shape=mesh_shape,
                          mesh_dims=mesh_dims,
                          cluster_layers=cluster_layers, pipeline=pipeline, micro_batches=micro_batches,
                          schedule=schedule, replicas=replicas, batch_split=batch_split, configuration=configuration,
                          sparsity=sparsity, symbolic=symbolic, mixed_precision=Precision.of(mixed_precision), recompute=recompute,
                          overlap=overlap, bucket_cap_mb=bucket_cap_mb, prefetch_layers=prefetch_layers)
    return choose(ModelGraphs(model, example_inputs, options.sparsity, options.compute_dtype), target, options)


def replan(plan: Plan, cluster: "str | Cluster", model: nn.Module | None = None, example_inputs=None, *,
           memory_limit: float | None = None, time_limit_s: float = 60.0, solver: str = "cpsat",
           graphs: "str | os.PathLike | None" = None):
    """Re-plan for a changed ``cluster`` (a slower link, a lost host, another device kind),
    warm-started from ``plan`` and with ``plan``'s options; returns a
    :class:`autopar.planning.replan.Replan`: ``.plan`` (the new plan), ``.previous_step_s``
    (the old plan re-costed on the new cluster), ``.migration_bytes`` and ``.migration_s`` (the
    state the busiest device must receive to switch), ``.break_even_steps``, ``.switch`` and
    ``.reason``. Nothing switches by itself: the caller decides.

    A plan made in this process keeps the graphs it was planned from (``plan.graphs``): without
    ``model`` and ``example_inputs`` they are re-planned as they are — no new trace, and the
    placements each mesh shape allows are not enumerated again. A plan read from a file needs
    the model and its example inputs (captured anew), or ``graphs``: the file of the graphs
    saved beside it (:func:`save_graphs`; ``autopar plan -o plan.json`` writes
    ``plan.graphs.zip``), re-planned from without the model or a new trace."""
    from autopar.planning import ModelGraphs, PlanOptions
    from autopar.planning.replan import replan as make_replan

    if not isinstance(plan, Plan):
        raise AutoparError(ErrorKind.BAD_INPUT, f"replan() re-plans an autopar.Plan, got {type(plan).__name__}; "
                           "load one with autopar.load_plan(path)")
    if (model is None) != (example_inputs is None):
        raise AutoparError(ErrorKind.BAD_INPUT, "replan() takes the model together with its example inputs, or "
                           "neither (then the graphs the plan was made from in this process)")
    target = Cluster.from_spec(cluster, memory_limit_bytes=memory_limit)
    options = PlanOptions.of_plan(plan, solver=solver, time_limit_s=time_limit_s)
    if model is not None and graphs is not None:
        raise AutoparError(ErrorKind.BAD_INPUT, "replan() re-plans from the model or from saved graphs, not both: "
                           "drop one of model= and graphs=")
    if model is not None:
        source = ModelGraphs(model, example_inputs, options.sparsity, options.compute_dtype)
    elif graphs is not None:
        from autopar.planning.graph_file import load_graphs

        source = load_graphs(graphs)
    elif plan.graphs is not None:
        source = plan.graphs
    else:
        raise AutoparError(ErrorKind.BAD_INPUT, "this plan carries no graphs to re-plan from (it was read from a file "
                           "or made in another process): pass the model and its example inputs, "
                           "autopar.replan(plan, cluster, model, example_inputs), or the graphs saved beside the "
                           "plan, autopar.replan(plan, cluster, graphs='plan.graphs.zip')")
    return make_replan(source, plan, target, options)


def save_graphs(plan: Plan, path: "str | os.PathLike") -> str | None:
    """Save the graphs ``plan`` was made from (a plan made in this process) to ``path``, for
    :func:`replan` without the model (``graphs=path``): the captured programs in torch.export's
    format with stand-in weights (shapes and dtypes only). Returns None when written, else why
    they cannot be saved (a model with expert layers; nothing is written then)."""
    from autopar.planning.graph_file import save_graphs as write

    if not isinstance(plan, Plan) or plan.graphs is None:
        raise AutoparError(ErrorKind.BAD_INPUT, "save_graphs() saves the graphs of a plan made in this process "
                           "(autopar.plan's result); a plan read from a file carries none")
    return write(plan.graphs, path)


def apply(model: nn.Module, plan: Plan, *, loss_fn: Callable | None = None) -> ParallelModule:
    """Lower ``plan`` onto ``model`` inside an initialised process group of the plan's size.

    Every rank calls the returned module with the same full inputs and gets full outputs;
    ``pmodel.step(*inputs, target=t)`` trains with ``loss_fn(output, target)``.
    """
    if not isinstance(plan, Plan):
        raise AutoparError(ErrorKind.BAD_INPUT, f"apply() needs an autopar.Plan, got {type(plan).__name__}; "
                           "load one with autopar.load_plan(path)")
    from autopar.planning import lower_plan

    _check_world(plan)
    return lower_plan(plan, model, loss_fn)


def reshard(pmodel: ParallelModule, plan: Plan, *, model: nn.Module | None = None,
            optimizer: torch.optim.Optimizer | None = None):
    """Switch a running ``pmodel`` to ``plan`` (another one-mesh plan of the same model and
    world, e.g. :func:`replan`'s answer) without a checkpoint: parameters, buffers and the
    ``optimizer``'s state move to the new placements (``DTensor.redistribute``), and the new
    ``ParallelModule`` is returned — with ``optimizer``, ``(pmodel, optimizer)``, the optimizer
    rebuilt over the new parameters. Call it between steps; every rank alike.
    ``model``: the module to lower ``plan`` on (a meta one will do; by default a copy of the
    one ``pmodel`` was lowered from). See :mod:`autopar.planning.move_state`."""
    from autopar.planning.move_state import reshard as move

    _check_world(plan)
    return move(pmodel, plan, model, optimizer)


def watch_links(pmodel: ParallelModule, cluster: "str | Cluster", model: nn.Module, example_inputs,
                on_change: Callable, *, every: int = 100, threshold: float = 0.5, patience: int = 3,
                probe_bytes: int = 4 << 20):
    """Watch the links ``pmodel``'s plan crosses while it trains — between its device groups
    (pipeline stages, replicas), or between the regions or hosts its mesh spans; every rank
    calls this alike: every ``every`` steps ``pmodel.step`` times each link with a
    ``probe_bytes`` ping-pong (two replica groups: the step's own gradient all-reduce between
    them); when a link's measured bandwidth stays off
    ``cluster``'s figure by more than ``threshold`` (0.5: 1.5× slower or faster) for
    ``patience`` checks in a row, rank 0 re-plans ``model`` (:func:`replan`) for ``cluster``
    with that link measured, and every rank's ``on_change(new_cluster, answer)`` gets the
    answer (``answer.switch``, ``answer.reason``, ``answer.plan``). Nothing switches by
    itself. Returns the :class:`autopar.planning.watch.LinkWatcher` (its ``readings``: every
    check's measurements)."""
    from autopar.planning.watch import LinkWatcher

    if not isinstance(pmodel, ParallelModule):
        raise AutoparError(ErrorKind.BAD_INPUT, f"watch_links() watches a ParallelModule (what autopar.apply or "
                           f"autopar.parallelize returns), got {type(pmodel).__name__}")
    if not callable(on_change):
        raise AutoparError(ErrorKind.BAD_INPUT, "watch_links() needs on_change: a function (cluster, answer) called "
                           "when a link drifts")
    target = Cluster.from_spec(cluster)
    pmodel.watcher = LinkWatcher(pmodel.plan, target, on_change,
                                 lambda plan, changed: replan(plan, changed, model, example_inputs),
                                 every=every, threshold=threshold, patience=patience, probe_bytes=probe_bytes,
                                 runtime=pmodel.runtime)
    return pmodel.watcher


def parallelize(model: nn.Module, example_inputs, cluster: "str | Cluster | None" = None, *,
                loss_fn: Callable | None = None, **options) -> ParallelModule:
    """Plan and apply in one call, inside a process group.

    ``cluster=None`` plans for the current world (autopar.planning.world): one ``cpu`` device
    per rank, or on GPUs (NCCL, or the model's weights on CUDA) the catalog's entry for the GPU
    ``torch.cuda.get_device_name`` reports, ``LOCAL_WORLD_SIZE`` ranks per host. Inputs and
    targets given on another device (a CPU batch) are moved to the rank's device. Rank 0 plans
    and broadcasts the plan, so every rank runs the same one. Options are :func:`plan`'s.
    """
    from autopar.planning import ModelGraphs, PlanOptions, Precision, choose, lower_plan
    from autopar.planning.world import world_cluster

    if not dist.is_available() or not dist.is_initialized():
        raise AutoparError(ErrorKind.WORLD_MISMATCH,
                           "parallelize() runs inside a process group (torchrun, or dist.init_process_group); "
                           "to plan without one use autopar.plan(...)")
    target = Cluster.from_spec(cluster or world_cluster(model), options.pop("memory_limit", None))
    options = PlanOptions(**{**options, "mixed_precision": Precision.of(options.get("mixed_precision"))})
    graphs = ModelGraphs(model, example_inputs, options.sparsity, options.compute_dtype)
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = choose(graphs, target, options).to_json()
        except AutoparError as exc:  # every rank must learn about it, not only rank 0
            payload[0] = exc
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], AutoparError):
        raise payload[0]
    chosen = Plan.from_json(payload[0])
    _check_world(chosen)
    return lower_plan(chosen, model, loss_fn, graphs.full)


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
