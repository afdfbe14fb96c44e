"""Moving a running model's training state to another plan (issue 24, ``autopar.reshard``):
trained under one plan, switched in place, trained on — the same parameters and AdamW moments
as one process trained throughout (gloo ranks), and a clear refusal for what cannot move."""

from __future__ import annotations

import pathlib

import pytest
import torch

import autopar
from autopar.errors import AutoparError
from test_overlap import ResidualMLP


def _one_process(model, x, target, steps: int):
    """A copy of ``model`` after ``steps`` AdamW steps in one process, and its optimizer."""
    import copy

    from torch.nn.functional import mse_loss

    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(steps):
        ref_opt.zero_grad()
        mse_loss(reference(x), target).backward()
        ref_opt.step()
    return reference, ref_opt


def _train_switching(model, plans, x, target, steps: int, meta=None):
    """``steps`` AdamW steps under each of ``plans`` in turn, switching with autopar.reshard:
    the model and optimizer at the end, and whether each switch kept the first weight's mesh."""
    from torch.nn.functional import mse_loss

    pmodel = autopar.apply(model, plans[0], loss_fn=mse_loss)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    same_mesh = []
    for k, plan in enumerate(plans):
        if k:
            before = getattr(next(pmodel.parameters()), "device_mesh", None)
            pmodel, optimizer = autopar.reshard(pmodel, plan, model=meta, optimizer=optimizer)
            same_mesh.append(getattr(next(pmodel.parameters()), "device_mesh", None) == before)
        for _ in range(steps):
            optimizer.zero_grad()
            pmodel.step(x, target=target)
            optimizer.step()
    return pmodel, optimizer, same_mesh


def _differences(pmodel, optimizer, reference, ref_opt) -> tuple[float, float]:
    """The largest difference, over every rank, between the parameters and AdamW moments this
    rank holds and the one-process run's."""
    import torch.distributed as dist

    state = pmodel.full_state_dict()  # under a pipeline plan: this rank's stage
    mine = dict(pmodel.named_parameters())
    worst = torch.zeros(2, dtype=torch.float64)
    for name, p in reference.named_parameters():
        if name not in state:
            continue
        worst[0] = max(worst[0].item(), (state[name] - p).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[mine[name]][key]
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            worst[1] = max(worst[1].item(), (value - ref_opt.state[p][key]).abs().max().item())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst[0].item(), worst[1].item()


def _reshard_worker(steps: int):
    """``steps`` AdamW steps of a ResidualMLP under a DDP plan on this rank, ``autopar.reshard``
    to an FSDP plan on the same mesh (DTensor's redistribute) and ``steps`` more, then to a
    2-D plan (Megatron's tensor parallelism inside data parallelism, a mesh of another shape:
    values move whole, each rank keeping its slice) and ``steps`` more: the largest difference
    from one process's ``3·steps`` steps, in parameters and in AdamW's two moments, the three
    plans' weight placements and meshes, and whether each switch kept the device mesh."""
    torch.manual_seed(0)
    model, x, target = ResidualMLP(64, 2), torch.randn(32, 64), torch.randn(32, 64)
    reference, ref_opt = _one_process(model, x, target, 3 * steps)
    plans = [autopar.plan(model, (x,), cluster="4xcpu", configuration="ddp"),
             autopar.plan(model, (x,), cluster="4xcpu", configuration="fsdp"),
             autopar.plan(model, (x,), cluster="4xcpu", mesh_shape=(2, 2), configuration="tp_dp")]
    pmodel, optimizer, same_mesh = _train_switching(model, plans, x, target, steps)
    error, moments = _differences(pmodel, optimizer, reference, ref_opt)
    placements = [sorted({p.placement for p in plan.parameters.values()}) for plan in plans]
    return error, moments, placements, [list(plan.mesh_shape) for plan in plans], same_mesh


def test_reshard_moves_parameters_and_optimizer_state_to_another_plan():
    """Train under plan A, switch the running model to plans B and C in place, train on: the
    same parameters and AdamW moments as one process trained throughout (4 gloo ranks)."""
    from distributed import run_world

    error, moments, placements, meshes, same_mesh = run_world(4, _reshard_worker, 2)
    assert placements[0] == ["R"] and placements[0] != placements[1] != placements[2], placements
    assert meshes == [[4], [4], [2, 2]] and same_mesh == [True, False]
    assert error < 1e-5 and moments < 1e-6, (error, moments)


def test_reshard_refuses_what_it_cannot_move(tmp_path):
    from autopar.planning.move_state import reshard

    with torch.device("meta"):
        model, x = ResidualMLP(64, 2), torch.randn(32, 64)
    plan = autopar.plan(model, (x,), cluster="4xcpu", configuration="ddp")
    with pytest.raises(AutoparError, match="switches a model autopar lowered"):
        reshard(torch.nn.Linear(2, 2), plan)
    other = autopar.plan(ResidualMLP(32, 2).to("meta"), (torch.randn(32, 32, device="meta"),), cluster="4xcpu")

    class Running(torch.nn.Module):
        def __init__(self, plan):
            super().__init__()
            self.plan = plan

    with pytest.raises(AutoparError, match="made for a different graph"):
        reshard(Running(plan), other)
    with pytest.raises(AutoparError, match="spans 4 devices and the new one 2"):
        reshard(Running(plan), autopar.plan(model, (x,), cluster="2xcpu", configuration="ddp"))



def _replica_reshard_worker(steps: int):
    """``steps`` AdamW steps under data-parallel replicas on two regions of two ranks (the
    batch split 16 + 16), ``autopar.reshard`` to FSDP over one mesh of all four, ``steps``
    more, back to replicas splitting 24 + 8, ``steps`` more: the largest difference from one
    process's ``3·steps`` steps in parameters and AdamW moments, and the three families."""
    import copy

    cluster = str(pathlib.Path(__file__).parent / "clusters" / "four_cpu_regions.yaml")
    torch.manual_seed(0)
    model, x, target = ResidualMLP(64, 2), torch.randn(32, 64), torch.randn(32, 64)
    reference, ref_opt = _one_process(model, x, target, 3 * steps)
    plans = [autopar.plan(model, (x,), cluster=cluster, replicas=True, batch_split=(16, 16)),
             autopar.plan(model, (x,), cluster=cluster, configuration="fsdp"),
             autopar.plan(model, (x,), cluster=cluster, replicas=True, batch_split=(24, 8))]
    pmodel, optimizer, _ = _train_switching(model, plans, x, target, steps, meta=copy.deepcopy(model).to("meta"))
    return (*_differences(pmodel, optimizer, reference, ref_opt), [plan.family for plan in plans])


def test_reshard_moves_state_into_and_out_of_replica_groups():
    from distributed import run_world

    error, moments, families = run_world(4, _replica_reshard_worker, 2)
    assert families == ["replicas", "one_mesh", "replicas"]
    assert error < 1e-5 and moments < 1e-6, (error, moments)


def _pipeline_reshard_worker(steps: int):
    """``steps`` AdamW steps under pipeline stages over two regions (a rank holds one stage),
    ``autopar.reshard`` to FSDP over both ranks, ``steps`` more, back to the pipeline with other
    micro-batches, ``steps`` more: the largest difference from one process's ``3·steps`` steps,
    in parameters and in AdamW's moments, and the three families."""
    import copy

    cluster = str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml")
    torch.manual_seed(0)
    model, x, target = ResidualMLP(64, 4), torch.randn(32, 64), torch.randn(32, 64)
    reference, ref_opt = _one_process(model, x, target, 3 * steps)
    plans = [autopar.plan(model, (x,), cluster=cluster, pipeline=True, micro_batches=4),
             autopar.plan(model, (x,), cluster=cluster, configuration="fsdp"),
             autopar.plan(model, (x,), cluster=cluster, pipeline=True, micro_batches=2)]
    pmodel, optimizer, _ = _train_switching(model, plans, x, target, steps, meta=copy.deepcopy(model).to("meta"))
    return (*_differences(pmodel, optimizer, reference, ref_opt), [plan.family for plan in plans])


def test_reshard_moves_state_into_and_out_of_pipeline_stages():
    from distributed import run_world

    error, moments, families = run_world(2, _pipeline_reshard_worker, 2)
    assert families == ["pipeline", "one_mesh", "pipeline"]
    assert error < 1e-5 and moments < 1e-6, (error, moments)
