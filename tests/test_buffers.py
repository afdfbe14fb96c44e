"""Buffers a training forward updates — batch norm's running statistics — are written back
the way eager batch norm leaves them: backward still runs (batch norm saved the statistics it
read), and after the steps they hold what one process's model holds. In evaluation
(``pmodel.eval()``) batch norm reads them and dropout keeps everything, as the model's own
modules do, and nothing is written back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from distributed import run_world


class NormNet(torch.nn.Module):
    """A convolution, batch norm and a classifier: the smallest model with running statistics."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(dropout)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.drop(F.relu(self.bn(self.conv(x))).mean((2, 3))))


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


def _evaluate_worker(configuration: str | None):
    """A training step, then evaluation twice, then training again, beside one process's model
    (with dropout: evaluation is deterministic, training is not compared)."""
    torch.manual_seed(0)
    model, x, y = NormNet(dropout=0.5), torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    single = NormNet(dropout=0.5)
    single.load_state_dict(model.state_dict())
    pmodel = autopar.parallelize(model, (x,), loss_fn=F.cross_entropy, configuration=configuration)
    pmodel.step(x, target=y)
    single(x)  # the same batch statistics folded into the running ones (dropout comes after them)
    trained = {k: v.clone() for k, v in pmodel.full_state_dict().items() if "running" in k}
    pmodel.eval()
    single.eval()
    with torch.no_grad():
        first, again, expected = pmodel(x), pmodel(x), single(x)
    untouched = pmodel.full_state_dict()
    pmodel.train()
    counted = int(pmodel.full_state_dict()["bn.num_batches_tracked"])
    return {"eval": float((first - expected).abs().max()), "repeat": float((again - first).abs().max()),
            "statistics": max(float((untouched[k] - v).abs().max()) for k, v in trained.items()),
            "vs_single": max(float((untouched[k] - single.state_dict()[k]).abs().max()) for k in trained),
            "batches": counted, "training": pmodel.training}


def test_evaluation_reads_the_running_statistics_and_keeps_every_activation():
    """After a training step, ``pmodel.eval()``: the outputs are the model's own in eval mode
    (batch norm on the running statistics, dropout off), the same twice, and the running
    statistics and batch count stay as training left them; ``pmodel.train()`` switches back."""
    for configuration in ("ddp", None):
        found = run_world(2, _evaluate_worker, configuration)
        assert found["eval"] < 1e-5 and found["repeat"] == 0.0, (configuration, found)
        assert found["statistics"] == 0.0 and found["vs_single"] < 1e-6, (configuration, found)
        assert found["batches"] == 1 and found["training"], (configuration, found)



class _OutputDropout(torch.nn.Module):
    """A small GPT with dropout on its logits: torch.export writes this one decomposed
    (``bernoulli_(keep)`` then ``div_(keep)``), as timm writes its drop-path."""

    def __init__(self) -> None:
        super().__init__()
        from models import GPT

        self.gpt = GPT(vocab=64, d=32, layers=4, heads=4, max_len=16)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, idx):
        return self.drop(self.gpt(idx))


def _decomposed_dropout_worker(family: str):
    import os

    torch.manual_seed(0)
    model, single = _OutputDropout(), _OutputDropout()
    single.load_state_dict(model.state_dict())
    x = torch.randint(0, 64, (8, 16))
    options = {"cluster": os.path.join(os.path.dirname(__file__), "clusters", "two_cpu_regions.yaml"),
               "pipeline": True} if family == "pipeline" else {"configuration": "ddp"}
    pmodel = autopar.parallelize(model, (x,), loss_fn=F.mse_loss, **options)
    with torch.no_grad():
        trained = pmodel(x)
        pmodel.eval()
        single.eval()
        evaluated, expected = pmodel(x), single(x)
    return {"family": pmodel.plan.family, "eval": float((evaluated - expected).abs().max()),
            "dropped_in_training": float((trained - expected).abs().max())}


def test_a_dropout_captured_decomposed_keeps_everything_in_evaluation():
    for family in ("one_mesh", "pipeline"):
        found = run_world(2, _decomposed_dropout_worker, family)
        assert found["family"] == family, found
        assert found["eval"] < 1e-6 and found["dropped_in_training"] > 0.1, (family, found)
