"""On a GPU (issue 23): lowering and runtime with CUDA tensors — one rank; two ranks sharing
one GPU over gloo (gloo moves CUDA tensors, so every device path of lowering, pipelines, sparse
tables and experts runs on one GPU); NCCL where there are two GPUs. Where torch sees no GPU
these are skipped, saying so; tests/test_devices.py checks the same paths' devices on CPU and
``benchmarks/gpu_check.py`` measures a GPU when one is at hand."""

from __future__ import annotations

import copy
import json
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar.planning import world
from distributed import run_world

HERE = os.path.dirname(os.path.abspath(__file__))
TWO_REGIONS = os.path.join(HERE, "clusters", "two_cpu_regions.yaml")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="torch sees no GPU here; tests/test_devices.py checks the device paths on CPU")


def _gpt_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _case(name: str):
    """A model on the GPU, its inputs and target there, its loss and plan options."""
    from models import DLRM, GPT, MoEGPT, dlrm_inputs

    torch.manual_seed(0)
    if name == "dlrm":
        model = DLRM().cuda()
        inputs = tuple(x.cuda() for x in dlrm_inputs(model))
        return model, inputs, torch.zeros(inputs[0].shape[0], 1, device="cuda"), F.mse_loss, {}
    model = (MoEGPT() if name == "moe" else GPT(vocab=64, d=32, layers=4, heads=4, max_len=16)).cuda()
    tokens, target = torch.randint(0, 64, (8, 16), device="cuda"), torch.randint(0, 64, (8, 16), device="cuda")
    options = {"cluster": TWO_REGIONS, "pipeline": True} if name == "pipeline" else \
        {"configuration": name} if name in ("ddp", "fsdp", "megatron_tp") else {}
    return model, (tokens,), target, _gpt_loss, options


def _equivalence(name: str, gpu: int = 0) -> dict:
    """One step of case ``name`` against one process's model on the same GPU (``gpu``)."""
    torch.cuda.set_device(gpu)
    model, inputs, target, loss_fn, options = _case(name)
    single = copy.deepcopy(model)
    expected = loss_fn(single(*inputs), target)
    expected.backward()
    options = dict(options)
    pmodel = autopar.parallelize(model, inputs, cluster=options.pop("cluster", None), loss_fn=loss_fn, **options)
    loss = pmodel.step(*inputs, target=target)
    grads = dict(single.named_parameters())
    worst, devices = abs(float(loss) - float(expected.detach())), set()
    for pname, param in pmodel.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        devices.add(local.device.type)
        if param.grad is None or pname not in grads:
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        if grad.shape == grads[pname].grad.shape:
            worst = max(worst, float((grad - grads[pname].grad).abs().max()))
    return {"worst": worst, "devices": sorted(devices), "device": str(pmodel.device)}


@needs_gpu
def test_one_rank_trains_on_the_gpu_like_one_process():
    found = run_world(1, _equivalence, "ddp")
    assert found["devices"] == ["cuda"] and found["device"].startswith("cuda"), found
    assert found["worst"] < 1e-4, found


@needs_gpu
@pytest.mark.parametrize("name", ["fsdp", "megatron_tp", "pipeline", "dlrm", "moe"])
def test_two_ranks_sharing_one_gpu_train_like_one_process(name):
    found = run_world(2, _equivalence, name)
    assert found["devices"] == ["cuda"], found
    assert found["worst"] < 1e-4, found


def _nccl_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    try:
        found = {name: _equivalence(name, rank) for name in ("fsdp", "megatron_tp")}
        cluster = world.world_cluster()
        found["cluster"] = [cluster.num_devices, cluster.device.name]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(found, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs; torch sees fewer here")
def test_nccl_on_two_gpus_trains_like_one_process():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "found.json")
        mp.spawn(_nccl_worker, args=(port, out), nprocs=2, join=True)
        with open(out) as f:
            found = json.load(f)
    for name in ("fsdp", "megatron_tp"):
        assert found[name]["worst"] < 1e-4, found
    assert found["cluster"][0] == 2 and found["cluster"][1] != "cpu", found  # planned for its GPUs
