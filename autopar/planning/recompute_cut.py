"""Recompute only the layers memory requires: a plan that reruns whole layers, cut to the
first K its placements need (``block:K``, Megatron-LM's block method) and solved again with
K on its mesh. The one-mesh family (planning.one_mesh) calls it on its best full-recompute
plan when no plan keeping every activation fits."""

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


def fewest_layers(graphs, cluster: Cluster, options: PlanOptions, mode: str, plan: Plan,
                  searched: Callable[[PlanOptions], Any]) -> Plan:
    """``plan`` (made with ``mode``, a whole-layer mode) recomputing only the first K layers
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
    search = searched(dataclasses.replace(options, recompute=mode))
    mesh = checked_mesh(cluster, tuple(plan.mesh_shape))
    low, high = 1, len(recomputed)  # block:len(recomputed) fits: full:N's layers less the rerun buffer
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
    if low == len(layers) or (low == len(recomputed) and mode != "full"):
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
    # the meshes, their bounds and the baselines are the search's (with ``mode``); so says the solver record
    return dataclasses.replace(refined, baselines=plan.baselines, mesh_candidates=plan.mesh_candidates,
                               solver={**refined.solver, "searched_recompute": mode})
