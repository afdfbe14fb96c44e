"""Activation checkpointing chosen per device group (issue 19): pipeline stages recompute
what their own memory requires (the first stage of 1F1B, holding the most micro-batches in
flight, before the last), replica groups rerun only the first layers their largest replica
needs (block:K), and such plans train like the single-process model."""

from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar import AutoparError
from autopar.errors import ErrorKind
from distributed import run_world
from pipeline_equivalence import check_pipelines

CLUSTERS = os.path.join(os.path.dirname(__file__), "clusters")


def _between_keeping_and_recomputing(model, x, cluster: str) -> tuple:
    """The plans of a 2-stage pipeline (2 micro-batches) keeping every activation and
    recomputing every layer, and a memory limit half-way between what they hold."""
    kept = autopar.plan(model, (x,), cluster=cluster, pipeline=True, micro_batches=2)
    full = autopar.plan(model, (x,), cluster=cluster, pipeline=True, micro_batches=2, recompute="full")
    return kept, full, (full.memory.total_bytes + kept.memory.total_bytes) // 2


@pytest.mark.distributed
def test_groups_recompute_their_layers_and_train_like_one_process():
    """recompute="full" inside pipeline stages and inside data-parallel replica groups, and
    "auto" under limits only the first stage (two micro-batches in flight) needs to recompute
    for, and only the first replica layers: the layers run under torch.utils.checkpoint where
    the plan says, and training still equals the single-process model."""
    import models

    cluster = os.path.join(CLUSTERS, "two_cpu_regions.yaml")
    torch.manual_seed(0)
    model, x = models.GPT(vocab=64, layers=4), torch.randint(0, 64, (8, 16))
    *_, limit = _between_keeping_and_recomputing(model, x, cluster)
    split = {"replicas": True, "batch_split": (6, 2)}
    roomy, lean = (autopar.plan(model, (x,), cluster=cluster, recompute=mode, **split) for mode in ("none", "full"))
    replica_limit = (roomy.memory.total_bytes + lean.memory.total_bytes) // 2
    stages, replicas, first_only, first_layers = run_world(2, check_pipelines, [
        (cluster, None, 3, 4, 8, "1F1B", {"pipeline": True, "micro_batches": 2, "recompute": "full"}),
        (cluster, None, 3, 4, 8, "1F1B", {**split, "recompute": "selective"}),
        (cluster, None, 3, 4, 8, "1F1B", {"pipeline": True, "micro_batches": 2, "memory_limit": limit}),
        (cluster, None, 3, 4, 8, "1F1B", {**split, "memory_limit": replica_limit})])
    assert len(stages["stages"]) == 2 and replicas["batch_split"] == [6, 2]
    first, last = first_only["stages"]
    assert first_only["recompute"] and set(first_only["recompute"]) <= set(first), first_only
    cut = len(first_layers["recompute"])  # replicas: the first K layers (block:K)
    assert 1 <= cut < 4, first_layers
    for result, recomputed in ((stages, dict.fromkeys(map("blocks.{}".format, range(4)), "full")),
                               (replicas, dict.fromkeys(map("blocks.{}".format, range(4)), "selective")),
                               (first_only, first_only["recompute"]),
                               (first_layers, dict.fromkeys(map("blocks.{}".format, range(cut)), "full"))):
        assert result["checkpointed"] and result["all_params_covered"], result
        assert result["recompute"] == recomputed, result["recompute"]
        assert result["loss"] < 2e-6 and result["grad"] < 1e-6 and result["param"] < 1e-6, result
        assert result["output"] < 2e-6, result


def test_a_pipeline_that_does_not_fit_recomputes_its_layers():
    """recompute="auto" on pipeline stages, as on one mesh but stage by stage: every activation
    kept when a cut fits; under a memory limit only recomputation meets, each stage recomputes
    only what its own memory requires — here the first (two micro-batches in flight under 1F1B)
    reruns some of its layers, the last keeps everything — no slower than every stage rerunning
    its layers (selective or full, whichever fit), and a re-plan costs it as planned."""
    import models
    from autopar.planning.pipeline import stage_modes
    from autopar.report import recompute_label

    torch.manual_seed(0)
    model, x = models.GPT(vocab=64, layers=4), torch.randint(0, 64, (8, 16))
    cluster = os.path.join(CLUSTERS, "two_cpu_regions.yaml")
    kept, full, limit = _between_keeping_and_recomputing(model, x, cluster)
    assert not kept.recompute and set(full.recompute.values()) == {"full"}
    assert full.memory.total_bytes < kept.memory.total_bytes
    auto = autopar.plan(model, (x,), cluster=cluster, pipeline=True, micro_batches=2, memory_limit=limit)
    assert auto.family == "pipeline" and auto.recompute and auto.memory.total_bytes <= limit
    assert auto.recompute_cost["rerun_s"] > 0 and auto.predicted_step_s > kept.predicted_step_s
    first, last = stage_modes(auto)
    assert first != "none" and last == "none", stage_modes(auto)
    assert recompute_label(auto).startswith(f"per stage: {first} / none"), recompute_label(auto)
    steps = []
    for mode in ("selective", "full"):
        try:
            steps.append(autopar.plan(model, (x,), cluster=cluster, pipeline=True, micro_batches=2,
                                      memory_limit=limit, recompute=mode).predicted_step_s)
        except AutoparError as exc:
            assert exc.kind is ErrorKind.INFEASIBLE_MEMORY
    assert steps and auto.predicted_step_s < min(steps), (auto.predicted_step_s, steps)
    again = autopar.replan(auto, cluster, memory_limit=limit)  # its stages costed each in its own mode
    assert again.previous_step_s == pytest.approx(auto.predicted_step_s, rel=1e-9), again
    assert again.plan.predicted_step_s == pytest.approx(auto.predicted_step_s, rel=1e-6), again


def test_replicas_that_do_not_fit_recompute_only_the_first_layers_they_need():
    """Replica groups share one plan, so "auto" takes one mode for all of them; whole layers
    are cut to the first K the largest replica's placements need (block:K), K the fewest that
    fit: at a limit half-way between keeping and rerunning all 8 layers, fewer than 8 layers
    rerun, faster than rerunning all of them (selective does not fit there), within the limit —
    and one layer fewer does not fit."""
    import models
    from autopar.passes.layer_recompute import recompute_mode

    torch.manual_seed(0)
    model, x = models.GPT(vocab=64, layers=8), torch.randint(0, 64, (8, 16))
    options = {"cluster": os.path.join(CLUSTERS, "two_cpu_regions.yaml"), "replicas": True, "batch_split": (6, 2)}
    kept = autopar.plan(model, (x,), **options)
    full = autopar.plan(model, (x,), recompute="full", **options)
    limit = (kept.memory.total_bytes + full.memory.total_bytes) // 2
    auto = autopar.plan(model, (x,), memory_limit=limit, **options)
    layers = [f"blocks.{k}" for k in range(8)]
    cut = len(auto.recompute)
    assert auto.family == "replicas" and 1 <= cut < 8, auto.recompute
    assert recompute_mode(layers, auto.recompute) == f"block:{cut}", auto.recompute
    assert auto.memory.total_bytes <= limit
    rerun_all = autopar.plan(model, (x,), memory_limit=limit, recompute="full", **options)
    assert auto.predicted_step_s < rerun_all.predicted_step_s, (auto.predicted_step_s, rerun_all.predicted_step_s)
    if cut > 1:
        with pytest.raises(AutoparError) as fewer:
            autopar.plan(model, (x,), memory_limit=limit, recompute=f"block:{cut - 1}", **options)
        assert fewer.value.kind is ErrorKind.INFEASIBLE_MEMORY
