"""Which recomputation ``recompute="auto"`` takes when no plan keeping every activation fits:
the faster of selective and whole layers (:func:`faster_recomputing`, every family's rule),
and — the one-mesh family's — whole layers recomputed only where memory requires them: the
full plan cut to the first K layers its placements need (``block:K``, Megatron-LM's block
method) and solved again with K on its mesh (:func:`fewest_layers`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.mesh import checked_mesh
from autopar.plan import Plan
from autopar.planning.options import PlanOptions
from autopar.passes.stages import layer_order

log = logging.getLogger(__name__)


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


def fewest_layers(graphs, cluster: Cluster, options: PlanOptions, plan: Plan,
                  searched: Callable[[PlanOptions], Any]) -> Plan:
    """``plan`` (made with ``recompute="full"``) recomputing only the first K layers
    (``block:K``, Megatron's block method), K the fewest with which its placements fit — the
    memory of a fixed placement falls with every layer recomputed, so a bisection finds K —
    then re-solved on its mesh with K, warm-started from it (placements may loosen where memory
    allows; never slower: its own placements are a solution). ``plan`` itself when it already
    recomputes no more layers than it needs. The re-solve is on ``plan``'s mesh only: another
    mesh might do better with its own K (not searched: a search per K). ``searched(options)``:
    the family's search with those options (planning.one_mesh.mesh_search, made once)."""
    layers = layer_order(graphs.full.graph)
    recomputed = [layer for layer in layers if layer in plan.recompute]
    if len(recomputed) < 2:
        return plan
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
        return plan
    if low == len(recomputed):
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
