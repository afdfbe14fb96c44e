"""A parallel model is called as the model is: inputs by position, or by the model's
argument names (Hugging Face models take keywords), which the plan records with its inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from distributed import run_world


class _Scaled(torch.nn.Module):
    """Two inputs, the second usually given by name."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.linear(x) * scale


def _named_inputs_worker():
    from autopar.errors import AutoparError

    torch.manual_seed(0)
    model, x, scale = _Scaled(), torch.randn(4, 8), torch.full((4, 1), 2.0)
    pmodel = autopar.parallelize(model, (x, scale), loss_fn=F.mse_loss, configuration="ddp")
    by_name = float((pmodel(x, scale=scale) - pmodel(x, scale)).abs().max())
    all_named = float((pmodel(scale=scale, x=x) - model(x, scale)).abs().max())
    loss = float(pmodel.step(x, scale=scale, target=torch.zeros(4, 8)))
    errors = []
    for call in (lambda: pmodel(x, mask=scale), lambda: pmodel(scale=scale), lambda: pmodel(x, scale, x=x)):
        try:
            call()
        except AutoparError as exc:
            errors.append(exc.message)
    return {"by_name": by_name, "all_named": all_named, "loss": loss, "errors": errors}


def test_inputs_may_be_given_by_the_models_argument_names():
    """``pmodel(x, scale=s)`` as the model is called (Hugging Face models take keywords); a name
    the plan lacks, a missing input or one given twice is a clear error."""
    found = run_world(2, _named_inputs_worker)
    assert found["by_name"] == 0.0 and found["all_named"] < 1e-6 and found["loss"] > 0, found
    assert len(found["errors"]) == 3, found
    assert "mask= is not an input this plan was made with (its inputs, in order: x, scale)" in found["errors"][0]
    assert "the plan's inputs x are not given" in found["errors"][1], found
    assert "x is given twice" in found["errors"][2], found
