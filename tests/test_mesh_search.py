"""Branch and bound over candidate meshes returns the best of solving every mesh."""

from __future__ import annotations

import pytest
import torch

import autopar
from models import GPT, MLP


@pytest.mark.parametrize("model, x, cluster", [
    (GPT(d=64, layers=2, heads=4), torch.randint(0, 64, (8, 16)), "2x4xH100"),
    (MLP(256, 1024, 256, layers=3), torch.randn(64, 256), "2x4xA100-80GB"),
])
def test_pruned_search_equals_exhaustive(model, x, cluster):
    plan = autopar.plan(model, (x,), cluster=cluster)
    per_mesh = {}
    for candidate in plan.mesh_candidates:
        shape = tuple(candidate["mesh_shape"])
        per_mesh[shape] = autopar.plan(model, (x,), cluster=cluster, mesh_shape=shape).predicted_step_s
    assert plan.predicted_step_s == pytest.approx(min(per_mesh.values()), rel=1e-9)
    for candidate in plan.mesh_candidates:
        if candidate["status"] == "PRUNED":  # its bound was no better than the winner
            assert candidate["bound_s"] >= plan.predicted_step_s * (1 - 1e-9)
            assert per_mesh[tuple(candidate["mesh_shape"])] >= plan.predicted_step_s * (1 - 1e-9)


def test_plan_reports_problem_sizes_and_timings():
    plan = autopar.plan(GPT(layers=4), (torch.randint(0, 64, (8, 16)),), cluster="4xH100")
    assert plan.solver["variables_unclustered"] > plan.solver["variables"] > 0
    assert plan.solver["distinct_edges"] < plan.solver["edges"]
    assert plan.solver["method"] in ("lp", "cp-sat")
    assert set(plan.timings) >= {"capture_s", "prepare_s", "solve_s", "solve_total_s", "plan_s"}
