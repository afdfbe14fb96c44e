"""Repeated layers share decision variables without changing the optimum."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.passes.capture import capture
from autopar.passes.layers import find_repeated_layers
from models import GPT, MLP


def test_detects_identical_layers_only():
    captured = capture(MLP(16, 32, 8, layers=4), (torch.randn(8, 16),))
    same_as = find_repeated_layers(captured)
    mapped = {captured.parameter_of.get(n, n) for n in same_as}
    # layers.1..3 are 32→32 and identical; layers.0 (16→32) and layers.4 (32→8) are not
    assert "layers.2.weight" in mapped and "layers.3.bias" in mapped
    assert not any(name.startswith(("layers.0.", "layers.4.")) for name in mapped)
    assert all(captured.parameter_of.get(rep, rep).startswith("layers.1.")
               for name, rep in same_as.items() if name in captured.parameter_of)


@pytest.mark.parametrize("model, x, cluster, mesh", [
    (GPT(layers=3), torch.randint(0, 64, (8, 8)), "4xH100", (4,)),
    (MLP(64, 256, 64, layers=4), torch.randn(512, 64), "4xH100", (2, 2)),
])
def test_clustered_objective_equals_unclustered(model, x, cluster, mesh):
    clustered = autopar.plan(model, (x,), cluster=cluster, mesh_shape=mesh)
    flat = autopar.plan(model, (x,), cluster=cluster, mesh_shape=mesh, cluster_layers=False)
    assert clustered.solver["status"] == flat.solver["status"] == "OPTIMAL"
    assert clustered.solver["distinct_nodes"] < flat.solver["distinct_nodes"] == flat.solver["nodes"]
    assert clustered.solver["variables"] < flat.solver["variables"]
    assert clustered.predicted_step_s == pytest.approx(flat.predicted_step_s, rel=1e-9)
