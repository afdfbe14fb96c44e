"""Frozen parameters (``requires_grad=False``: fine-tuning part of a model) train like one
process's model: no gradient, no optimizer state and nothing reduced for them — planned and
lowered so."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from distributed import run_world
from models import GPT


def _frozen_gpt() -> GPT:
    """A GPT whose token embedding and first block are frozen."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, layers=2, heads=4, max_len=16)
    for param in [*model.tok.parameters(), *model.blocks[0].parameters()]:
        param.requires_grad_(False)
    return model


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _train_worker(configuration: str | None):
    """Two accumulated steps under ``configuration`` against one process: the largest
    difference in losses and trainable gradients, and which parameters got no gradient."""
    model, single = _frozen_gpt(), _frozen_gpt()
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    pmodel = autopar.parallelize(model, (x,), loss_fn=_loss, configuration=configuration)
    worst = 0.0
    for _ in range(2):  # gradients accumulate over both
        loss = pmodel.step(x, target=y)
        expected = _loss(single(x), y)
        expected.backward()
        worst = max(worst, abs(float(loss) - float(expected.detach())))
    reference = dict(single.named_parameters())
    without = []
    for name, param in pmodel.named_parameters():
        if param.grad is None:
            without.append(name)
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        worst = max(worst, float((grad - reference[name].grad).abs().max()))
    optimizer = torch.optim.AdamW(pmodel.parameters())
    optimizer.step()
    return {"worst": worst, "without_grad": sorted(without), "with_state": len(optimizer.state)}


def test_frozen_parameters_train_like_one_process():
    frozen = sorted(name for name, p in _frozen_gpt().named_parameters() if not p.requires_grad)
    trainable = sum(p.requires_grad for p in _frozen_gpt().parameters())
    for configuration in ("ddp", "fsdp", None):
        found = run_world(2, _train_worker, configuration)
        assert found["without_grad"] == frozen, (configuration, found)
        assert found["with_state"] == trainable, (configuration, found)
        assert found["worst"] < 1e-5, (configuration, found)


def test_frozen_parameters_hold_no_gradient_nor_optimizer_state_in_the_plan():
    """The same placements (DDP) hold less with part of the model frozen — its gradients and
    AdamW's two states, three times the frozen weights' bytes, are gone — and reduce less."""
    x = torch.randint(0, 64, (8, 16))
    trained = autopar.plan(GPT(vocab=64, d=32, layers=2, heads=4, max_len=16), (x,), cluster="2xcpu",
                           configuration="ddp")
    frozen_model = _frozen_gpt()
    frozen = autopar.plan(frozen_model, (x,), cluster="2xcpu", configuration="ddp")
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen_model.parameters() if not p.requires_grad)
    saved = trained.memory.total_bytes - frozen.memory.total_bytes
    assert saved >= 3 * frozen_bytes, (saved, frozen_bytes)
    assert frozen.predicted_step_s < trained.predicted_step_s

