"""Examples run as documented: a planning example, and training under torchrun where the loss falls."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpt_planning_example(tmp_path):
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "examples/gpt.py", "--cluster", "4xH100", "--layers", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "memory per device" in done.stdout and out.exists()


@pytest.mark.parametrize("script, args", [
    ("examples/cnn.py", ["--batch", "16", "--image", "64"]),
    ("examples/dlrm.py", ["--batch", "256"]),
])
def test_cnn_and_dlrm_planning_examples(tmp_path, script, args):
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, script, "--cluster", "8xH100", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "plan vs baselines" in done.stdout and "top 5 nodes by time" in done.stdout and out.exists()


def test_examples_plan_through_the_cli(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "autopar")  # the console script beside this python
    done = subprocess.run([exe, "plan", "examples.dlrm:build", "--cluster", "4xH100", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["baselines"]["ddp"]["feasible"]  # ids (tables, batch, bag) split on their batch dim
    assert summary["predicted_step_s"] <= summary["baselines"]["ddp"]["predicted_step_s"] * (1 + 1e-9)


@pytest.mark.distributed
@pytest.mark.parametrize("extra", [[], ["--cluster", "tests/clusters/two_cpu_regions.yaml"]], ids=["mesh", "pipeline"])
def test_train_gpt_under_torchrun_loss_falls(extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "examples/train_gpt.py", "--steps", "60", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) >= 3, done.stdout
    assert losses[-1] < 0.5 * losses[0], losses
