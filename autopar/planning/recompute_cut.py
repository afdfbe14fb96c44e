"""Which recomputation ``recompute="auto"`` takes. A plan keeps every activation where that
fits (:func:`recompute_where_needed`); when none fits, or the one that does fills most of
memory, the faster of selective and whole layers (:func:`faster_recomputing`), whole layers
recomputed only where memory requires them: the full plan cut to the first K layers its
placements need (``block:K``, Megatron-LM's block method) and solved again with K on its
mesh (:func:`fewest_layers`). One mesh applies it to the model's layers, each pipeline stage
to its own (so a first stage holding more micro-batches in flight may recompute while the
last keeps everything); replicas share one plan and take one mode, their full plan cut to
the K its largest replica needs (:func:`fastest_that_fits`, planning.replicas)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import checked_mesh
from autopar.plan import Plan
from autopar.planning.options import PlanOptions
from autopar.units import format_bytes

log = logging.getLogger(__name__)

# a plan keeping every activation that fills this share of the memory limit may have been
# shaped by it: recomputation is tried as well (recompute_where_needed)
MEMORY_BOUND = 0.85


def recompute_where_needed(searched: Callable[[PlanOptions], Any], cluster: Cluster, options: PlanOptions,
                           layers: Sequence[str]) -> Plan:
    """The best plan of ``searched(options)`` (a MeshSearch with those options, made once per
    options by the caller) keeping every activation. Under ``recompute="auto"`` with layers to
    recompute, when none fits: the faster of the best plan recomputing every layer's cheap ops
    (selective) and the best recomputing whole layers — the plan recomputing every layer (full),
    its placements then kept with only as many of the first layers recomputed as they need
    (:func:`fewest_layers`, ``block:K``). Both are searched: rerunning more forward work can
    still be the faster plan, where the memory it frees lets the placements move less (a small
    GPT on 2×H100 at a limit between full:2's least memory and selective's: full 56 µs, every
    other layer 162 µs). When the plan keeping everything fills most of memory
    (:data:`MEMORY_BOUND`), memory may have made it shard or move more than it would otherwise:
    the selective plan is made too, and the faster of the two wins. ``layers``: the graph's
    layers in the order it runs them (planning a pipeline stage: the stage's own)."""
    auto = options.recompute == "auto" and bool(layers)
    try:
        kept = searched(options).best()
    except AutoparError as exc:
        if exc.kind is not ErrorKind.INFEASIBLE_MEMORY or not auto:
            raise
        error = exc
    else:
        if not auto or kept.memory.total_bytes < MEMORY_BOUND * cluster.memory_limit_bytes:
            return kept
        log.info("the plan keeping every activation fills %s: trying selective recomputation too",
                 format_bytes(kept.memory.total_bytes))
        try:
            selective = searched(dataclasses.replace(options, recompute="selective")).best()
        except AutoparError as exc:
            if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
                raise
            return kept
        return selective if selective.predicted_step_s < kept.predicted_step_s else kept
    return faster_recomputing(options, lambda changed: searched(changed).best(), error,
                              cut=lambda full: fewest_layers(layers, cluster, options, full, searched))


def fastest_that_fits(options: PlanOptions, plan_with: Callable[[PlanOptions], Plan],
                      cut: Callable[[Plan], Plan] | None = None) -> Plan:
    """``plan_with(options)`` under the recompute mode ``options.recompute`` names; under "auto",
    keeping every activation when that fits, else the faster of selective and full
    (:func:`faster_recomputing`, ``cut`` applied to the full plan where given): one mode for a
    whole family's plan (the replicas family: every replica runs one shared plan)."""
    if options.recompute != "auto":
        return plan_with(options)
    try:
        return plan_with(dataclasses.replace(options, recompute="none"))
    except AutoparError as exc:
        if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
            raise
        kept = exc
    return faster_recomputing(options, plan_with, kept, cut)


def faster_recomputing(options: PlanOptions, plan_with: Callable[[PlanOptions], Plan], error: AutoparError,
                       cut: Callable[[Plan], Plan] | None = None) -> Plan:
    """The faster of ``plan_with`` recomputing every layer's cheap ops (selective) and whole
    layers (full, then ``cut`` where given), whichever fit — both are made: rerunning more can
    still be faster, where the memory it frees lets the placements move less. ``error``: why
    no plan keeping every activation fits, raised (or the last mode's) when neither does. A tie
    keeps selective."""
    found = []
    for mode in ("selective", "full"):
        log.info("no plan fits keeping every activation: trying recompute=%s", mode)
        try:
            best = plan_with(dataclasses.replace(options, recompute=mode))
        except AutoparError as exc:
            if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
                raise
            error = exc
            continue
        found.append(cut(best) if cut is not None and mode == "full" else best)
    if not found:
        raise error
    return min(found, key=lambda plan: plan.predicted_step_s)


def fewest_needed(layers: Sequence[str], cluster: Cluster, options: PlanOptions, plan: Plan,
                  searched: Callable[[PlanOptions], Any]) -> int | None:
    """The fewest first layers ``plan``'s placements (made with ``recompute="full"`` by
    ``searched``) need recomputed to fit ``cluster``'s memory — the memory of fixed placements
    falls with every layer recomputed, so a bisection finds it on the problem of ``plan``'s
    mesh built without edges — or None where no fewer than ``plan``'s layers do (or the
    problem does not offer its placements by name)."""
    recomputed = [layer for layer in layers if layer in plan.recompute]
    if len(recomputed) < 2:
        return None
    search = searched(dataclasses.replace(options, recompute="full"))
    mesh = checked_mesh(cluster, tuple(plan.mesh_shape))
    low, high = 1, len(recomputed)  # block:len(recomputed) is full itself: it fits
    try:
        while low < high:
            middle = (low + high) // 2
            if search.memory_of(plan, mesh, f"block:{middle}") <= cluster.memory_limit_bytes:
                high = middle
            else:
                low = middle + 1
    except AutoparError as exc:  # a placement the problem does not offer by name (none known): keep the plan
        if exc.kind is not ErrorKind.BAD_PLAN:
            raise
        log.info("recomputed layers not cut: %s", exc.message)
        return None
    return None if low == len(recomputed) else low


def fewest_layers(layers: Sequence[str], cluster: Cluster, options: PlanOptions, plan: Plan,
                  searched: Callable[[PlanOptions], Any]) -> Plan:
    """``plan`` (made with ``recompute="full"``) recomputing only the first K layers
    (``block:K``, Megatron's block method), K the fewest with which its placements fit
    (:func:`fewest_needed`), then re-solved on its mesh with K, warm-started from it
    (placements may loosen where memory allows; never slower: its own placements are a
    solution). ``plan`` itself when it already recomputes no more layers than it needs. The
    re-solve is on ``plan``'s mesh only: another mesh might do better with its own K (not
    searched: a search per K). ``searched(options)``:
    the search with those options (one mesh: planning.one_mesh.mesh_search; a pipeline stage:
    its own), made once per options. ``layers``: the graph's, in the order it runs them."""
    low = fewest_needed(layers, cluster, options, plan, searched)
    if low is None:
        return plan
    log.info("its placements fit with the first %d of %d layers recomputed: re-solving with block:%d",
             low, len(layers), low)
    cut = dataclasses.replace(options, recompute=f"block:{low}", mesh_shape=tuple(plan.mesh_shape),
                              warm_start=plan, baselines=False)
    try:
        refined = searched(cut).best()
    except AutoparError as exc:
        if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
            raise
        return plan
    if refined.predicted_step_s >= plan.predicted_step_s:
        return plan
    # the meshes, their bounds and the baselines are the full search's; so says the solver record
    return dataclasses.replace(refined, baselines=plan.baselines, mesh_candidates=plan.mesh_candidates,
                               solver={**refined.solver, "searched_recompute": "full"})
