"""The ops whose behaviour depends on the module's mode, as the lowered program runs them
(passes.lower._follow_mode rewrites the training-mode graph to call them with the lowered
module's ``training`` flag): dropout, batch norm, and the write-back of the buffers a training
forward updates. ``pmodel.eval()`` then runs the model's evaluation, as its own modules would."""

from __future__ import annotations

import torch


def update_buffer(buffer: torch.Tensor, value: torch.Tensor, training: bool = True) -> torch.Tensor:
    """``buffer.copy_(value)`` at the end of a training forward (a buffer it updated: batch
    norm's running statistics), in training only, without bumping the version autograd
    checks. The op that read the buffer may have saved it for backward — batch norm saves its running statistics, and its
    training-mode backward does not read them — and eager batch norm updates them in place
    inside that same op, after which they are saved; written here afterwards, a plain
    ``copy_`` failed the check in backward (a DDP plan of any model with batch norm, whose
    statistics reach the op as stored). ``.data`` shares the storage under a version counter of
    its own."""
    if training:
        with torch.no_grad():
            buffer.data.copy_(value)
    return buffer


def dropout(x: torch.Tensor, p: float, train: bool | None, training: bool):
    """``aten.native_dropout`` as captured in training, the identity in evaluation (its mask:
    every element kept)."""
    if training:
        return torch.ops.aten.native_dropout.default(x, p, train)
    return x, torch.ones_like(x, dtype=torch.bool)


def dropout_mask(mask: torch.Tensor, keep: float, training: bool) -> torch.Tensor:
    """``mask.bernoulli_(keep)`` as a dropout captured decomposed draws its mask (then divided by
    ``keep``); in evaluation every element is kept: ``keep`` everywhere, which the division
    makes 1."""
    return mask.bernoulli_(keep) if training else mask.fill_(keep)


def batch_norm(x, weight, bias, running_mean, running_var, train: bool, momentum: float, eps: float,
               training: bool):
    """``aten._native_batch_norm_legit_functional`` as captured in training (batch statistics,
    new running statistics); in evaluation, normalised by the running statistics, which it
    hands back unchanged."""
    if training:
        return torch.ops.aten._native_batch_norm_legit_functional.default(
            x, weight, bias, running_mean, running_var, train, momentum, eps)
    out, mean, rstd = torch.ops.aten._native_batch_norm_legit_no_training.default(
        x, weight, bias, running_mean, running_var, momentum, eps)
    return out, mean, rstd, running_mean, running_var
