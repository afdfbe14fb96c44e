"""Buffers a training forward updates — batch norm's running statistics — are written back
the way eager batch norm leaves them: backward still runs (batch norm saved the statistics it
read), and after the steps they hold what one process's model holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from distributed import run_world


class NormNet(torch.nn.Module):
    """A convolution, batch norm and a classifier: the smallest model with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def _train_worker(configuration: str):
    """Two training steps (SGD) under ``configuration``; the largest difference from one
    process's model in losses, gradients, parameters and running statistics."""
    torch.manual_seed(0)
    model, x, y = NormNet(), torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    single = NormNet()
    single.load_state_dict(model.state_dict())
    pmodel = autopar.parallelize(model, (x,), loss_fn=F.cross_entropy, configuration=configuration)
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    reference = torch.optim.SGD(single.parameters(), lr=0.1)
    worst = 0.0
    for _ in range(2):
        loss = pmodel.step(x, target=y)
        expected = F.cross_entropy(single(x), y)
        expected.backward()
        grads = dict(single.named_parameters())
        for name, p in pmodel.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, float((grad - grads[name].grad).abs().max()))
        worst = max(worst, abs(float(loss) - float(expected)))
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        reference.zero_grad()
    state = pmodel.full_state_dict()
    for name, value in single.state_dict().items():
        worst = max(worst, float((state[name].double() - value.double()).abs().max()))
    return {"worst": worst, "buffers": sorted(name for name, _ in pmodel.named_buffers())}


def test_batch_norm_trains_like_one_process_under_ddp_and_fsdp():
    """DDP's replicated batch norm (the statistics read where they are stored, so saved for
    backward and then overwritten — an in-place ``copy_`` failed backward's version check
    here) and FSDP's, on 2 gloo ranks."""
    for configuration in ("ddp", "fsdp"):
        found = run_world(2, _train_worker, configuration)
        assert "bn.running_mean" in found["buffers"], found
        assert found["worst"] < 1e-5, (configuration, found)
