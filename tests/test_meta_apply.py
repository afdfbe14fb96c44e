"""Models larger than one process (issue 8): ``apply`` on a model built on the meta device
materialises only each rank's shards, initialised by the model's own modules."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.distributed as dist

import autopar
import models
from autopar.errors import AutoparError
from autopar.passes.materialize import check_initialisable
from distributed import run_world


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak() -> None:
    """Start the peak RSS (VmHWM) over from now, so planning's own peak before it does not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def equals_cpu_model(configuration: str) -> dict:
    """A meta model applied with a plan gives the outputs and gradients of the same model built
    on CPU with the same seed (the modules draw their weights in the same order)."""
    torch.manual_seed(0)
    reference = models.MLP(16, 64, 8, layers=3)
    with torch.device("meta"):
        meta = models.MLP(16, 64, 8, layers=3)
    x = torch.randn(8, 16)
    plan = autopar.plan(meta, (torch.empty(8, 16, device="meta"),), cluster=f"{dist.get_world_size()}xcpu",
                        configuration=configuration)
    torch.manual_seed(0)
    pmodel = autopar.apply(meta, plan)
    out, ref = pmodel(x), reference(x)
    out.square().mean().backward()
    ref.square().mean().backward()
    params = dict(pmodel.named_parameters())
    grad = max((params[n].grad.full_tensor() - p.grad).abs().max().item() for n, p in reference.named_parameters())
    weight = max((params[n].full_tensor() - p).abs().max().item() for n, p in reference.named_parameters())
    local = sum(p.to_local().numel() for p in pmodel.parameters())
    total = sum(p.numel() for p in reference.parameters())
    return {"output": (out - ref).abs().max().item(), "grad": grad, "weight": weight, "local_fraction": local / total,
            "meta_left": any(p.device.type == "meta" for p in pmodel.parameters())}


def peak_apply_bytes(hidden: int, layers: int) -> dict:
    """Peak RSS growth of one rank while applying an FSDP-style plan to a meta model of
    ``layers`` square linear layers (a real copy would need hidden² · layers · 4 bytes)."""
    with torch.device("meta"):
        meta = models.MLP(hidden, hidden, hidden, layers=layers)
    plan = autopar.plan(meta, (torch.empty(8, hidden, device="meta"),), cluster=f"{dist.get_world_size()}xcpu",
                        configuration="fsdp")
    _reset_peak()
    before = _rss_bytes()
    pmodel = autopar.apply(meta, plan)
    peak = _peak_bytes() - before
    local = sum(p.to_local().numel() * 4 for p in pmodel.parameters())
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return {"peak_bytes": max(peaks), "local_param_bytes": local,
            "model_bytes": (layers + 1) * (hidden * hidden + hidden) * 4}


def world_cases(big: bool) -> list:
    results = [equals_cpu_model("fsdp"), equals_cpu_model("ddp")]
    if big:
        results.append(peak_apply_bytes(4096, 11))  # 12 layers, 805 MB in full
    return results


def test_modules_without_reset_parameters_are_named():
    with torch.device("meta"):
        model = models.MoEGPT(layers=1)
    with pytest.raises(AutoparError, match=r"blocks\.0\.moe \(MoE: w_in, w_out\).*reset_parameters"):
        check_initialisable(model)


@pytest.mark.distributed
def test_meta_model_materialises_only_shards_and_peak_falls_with_world_size():
    two = run_world(2, world_cases, True)
    four = run_world(4, world_cases, True)
    for results in (two, four):
        for case in results[:2]:
            assert case["weight"] == 0, case  # the very weights the CPU model drew
            assert case["output"] <= 1e-6 and case["grad"] <= 1e-6, case  # sharded sums: round-off only
            assert not case["meta_left"]
    world = [2, 4]
    for results, n in zip((two, four), world):
        assert results[0]["local_fraction"] == pytest.approx(1 / n, rel=0.05)  # fsdp: each rank its shard
        assert results[1]["local_fraction"] == 1.0  # ddp: replicated
    big2, big4 = two[2], four[2]
    # each rank holds 1/n of the weights; while applying, at most one module's full weights more
    assert big2["local_param_bytes"] == pytest.approx(big2["model_bytes"] / 2, rel=0.01)
    assert big4["local_param_bytes"] == pytest.approx(big4["model_bytes"] / 4, rel=0.01)
    assert big4["peak_bytes"] < 0.75 * big2["peak_bytes"], (big2, big4)
    assert big2["peak_bytes"] < 0.75 * big2["model_bytes"], big2  # far below a full copy
