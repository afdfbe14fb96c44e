"""Symbolic costs (issue 3): a plan's step time as a formula of the batch size equals the
cost of the same placements on a fresh trace at that batch size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import autopar
import models
from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.passes.capture import capture
from autopar.passes.sparse import annotate_lookups
from autopar.planning.costing import recost

HERE = os.path.dirname(__file__)
CASES = [
    ("GPT", lambda b: (torch.randint(0, 64, (b, 16)),), {"layers": 2}, "4xH100", (2, 2)),
    ("ConvNet", lambda b: (torch.randn(b, 3, 16, 16),), {}, "2x8xH100", None),
]


@pytest.mark.parametrize("name,make_inputs,kwargs,cluster,mesh", CASES, ids=[c[0] for c in CASES])
def test_formula_equals_a_fresh_trace_at_three_batch_sizes(name, make_inputs, kwargs, cluster, mesh):
    torch.manual_seed(0)
    model = getattr(models, name)(**kwargs)
    plan = autopar.plan(model, make_inputs(8), cluster=cluster, mesh_shape=mesh, pipeline=False, replicas=False,
                        symbolic=True)
    assert plan.symbolic["traced_batch"] == 8 and plan.predict() == plan.predicted_step_s
    assert plan.predict(8) == pytest.approx(plan.predicted_step_s, rel=1e-12)
    for batch in (16, 24, 64):
        inputs = make_inputs(batch)
        fresh = capture(model, inputs)
        annotate_lookups(fresh, inputs)
        expected, _ = recost(fresh, plan, Cluster.from_spec(cluster))
        assert plan.predict(batch) == pytest.approx(expected, rel=1e-12, abs=0), batch
    loaded = autopar.Plan.from_json(plan.to_json())
    assert loaded.predict(64) == plan.predict(64)
    # each op's formula, as `autopar explain` shows it
    matmuls = [f for n, f in plan.symbolic["nodes"].items() if "mm" in plan.nodes[n].op or "conv" in plan.nodes[n].op]
    assert matmuls and all("batch" in f["flops"] for f in matmuls)


def test_predict_refuses_what_it_cannot_answer():
    model = models.MLP()
    plain = autopar.plan(model, (torch.randn(8, 16),), cluster="4xH100", pipeline=False, replicas=False)
    with pytest.raises(AutoparError, match="made without symbolic costs") as info:
        plain.predict(16)
    assert info.value.kind is ErrorKind.BAD_INPUT
    assert plain.predict() == plain.predicted_step_s
    plan = autopar.plan(model, (torch.randn(8, 16),), cluster="4xH100", pipeline=False, replicas=False,
                        configuration="ddp", symbolic=True)
    with pytest.raises(AutoparError, match=r"batch 6 does not split over the 4 devices .* multiple of 4"):
        plan.predict(6)
    with pytest.raises(AutoparError, match="positive integer"):
        plan.predict(0)


class BatchDependent(nn.Module):
    """Its graph changes with the batch size: no formula can describe it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu() if x.shape[0] > 8 else self.fc(x)


def test_a_model_whose_graph_depends_on_the_batch_is_refused_by_name():
    with pytest.raises(AutoparError, match="graph traced at batch 16 differs from the one at batch 8"):
        autopar.plan(BatchDependent(), (torch.randn(8, 4),), cluster="2xH100", pipeline=False, replicas=False,
                     symbolic=True)


def test_cli_batch_size_sweep(tmp_path):
    exe = shutil.which("autopar")
    cmd = [exe] if exe else [sys.executable, "-m", "autopar.cli"]
    done = subprocess.run(cmd + ["plan", "models:tiny_gpt", "--cluster", "4xH100", "--pipeline", "off",
                                 "--replicas", "off", "--batch-size", "8,16,32", "--json",
                                 "-o", str(tmp_path / "plan.json")], capture_output=True, text=True, cwd=HERE,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    sweep = json.loads(done.stdout)["batch_sweep"]
    assert [row["batch_size"] for row in sweep] == [8, 16, 32]
    plan = autopar.load_plan(tmp_path / "plan.json")
    assert [row["predicted_step_s"] for row in sweep] == [plan.predict(b) for b in (8, 16, 32)]
    assert sweep[0]["predicted_step_s"] < sweep[1]["predicted_step_s"] < sweep[2]["predicted_step_s"]
    bad = subprocess.run(cmd + ["plan", "models:tiny_gpt", "--cluster", "4xH100", "--batch-size", "8,x"],
                         capture_output=True, text=True, cwd=HERE, timeout=600)
    assert bad.returncode == 2 and "comma-separated list of batch sizes" in bad.stderr
