"""What every family's ``lower`` needs besides the device (autopar.planning.world): the
model's graph at the plan's input shapes when the caller has none."""

from __future__ import annotations

import torch
from torch import nn

from autopar.plan import Plan
from autopar.passes.capture import Captured, capture, compute_dtype_of
from autopar.passes.materialize import on_meta


def capture_for(model: nn.Module, plan: Plan) -> Captured:
    """Capture ``model`` on zeros shaped like the plan's inputs (one micro-batch for a pipeline),
    computing in the plan's mixed-precision dtype if it has one."""
    device = torch.device("meta") if on_meta(model) else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    inputs = tuple(torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device) for spec in plan.inputs)
    return capture(model, inputs, compute_dtype_of(plan))
