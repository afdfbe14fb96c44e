"""The step's loss on outputs left split along the batch (plan.outputs, passes.split_loss).

A one-mesh plan need not gather its outputs for the loss: each device computes the loss of its
rows, as DDP does. That equals the whole batch's loss for a loss that averages over rows; one
that sums runs on the gathered outputs instead. Both give the single process's loss and
gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from distributed import run_world
from models import MLP


def _sum_of_squares(out, target):
    return (out - target).square().sum()


def _steps() -> dict:
    found = {}
    for name, loss_fn in (("mean", torch.nn.functional.mse_loss), ("sum", _sum_of_squares)):
        torch.manual_seed(0)
        model, x, target = MLP(64, 256, 8, layers=3), torch.randn(256, 64), torch.randn(256, 8)
        reference = copy.deepcopy(model)
        pmodel = autopar.parallelize(model, (x,), cluster="2xcpu", configuration="ddp", loss_fn=loss_fn)
        loss = pmodel.step(x, target=target)
        ref_loss = loss_fn(reference(x), target)
        ref_loss.backward()
        ref = dict(reference.named_parameters())
        found[name] = {
            "outputs": pmodel.plan.outputs,
            "averages": pmodel._averages,
            "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad": max((p.grad.full_tensor() - ref[n].grad).abs().max().item() / ref[n].grad.abs().max().item()
                        for n, p in pmodel.named_parameters()),
        }
    return found


@pytest.mark.distributed
def test_each_device_takes_the_loss_of_its_rows_when_the_loss_is_a_mean():
    found = run_world(2, _steps)
    mean, total = found["mean"], found["sum"]
    assert mean["outputs"] == total["outputs"] == ("S(0)",), found  # the outputs stay split
    assert mean["averages"] is True and total["averages"] is False, found
    for result in (mean, total):  # relative to the loss and to each parameter's largest gradient
        assert result["loss"] < 1e-6 and result["grad"] < 1e-5, found
