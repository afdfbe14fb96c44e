"""Examples run as documented: a planning example, and training under torchrun where the loss falls."""

from __future__ import annotations

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


@pytest.mark.distributed
def test_train_gpt_under_torchrun_loss_falls():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "examples/train_gpt.py", "--steps", "60"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) >= 3, done.stdout
    assert losses[-1] < 0.5 * losses[0], losses
