"""A plan made at one batch size runs at any batch that divides over its devices
(passes.relower): train at B, evaluate at B/2 and 3B, train on a last partial batch — the same
outputs, losses, gradients and parameters as one process; a batch that does not divide is
refused naming the divisor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import autopar
from distributed import run_world
from models import GPT, MLP


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _other_batches(world: int) -> dict:
    found = {}
    cases = {"mlp": (MLP(16, 64, 8, layers=3), lambda b: torch.randn(b, 16), lambda b: torch.randn(b, 8), {"configuration": "ddp"}),
             "gpt_fsdp": (GPT(layers=2), lambda b: torch.randint(0, 64, (b, 16)),
                          lambda b: torch.randn(b, 16, 64), {"configuration": "fsdp"})}
    for name, (model, inputs, targets, options) in cases.items():
        torch.manual_seed(0)
        model = copy.deepcopy(model)
        reference = copy.deepcopy(model)
        pmodel = autopar.parallelize(model, (inputs(8),), cluster=f"{world}xcpu", loss_fn=F.mse_loss, **options)
        # SGD: AdamW turns the noise-level gradient of a parameter that has none (the key part of
        # an attention bias) into a full step, in either process
        optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        errors = {"loss": 0.0, "grad": 0.0, "param": 0.0, "output": 0.0}
        for batch in (8, 24, 4):  # train at B, at 3B, at a partial batch
            torch.manual_seed(batch)
            x, t = inputs(batch), targets(batch)
            loss = pmodel.step(x, target=t)
            ref_loss = F.mse_loss(reference(x), t)
            ref_loss.backward()
            errors["loss"] = max(errors["loss"], abs(loss.item() - ref_loss.item()) / ref_loss.item())
            ref = dict(reference.named_parameters())
            errors["grad"] = max([errors["grad"]] + [_relative(p.grad.full_tensor(), ref[n].grad)
                                                     for n, p in pmodel.named_parameters()])
            optimizer.step(), ref_optimizer.step()
            optimizer.zero_grad(), ref_optimizer.zero_grad()
            errors["param"] = max([errors["param"]] + [_relative(p.full_tensor(), ref[n])
                                                       for n, p in pmodel.named_parameters()])
        with torch.no_grad():
            for batch in (4, 24):  # evaluate at B/2 and 3B
                x = inputs(batch)
                errors["output"] = max(errors["output"], _relative(pmodel(x), reference(x)))
        errors["lowered_shapes"] = len(pmodel.relowering.by_shapes)
        try:
            pmodel(inputs(world + 2 if world > 2 else 3))
            errors["indivisible"] = "accepted"
        except autopar.AutoparError as exc:
            errors["indivisible"] = str(exc)
        found[name] = errors
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_a_plan_runs_at_other_batch_sizes_like_one_process(world):
    found = run_world(world, _other_batches, world)
    for name, errors in found.items():
        assert errors["lowered_shapes"] == 2, (name, errors)  # 24 and 4 rows, each lowered once
        for key in ("loss", "grad", "param", "output"):
            assert errors[key] < 1e-5, (name, key, errors)
        assert f"divide by {world}" in errors["indivisible"], (name, errors)


@pytest.mark.parametrize("family", ["pipeline", "replicas"])
def test_plans_over_device_groups_refuse_other_shapes_by_name(tmp_path, family):
    """Pipeline and replica plans run at their planned inputs only: another batch is refused
    before any group runs, naming the planned shapes (not export's guard failure)."""
    path = tmp_path / "cluster.yaml"
    path.write_text("regions:\n  a: {device: H100, nodes: 1, per_node: 1}\n  b: {device: H100, nodes: 1, per_node: 1}\n"
                    "links:\n  - {between: [a, b], bandwidth_GBps: 25, latency_us: 10}\n")
    model, x = GPT(layers=2), torch.randint(0, 64, (8, 16))
    plan = autopar.plan(model, (x,), cluster=str(path), **{family: True}, **({"micro_batches": 2}
                                                                             if family == "pipeline" else {}))
    pmodel = autopar.ParallelModule(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), plan,
                                    F.mse_loss, runtime=object())  # the check comes before the runtime
    with pytest.raises(autopar.AutoparError, match=r"planned inputs \[\(8, 16\)\] only, called with \[\(6, 16\)\]"):
        pmodel(x[:6])
    with pytest.raises(autopar.AutoparError, match="plan again at these"):
        pmodel.step(x[:6], target=torch.zeros(6, 16, 64))
