"""Weights of a model built on the ``meta`` device, made real one module at a time.

A model too large for one process is built under ``torch.device("meta")`` (no memory) and
planned as usual. At ``apply`` every rank needs only its shards. As FSDP2 does, each module
is given real, empty storage (``to_empty``) and runs its own ``reset_parameters()``; here
one module at a time, in the model's module order, on every rank: the module's full weights
exist only while they are cut into this rank's shards and are then released, so a rank's
peak is its shards plus the largest single module. Seeded like the single-process model
(``torch.manual_seed`` before both), the weights equal what that model would have drawn:
the modules draw in the same order as they did at construction.

A module that owns parameters or buffers but has no ``reset_parameters()`` cannot be
initialised this way; :func:`check_initialisable` names it before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from autopar.errors import AutoparError, ErrorKind


def on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def check_initialisable(model: nn.Module) -> None:
    """Raise BAD_INPUT naming every module whose meta weights nothing can initialise."""
    missing = [f"{name or '(root)'} ({type(module).__name__}: {', '.join(_own(module))})"
               for name, module in model.named_modules() if _own(module) and not hasattr(module, "reset_parameters")]
    if missing:
        raise AutoparError(ErrorKind.BAD_INPUT,
                           "the model is on the meta device, but these modules own weights and have no "
                           f"reset_parameters() to initialise them: {'; '.join(missing)}. Fixes: 1) give each a "
                           "reset_parameters() that initialises its own parameters and buffers in place; 2) build "
                           "the model on a real device")


def _own(module: nn.Module) -> list[str]:
    """Names of the meta parameters and buffers ``module`` holds itself (not its children's)."""
    return [name for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            if t is not None and t.device.type == "meta"]


def materialized(model: nn.Module, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """For each module with meta weights, in module order: its parameters and buffers by FQN,
    real and initialised, valid until the next item is asked for (then returned to meta)."""
    for prefix, module in model.named_modules():
        names = _own(module)
        if not names:
            continue
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            module.reset_parameters()
        tensors = dict(module.named_parameters(recurse=False))
        tensors.update({k: v for k, v in module.named_buffers(recurse=False) if v is not None})
        yield {f"{prefix}.{name}" if prefix else name: tensors[name] for name in names}
        module.to_empty(device="meta", recurse=False)  # release the full weights
