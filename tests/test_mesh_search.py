"""Branch and bound over candidate meshes returns the best of solving every mesh."""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar.planning import one_mesh
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


def test_baselines_are_each_one_s_best_over_the_meshes(monkeypatch):
    """A baseline is not costed on a mesh whose bound it already beats (here TP × DP on the
    8×2 mesh, after 4×4): its entry is still the best of costing it on every mesh alone."""
    model, x, cluster = MLP(1024, 4096, 1024, layers=2), torch.randn(4096, 1024), "4x4xH100"
    costed = []
    original = one_mesh.cost_baselines

    def recording(captured, problem, index, engine, rules):
        costed.append(sorted(rules))
        return original(captured, problem, index, engine, rules)

    monkeypatch.setattr(one_mesh, "cost_baselines", recording)
    plan = autopar.plan(model, (x,), cluster=cluster)
    assert [] in costed  # a 2-D mesh costed no baseline
    best: dict[str, float] = {}
    for candidate in plan.mesh_candidates:
        alone = autopar.plan(model, (x,), cluster=cluster, mesh_shape=tuple(candidate["mesh_shape"]))
        for name, entry in alone.baselines.items():
            if entry["feasible"]:
                best[name] = min(best.get(name, math.inf), entry["predicted_step_s"])
    assert best
    for name, entry in plan.baselines.items():
        assert (entry["predicted_step_s"] if entry["feasible"] else None) == \
            (pytest.approx(best[name], rel=1e-9) if name in best else None), name


def test_a_mesh_that_cannot_fit_gets_no_edges_and_the_plan_is_the_same(monkeypatch):
    """On 2×3 devices the 1-D mesh of 6 splits none of this MLP's dims (256, 1024, a batch of
    64): with every node at its least memory it needs 42 MiB, the 2-D mesh 21 MiB. Under a
    30 MiB limit the 1-D mesh's problem is built without edges; the plan, its candidates and
    its baselines are those of building every edge."""
    model, x = MLP(256, 1024, 256, layers=3), torch.randn(64, 256)
    built = []
    original = one_mesh.build_problem

    def recording(*args, **kwargs):
        problem, index = original(*args, **kwargs)
        built.append((tuple(args[1].shape), problem.min_memory() > problem.memory_limit_bytes, len(problem.edges)))
        return problem, index

    monkeypatch.setattr(one_mesh, "build_problem", recording)
    plan = autopar.plan(model, (x,), cluster="2x3xA100-80GB", memory_limit=30 * 2 ** 20)
    assert built == [((6,), True, 0), ((2, 3), False, built[1][2])] and built[1][2] > 0
    monkeypatch.setattr(one_mesh, "build_problem", lambda *a, **k: original(*a, **{**k, "edges_without_fit": True}))
    every_edge = autopar.plan(model, (x,), cluster="2x3xA100-80GB", memory_limit=30 * 2 ** 20)
    assert plan.to_json() == every_edge.to_json()
    assert plan.mesh_candidates[0] == {"mesh_shape": [6], "status": "PRUNED", "predicted_step_s": None, "bound_s": None}
