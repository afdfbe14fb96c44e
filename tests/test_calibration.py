"""Calibration figures (op-class and collective efficiencies, fitted link) and bucketed gradient sync."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

import autopar
from autopar import comm
from autopar.cluster import Cluster, Link
from autopar.devices import get_device
from autopar.mesh import MeshSpec
from autopar.passes.cost import OpCost, op_class
from autopar.passes.reshard_cost import reshard_s
from autopar.placements import R, Shard
from autopar.profile_collectives import fit_collectives
from distributed import run_world


def test_fit_collectives_recovers_link_and_efficiencies():
    link = Link(2e9, 300e-6)
    sizes = [2**10, 2**16, 2**20, 2**22, 2**24]
    truth = {"all_gather": 0.5, "reduce_scatter": 0.25, "all_to_all": 0.8}
    times = {"all_reduce": [comm.all_reduce_s(b, 2, link) for b in sizes],
             "all_gather": [comm.all_gather_s(b, 2, link) / truth["all_gather"] for b in sizes],
             "reduce_scatter": [comm.reduce_scatter_s(b, 2, link) / truth["reduce_scatter"] for b in sizes],
             "all_to_all": [comm.all_to_all_s(b, 2, link) / truth["all_to_all"] for b in sizes]}
    fitted = fit_collectives(sizes, times, 2)
    assert fitted["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)
    assert fitted["latency_s"] == pytest.approx(300e-6, rel=1e-6)
    assert fitted["efficiency"] == pytest.approx(truth, rel=1e-3)


def test_collective_efficiency_slows_exactly_its_kind():
    plain = Link(1e9, 1e-4)
    slow = dataclasses.replace(plain, collective_efficiency=(("reduce_scatter", 0.5),))
    nbytes = 8e6
    assert comm.reduce_scatter_s(nbytes, 4, slow) == pytest.approx(2 * comm.reduce_scatter_s(nbytes, 4, plain))
    for kind in (comm.all_reduce_s, comm.all_gather_s, comm.all_to_all_s):
        assert kind(nbytes, 4, slow) == kind(nbytes, 4, plain)


def test_op_class_efficiency_divides_the_roofline():
    conv = torch.ops.aten.convolution.default
    assert op_class(conv) == "conv" and op_class(torch.ops.aten.mm.default) == "matmul"
    assert op_class(torch.ops.aten.max_pool2d_with_indices.default) == "pool"
    assert op_class(torch.ops.aten._softmax.default) == "reduction"
    assert op_class(torch.ops.aten.gelu.default) == "elementwise"
    device = dataclasses.replace(get_device("cpu"), op_overhead_s=1e-5, class_efficiency=(("conv", 0.25),))
    cost = OpCost(flops=1e9, bytes_read=10**6, bytes_written=10**6, is_view=False, dtype="float32", op_class="conv")
    plain = dataclasses.replace(cost, op_class="matmul")
    assert cost.time_s(device) - 1e-5 == pytest.approx(4 * (plain.time_s(device) - 1e-5))


def test_cluster_file_carries_measured_efficiencies(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""\
        devices:
          box:
            peak_TFLOPS: {fp32: 0.1}
            memory_GB: 8
            memory_bandwidth_GBps: 20
            op_class_efficiency: {conv: 0.5, pool: 0.05}
            collective_efficiency: {reduce_scatter: 0.4}
            intra_node: {bandwidth_GBps: 1, latency_us: 300}
        device: box
        nodes: 1
        per_node: 2
        """))
    cluster = Cluster.from_spec(str(path))
    assert cluster.device.efficiency("conv") == 0.5 and cluster.device.efficiency("matmul") == 1.0
    assert cluster.intra_link.efficiency("reduce_scatter") == 0.4
    assert cluster.intra_link.latency_s == pytest.approx(300e-6)
    path.write_text(path.read_text().replace("conv: 0.5", "convolutions: 0.5"))
    with pytest.raises(autopar.AutoparError, match=r"c.yaml:6: unknown kind 'convolutions'.*matmul, attention, conv"):
        Cluster.from_spec(str(path))


def test_only_all_reduced_gradients_are_bucketed():
    """A replicated parameter's partial gradient joins the gradient buckets: it pays the share
    of a bucket's latency its bytes take; a sharded parameter's reduce-scatter and its backward
    re-gather pay one latency each."""
    link = Link(1e9, 1e-3)
    mesh = MeshSpec((2,), ("dp",), (link,))
    nbytes = 4 * 10**6
    for bucket_bytes in (8 * 10**6, 25 * 2**20):  # half a bucket; DDP's 25 MiB
        replicated = reshard_s((R,), (R,), (True,), nbytes, True, mesh, True, bucket_bytes=bucket_bytes)
        share = Link(1e9, 1e-3 * nbytes / bucket_bytes)
        assert replicated == pytest.approx(comm.all_reduce_s(nbytes, 2, share))
    alone = reshard_s((R,), (R,), (True,), nbytes, True, mesh, True, bucket_bytes=nbytes // 2)  # over a bucket
    assert alone == pytest.approx(comm.all_reduce_s(nbytes, 2, link))
    sharded = reshard_s((Shard(0),), (R,), (True,), nbytes, True, mesh, True)
    gather = comm.all_gather_s(nbytes, 2, link)
    assert sharded == pytest.approx(2 * gather + comm.reduce_scatter_s(nbytes, 2, link))


def _count_gradient_collectives() -> dict:
    import torch.distributed as dist

    from models import MLP

    calls = []
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    torch.manual_seed(0)
    model = MLP(64, 256, 8, layers=3)  # big enough that DDP keeps the batch split (partial gradients)
    reference = MLP(64, 256, 8, layers=3)
    reference.load_state_dict(model.state_dict())
    x, target = torch.randn(256, 64), torch.randn(256, 8)
    plan = autopar.plan(model, (x,), cluster="2xcpu", configuration="ddp")
    pmodel = autopar.apply(model, plan, loss_fn=torch.nn.functional.mse_loss)
    dist.all_reduce = counted
    try:
        pmodel.step(x, target=target)
    finally:
        dist.all_reduce = original
    torch.nn.functional.mse_loss(reference(x), target).backward()
    grads = dict(pmodel.named_parameters())
    error = max((grads[name].grad.full_tensor() - p.grad).abs().max().item() for name, p in reference.named_parameters())
    return {"calls": calls, "error": error, "parameters": sum(p.numel() for p in reference.parameters())}


def test_ddp_gradients_are_synchronised_in_one_flat_all_reduce():
    result = run_world(2, _count_gradient_collectives)
    # one bucket holding every gradient (and the loss of each device's rows averaged for the report)
    assert sorted(result["calls"]) == [1, result["parameters"]], result
    assert result["error"] < 1e-6
