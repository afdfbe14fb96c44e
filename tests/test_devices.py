"""Ready for GPUs without one (issue 23): every tensor the lowering and the runtime make is
made on a device they were given, never a hard-coded one; inputs and targets given elsewhere
are moved to the rank's device; ``parallelize`` without a cluster plans for the GPUs it runs
on (their catalog entry, ranks per host, a GPU shared by several ranks)."""

from __future__ import annotations

import ast
import logging
import pathlib
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

import autopar
from autopar.errors import AutoparError
from autopar.parallel import on_device
from autopar.planning import world
from distributed import run_world
from models import MLP

ROOT = pathlib.Path(__file__).resolve().parent.parent
TWO_REGIONS = str(ROOT / "tests" / "clusters" / "two_cpu_regions.yaml")  # a-b: 1 GB/s, 1 ms
# torch functions that make a tensor from nothing: without device= they make it on the CPU
FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint", "as_tensor", "eye",
             "linspace", "empty_strided")


def _lowering_and_runtime_sources() -> list[pathlib.Path]:
    """Every module the lowering, the runtime and the planning layer's state moves are written in."""
    return sorted([*ROOT.joinpath("passes").glob("*.py"), ROOT / "autopar" / "parallel.py",
                   *ROOT.joinpath("autopar", "planning").glob("*.py")])


def test_no_tensor_is_made_without_naming_its_device():
    """``torch.zeros(...)`` without ``device=`` is a CPU tensor: under NCCL the first collective
    on it fails, and on a GPU rank it meets CUDA tensors. Each factory call names its device —
    the mesh's, the value's it works with, or ``"cpu"`` where the CPU is meant (a DeviceMesh's
    rank table, a file's stand-ins, an optimizer's step count)."""
    found = []
    for path in _lowering_and_runtime_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{node.func.attr}")
    assert not found, found


class _Factories(TorchFunctionMode):
    """Records the tensor factories autopar's own code calls without a device."""

    def __init__(self) -> None:
        super().__init__()
        self.unnamed: list[str] = []
        self.calls = 0

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES and getattr(func, "__module__", "") in ("torch", "torch._C._VariableFunctions", None):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("autopar"):
                self.calls += 1
                if "device" not in kwargs:
                    self.unnamed.append(f"{module}:{caller.f_lineno}: torch.{name}")
        return func(*args, **kwargs)


def _steps_worker():
    """A one-mesh FSDP step and a two-stage pipeline step on this rank, every factory call of
    autopar's code watched; and where the parallel model says its tensors live."""
    from models import tiny_gpt

    torch.manual_seed(0)
    model, x = MLP(16, 32, 16, 2), torch.randn(8, 16)
    gpt, tokens = tiny_gpt()
    watch = _Factories()
    with watch:
        fsdp = autopar.parallelize(model, (x,), loss_fn=torch.nn.functional.mse_loss, configuration="fsdp")
        fsdp.step(x, target=torch.zeros(8, 16))
        staged = autopar.parallelize(gpt, tokens, cluster=TWO_REGIONS, loss_fn=torch.nn.functional.mse_loss,
                                     pipeline=True)
        staged.step(*tokens, target=torch.zeros_like(gpt(*tokens)))
    return {"unnamed": watch.unnamed, "calls": watch.calls, "families": (fsdp.plan.family, staged.plan.family),
            "devices": (str(fsdp.device), str(staged.device))}


def test_lowering_and_runtime_name_every_device_they_make_tensors_on():
    """Run for real (2 gloo ranks): FSDP and a two-stage pipeline, planned, lowered and trained
    a step, call tensor factories from autopar's code, and every such call names its device."""
    found = run_world(2, _steps_worker)
    assert found["families"] == ("one_mesh", "pipeline"), found
    assert found["calls"] > 0, found  # the watch saw the pipeline's examples and loss being made
    assert not found["unnamed"], found["unnamed"]
    assert found["devices"] == ("cpu", "cpu"), found


def test_inputs_and_targets_move_to_the_ranks_device():
    """A CPU batch handed to a model whose tensors live elsewhere is moved there (the meta
    device stands in for a GPU); tensors already there and other values pass unchanged."""
    here = torch.ones(2)
    moved = on_device(((torch.zeros(3), {"t": here}), 7, None), torch.device("meta"))
    (batch, nested), number, nothing = moved
    assert batch.device.type == "meta" and nested["t"].device.type == "meta"
    assert (number, nothing) == (7, None)
    assert on_device((here,), torch.device("cpu"))[0] is here


def _fake_gpus(monkeypatch, name: str, count: int, memory: int) -> None:
    """This process as a GPU rank of 8 without a GPU: NCCL-like device type, ``count`` GPUs
    named ``name`` of ``memory`` bytes each."""
    monkeypatch.setattr(world, "device_type", lambda model=None: "cuda")
    monkeypatch.setattr(world.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=None: types.SimpleNamespace(total_memory=memory))


def test_parallelize_plans_for_the_gpus_it_runs_on(monkeypatch):
    """Without a cluster: the catalog's H100 for torch's name of one, hosts from torchrun's
    LOCAL_WORLD_SIZE, the catalog memory while each rank has its own GPU."""
    _fake_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", count=4, memory=85_000_000_000)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cluster = world.world_cluster()
    assert (cluster.device.name, cluster.hosts, cluster.devices_per_host) == ("H100-SXM", 2, 4)
    assert cluster.memory_limit_bytes == cluster.device.memory_bytes
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert world.world_cluster().hosts == 1  # without torchrun's count: one host


def test_ranks_sharing_a_gpu_plan_within_their_share_of_its_memory(monkeypatch):
    """8 ranks on a host with 2 GPUs: 4 ranks per GPU, each planned with a quarter of it."""
    _fake_gpus(monkeypatch, "NVIDIA A100-SXM4-80GB", count=2, memory=81_000_000_000)
    cluster = world.world_cluster()
    assert cluster.device.name == "A100-80GB"
    assert cluster.memory_limit_bytes == 80 * 10**9 // 4


def test_an_unknown_gpu_gets_a_generic_profile_and_says_so(monkeypatch, caplog):
    _fake_gpus(monkeypatch, "NVIDIA GeForce RTX 4090", count=8, memory=24_000_000_000)
    with caplog.at_level(logging.WARNING, logger="autopar.planning.world"):
        cluster = world.world_cluster()
    assert cluster.device.name == "NVIDIA GeForce RTX 4090"
    assert cluster.device.memory_bytes == 24_000_000_000
    assert "not in autopar's catalog" in caplog.text and "autopar profile" in caplog.text


@pytest.mark.parametrize("reported, catalog", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H100 NVL", "H100-PCIe"),
    ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("Tesla V100-SXM2-32GB", "V100-32GB"), ("NVIDIA L4", "L4"),
    ("Tesla T4", "T4"), ("NVIDIA A10G", "A10G"), ("AMD Instinct MI300X", "MI300X"), ("NVIDIA L40S", None)])
def test_gpu_names_as_torch_reports_them_map_to_the_catalog(reported, catalog):
    from autopar.devices import device_for_gpu_name

    found = device_for_gpu_name(reported)
    assert (found.name if found else None) == catalog


def test_a_local_world_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(AutoparError, match="LOCAL_WORLD_SIZE='3' does not divide the world of 8"):
        world.ranks_per_host(8, "3")
    assert world.ranks_per_host(8, "4") == 4 and world.ranks_per_host(8, None) == 8


def test_a_gpu_profile_is_a_cluster_file_the_planner_accepts(monkeypatch, tmp_path):
    """What ``autopar profile --device gpu`` writes (its measurements stood in for: this host
    has no GPU) loads as a cluster: measured rates, fused attention's efficiency, NCCL's link
    and overlap; the network between hosts from the catalog; with one GPU, the catalog's link."""
    from autopar import profile_gpu

    entry = {"name": "NVIDIA H100 80GB HBM3", "peak_TFLOPS": {"fp32": 50.0, "tf32": 350.0, "bf16": 700.0, "fp16": 700.0},
             "memory_GB": 85.0, "memory_bandwidth_GBps": 2900.0, "op_overhead_us": 8.0,
             "op_class_efficiency": {"matmul": 1.0, "attention": 0.6, "conv": 0.5, "pool": 0.3, "reduction": 0.4,
                                     "elementwise": 0.8}}
    link = {"bandwidth_Bps": 180e9, "latency_s": 20e-6, "efficiency": {"all_gather": 0.9, "reduce_scatter": 0.85}}
    overlap = {"all_gather": 0.8, "reduce_scatter": 0.7, "all_reduce": 0.75}
    monkeypatch.setattr(profile_gpu, "device_entry", lambda quick=False: dict(entry))
    monkeypatch.setattr(profile_gpu, "nccl_link", lambda world, quick: (link, overlap))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    path = str(tmp_path / "gpus.yaml")
    profile_gpu.write_gpu_profile(path, 8)
    cluster = autopar.Cluster.from_spec(path)
    device = cluster.device
    assert (cluster.num_devices, device.name) == (8, "NVIDIA-H100-80GB-HBM3")
    assert device.flops_per_s("bfloat16") == 700e12 and device.efficiency("attention") == 0.6
    assert cluster.intra_link.bandwidth_Bps == 180e9 and cluster.intra_link.efficiency("all_gather") == 0.9
    assert device.overlap("all_gather") == 0.8 and device.overlap_efficiency == 0.7
    assert cluster.inter_link.bandwidth_Bps == 50e9  # the catalog's H100 network
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    profile_gpu.write_gpu_profile(path, 1)
    one = autopar.Cluster.from_spec(path)
    assert one.num_devices == 1 and one.intra_link.bandwidth_Bps == 450e9 and one.device.overlap_efficiency == 0.9
    assert autopar.plan(MLP(16, 32, 16, 2), (torch.randn(8, 16),), cluster=path).predicted_step_s > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: benchmarks/gpu_check.py profiles it")
def test_profiling_gpus_without_one_is_a_clear_usage_error(tmp_path):
    from test_cli import autopar as run_cli

    done = run_cli("profile", "--device", "gpu", "--out", str(tmp_path / "gpus.yaml"))
    assert done.returncode == 2 and "torch sees no GPU here" in done.stderr, done.stderr
    assert not (tmp_path / "gpus.yaml").exists()
