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
        found[name] = _one_step(pmodel, reference, loss_fn, x, target)
    return found


def _one_step(pmodel, reference, loss_fn, x, target) -> dict:
    """One training step of both: the outputs' placement, whether the loss was taken device
    by device, and the loss's and every gradient's error relative to their scale."""
    loss = pmodel.step(x, target=target)
    ref_loss = loss_fn(reference(x), target)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    return {
        "outputs": pmodel.plan.outputs,
        "averages": pmodel._averages,
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": max((p.grad.full_tensor() - ref[n].grad).abs().max().item() / ref[n].grad.abs().max().item()
                    for n, p in pmodel.named_parameters()),
    }


@pytest.mark.distributed
def test_each_device_takes_the_loss_of_its_rows_when_the_loss_is_a_mean():
    found = run_world(2, _steps)
    mean, total = found["mean"], found["sum"]
    assert mean["outputs"] == total["outputs"] == ("S(0)",), found  # the outputs stay split
    assert mean["averages"] is True and total["averages"] is False, found
    for result in (mean, total):  # relative to the loss and to each parameter's largest gradient
        assert result["loss"] < 1e-6 and result["grad"] < 1e-5, found


def _token_loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _token_sum(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def _sequence_steps() -> dict:
    """One sequence, context-parallel, with 5% less memory than the plan that gathers the
    logits for the loss needs (at this size gathering them is a latency cheaper): the logits
    stay split on the sequence (dim 1)."""
    from models import GPT

    found = {}
    for name, loss_fn in (("mean", _token_loss), ("sum", _token_sum)):
        torch.manual_seed(0)
        model = GPT(vocab=64, d=32, layers=2, max_len=64)
        ids, target = torch.randint(0, 64, (1, 64)), torch.randint(0, 64, (1, 64))
        reference = copy.deepcopy(model)
        ample = autopar.plan(model, (ids,), cluster="2xcpu", configuration="context_parallel")
        pmodel = autopar.parallelize(model, (ids,), cluster="2xcpu", configuration="context_parallel",
                                     memory_limit=int(0.95 * ample.memory.total_bytes), recompute="none",
                                     loss_fn=loss_fn)
        found[name] = _one_step(pmodel, reference, loss_fn, ids, target)
    return found


@pytest.mark.distributed
def test_a_token_loss_is_taken_on_each_devices_positions():
    """Split on the sequence, a token-level mean (next-token cross-entropy) is the mean of the
    devices' means; a sum is not, and runs on the gathered logits. Both equal one process."""
    found = run_world(2, _sequence_steps)
    mean, total = found["mean"], found["sum"]
    assert mean["outputs"] == total["outputs"] == ("S(1)",), found
    assert mean["averages"] is True and total["averages"] is False, found
    for result in (mean, total):
        assert result["loss"] < 1e-6 and result["grad"] < 1e-5, found
