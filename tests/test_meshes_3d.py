"""3-D meshes: the outer dim splits the batch only (strategies pruned there), and the one-mesh
search (with ``mesh_dims=3``) refines its best 2-D mesh into DP × (FSDP × TP) shapes over
whole host groups."""

from __future__ import annotations

import pytest
import torch

import autopar
import models
from autopar.cluster import Cluster
from autopar.mesh import three_dim_refinements
from autopar.passes.capture import capture
from autopar.passes.strategies import STRATEGIES_KEY, batch_only_dims, enumerate_strategies
from autopar.placements import R, Shard
from autopar.report import mesh_dim_roles


def _gpt():
    torch.manual_seed(0)
    return models.GPT(vocab=256, d=64, layers=2, heads=4, max_len=32), torch.randint(0, 256, (16, 32))


def test_the_outer_dim_of_a_3d_mesh_only_splits_the_batch():
    model, tokens = _gpt()
    captured = capture(model, (tokens,))
    enumerate_strategies(captured.graph, (2, 2, 2))
    counts = {}
    for node in captured.graph.nodes:
        for strategy in node.meta.get(STRATEGIES_KEY, ()):
            for spec in (*strategy.outputs, *strategy.inputs):
                if spec is not None:
                    assert spec[0] in (R, Shard(0)), (node.name, spec)
        counts[node.name] = len(node.meta.get(STRATEGIES_KEY, ()))
    enumerate_strategies(captured.graph, (2, 2))
    # the pruned outer dim at most doubles a 2-D mesh's strategies (replicated or batch split)
    assert all(counts[n.name] <= 2 * len(n.meta[STRATEGIES_KEY]) for n in captured.graph.nodes
               if STRATEGIES_KEY in n.meta)
    assert batch_only_dims((2, 2)) == () and batch_only_dims((2, 2, 2)) == (0,)


def test_refinements_split_the_outer_dim_over_whole_host_groups():
    cluster = Cluster.from_spec("8x8xH100")
    assert [m.shape for m in three_dim_refinements(cluster, (16, 4))] == [(2, 8, 4), (4, 4, 4), (8, 2, 4)]
    assert three_dim_refinements(cluster, (64,)) == [] and three_dim_refinements(Cluster.from_spec("2x4xH100"),
                                                                                (2, 4)) == []
    for mesh in three_dim_refinements(cluster, (8, 8)):  # each data-parallel group: whole hosts
        assert (mesh.shape[1] * mesh.shape[2]) % cluster.devices_per_host == 0


@pytest.mark.parametrize("cluster", ["4x2xH100", "2x4xH100"])
def test_the_search_tries_the_refinements_of_its_best_2d_mesh_and_keeps_the_best(cluster):
    model, tokens = _gpt()
    default = autopar.plan(model, (tokens,), cluster=cluster)
    assert all(len(c["mesh_shape"]) <= 2 for c in default.mesh_candidates)  # 3-D when asked: mesh_dims=3
    flat = autopar.plan(model, (tokens,), cluster=cluster, mesh_dims=1)
    assert [c["mesh_shape"] for c in flat.mesh_candidates] == [[8]]
    plan = autopar.plan(model, (tokens,), cluster=cluster, mesh_dims=3)
    tried = {tuple(c["mesh_shape"]): c for c in plan.mesh_candidates}
    assert any(len(shape) == 3 for shape in tried), sorted(tried)
    solved = {shape: c["predicted_step_s"] for shape, c in tried.items() if c["predicted_step_s"] is not None}
    assert plan.predicted_step_s == pytest.approx(min(solved.values()))
    two_d = [shape for shape in solved if len(shape) == 2]
    best_2d = min(two_d, key=solved.get) if two_d else None
    if best_2d is not None:
        for mesh in three_dim_refinements(Cluster.from_spec(cluster), best_2d):
            assert mesh.shape in tried, (mesh.shape, sorted(tried))
    if len(plan.mesh_shape) == 3:
        assert mesh_dim_roles(plan)[0] in ("dp_replicate", "dp_shard", "replicate")


def test_a_given_3d_mesh_plans_with_the_outer_dim_as_data_parallel():
    model, tokens = _gpt()
    plan = autopar.plan(model, (tokens,), cluster="2x4xH100", mesh_shape=(2, 2, 2))
    assert plan.mesh_shape == (2, 2, 2)
    for node in plan.nodes.values():
        if node.op not in ("input", "parameter", "output"):
            for text in node.outputs:
                assert text is None or text.split(",")[0] in ("R", "S(0)"), (node.op, text)
    assert mesh_dim_roles(plan)[0] in ("dp_replicate", "dp_shard", "replicate")


@pytest.mark.distributed
def test_a_3d_mesh_plan_trains_like_one_process_on_eight_ranks():
    """GPT on a (2, 2, 2) mesh over 8 gloo processes, memory squeezed to force sharding, in
    float64 (so the comparison sees the plan, not fp32 rounding): outputs, loss, every
    gradient and the parameters after 3 AdamW steps equal the single-process model's.

    One layer: the two-layer model's squeezed plan splits the batch over mesh dims 0 and 2,
    and DTensor's first backward then costs about 85 s of CPU per rank (its sharding
    propagation searches redistributions of ``_StridedShard`` views; docs/training.md, "The
    first step on a 3-D mesh"): 6 minutes of CI on 8 processes, spent inside torch."""
    from distributed import run_world
    from equivalence import run_cases

    case = ("GPT", {"layers": 1}, "tokens", 8, {"cluster": "8xH100", "memory_fraction": 0.3,
                                                 "mesh_shape": (2, 2, 2)}, "float64")
    (errors,) = run_world(8, run_cases, [case])
    assert max(errors[k] for k in ("output", "loss", "grad", "param", "param_flat")) < 1e-10, errors
    # weights split along each of the three mesh dims (by different parameters): a 3-D plan
    split_dims = {dim for p in errors["placements"] for dim, placement in enumerate(p.strip("()").split(", "))
                  if placement.startswith("Shard")}
    assert split_dims == {0, 1, 2}, errors["placements"]


def test_the_cli_pins_a_3d_mesh_and_refuses_malformed_ones(capsys):
    import json

    from autopar import cli

    assert cli.main(["plan", "models:tiny_gpt", "--cluster", "2x4xH100", "--mesh-shape", "2,2,2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["mesh"]["default"] == [2, 2, 2] and len(shown["mesh_dim_roles"]) == 3
    for bad, said in (("2,x", "comma-separated list of mesh dims"), ("0,8", "1 to 3 dims"),
                      ("2,2,2,1", "1 to 3 dims"), ("3,3", "mesh_shape (3, 3) has 9 devices")):
        try:
            code = cli.main(["plan", "models:tiny_gpt", "--cluster", "2x4xH100", "--mesh-shape", bad])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        assert code in (1, 2), (bad, code)
        assert said in capsys.readouterr().err, bad
