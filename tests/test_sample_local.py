"""Group norm and the pools DTensor has no rule for compute each sample on its own: a
data-parallel plan splits their samples like every other op's (passes.sample_local) instead of
gathering the activations whole at each of them, and trains like one process — the norm's
weight and bias get their gradients as partial sums, reduced with the others."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from distributed import run_world


class DiffusionBlock(torch.nn.Module):
    """A UNet's piece: convolutions, group norms, SiLU, an average and an adaptive max pool."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.inc = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.norm1 = torch.nn.GroupNorm(4, channels)
        self.mid = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = torch.nn.GroupNorm(4, channels)
        self.out = torch.nn.Conv2d(channels, 3, 1)

    def forward(self, x):
        a = F.silu(self.norm1(self.inc(x)))
        b = F.silu(self.norm2(self.mid(a))) + F.avg_pool2d(a, 3, 1, 1)
        return self.out(b + F.interpolate(F.adaptive_max_pool2d(b, 8), scale_factor=2))


SAMPLE_LOCAL_OPS = ("native_group_norm", "avg_pool2d", "adaptive_max_pool2d")


def _train_worker(configuration: str | None):
    torch.manual_seed(0)
    model, x, y = DiffusionBlock(), torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
    single = DiffusionBlock()
    single.load_state_dict(model.state_dict())
    pmodel = autopar.parallelize(model, (x,), loss_fn=F.mse_loss, configuration=configuration)
    loss = pmodel.step(x, target=y)
    expected = F.mse_loss(single(x), y)
    expected.backward()
    reference = dict(single.named_parameters())
    worst = abs(float(loss) - float(expected.detach()))
    for name, param in pmodel.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        worst = max(worst, float((grad - reference[name].grad).abs().max()) / float(reference[name].grad.abs().max()))
    placed = sorted(node.outputs[0] for name, node in pmodel.plan.nodes.items() if name.startswith(SAMPLE_LOCAL_OPS))
    return {"worst": worst, "placed": placed, "fallback": [n for n, p in pmodel.plan.nodes.items() if p.fallback]}


def test_ddp_splits_the_samples_of_group_norms_and_pools_and_trains_like_one_process():
    for configuration in ("ddp", None):
        found = run_world(2, _train_worker, configuration)
        assert found["placed"] == ["S(0)"] * 4, (configuration, found)  # two norms, two pools
        assert not found["fallback"], found
        assert found["worst"] < 1e-5, (configuration, found)

