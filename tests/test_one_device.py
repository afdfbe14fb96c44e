"""Plans over one device place everything replicated: there a split, a partial sum and the
whole tensor are the same values, the solver's ties between them fall either way, and a
lowered program carrying one-device DTensor splits pays for nothing (and once met a DTensor
gap: a batch norm placed so). planning.mesh_plan.replicated_on_one_device moves each node to
its replicated strategy where that costs no more."""

from __future__ import annotations

import os

import torch

import autopar
from autopar.cluster import Cluster
from autopar.passes.capture import capture
from autopar.planning.costing import recost
from distributed import run_world
from models import GPT

CLUSTERS = os.path.join(os.path.dirname(__file__), "clusters")


def _gpt():
    torch.manual_seed(0)
    return GPT(layers=2), torch.randint(0, 64, (8, 16))


def _replicated(plan) -> bool:
    """Every node's outputs and inputs and every parameter whole ("R" on the one mesh dim)."""
    specs = {spec for node in plan.nodes.values() for spec in (*node.outputs, *node.inputs) if spec is not None}
    return specs == {"R"} and {p.placement for p in plan.parameters.values()} == {"R"}


def test_a_plan_on_one_device_is_replicated_and_as_fast():
    model, x = _gpt()
    plan = autopar.plan(model, (x,), cluster="1xcpu")
    assert plan.mesh_shape == (1,) and _replicated(plan)
    step_s, memory = recost(capture(model, (x,)), plan, Cluster.from_spec("1xcpu"))  # valid, costed alike
    assert abs(step_s - plan.predicted_step_s) <= 1e-9 * step_s and memory == plan.memory.total_bytes
    pinned = autopar.plan(model, (x,), cluster="1xcpu", configuration="fsdp")  # a configuration stays as named
    assert {p.placement for p in pinned.parameters.values()} != {"R"}
    assert run_world(1, _trains_like_the_model, plan) <= 1e-6


def _token_loss(out, target):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _trains_like_the_model(plan) -> float:
    """Rank side: the largest gap between ``plan`` lowered on one rank and the model itself
    (loss, every gradient)."""
    model, x = _gpt()
    reference, _ = _gpt()
    pmodel = autopar.apply(model, plan, loss_fn=_token_loss)
    loss = pmodel.step(x, target=x)
    expected = _token_loss(reference(x), x)
    expected.backward()
    grads = dict(pmodel.named_parameters())
    gaps = [(loss - expected.detach()).abs().item()]
    for name, p in reference.named_parameters():
        grad = grads[name].grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        gaps.append((grad - p.grad).abs().max().item())
    return max(gaps)


def test_pipeline_stages_of_one_device_are_replicated():
    model, x = _gpt()
    plan = autopar.plan(model, (x,), cluster=os.path.join(CLUSTERS, "two_cpu_regions.yaml"), pipeline=True)
    assert plan.family == "pipeline" and all(st.mesh_shape == (1,) for st in plan.stages)
    assert _replicated(plan)
