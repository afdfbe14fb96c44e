"""What ``parallelize`` and ``apply`` return: the lowered model on this rank, with one
training API for every plan.

``pmodel(*inputs)`` returns the full outputs on every rank; ``pmodel.step(*inputs,
target=t)`` runs forward and backward (over the plan's micro-batches when it has pipeline
stages) and returns the loss on every rank, leaving gradients on ``pmodel.parameters()`` for
any torch optimizer. Without stages, ``step`` is ``loss_fn(outputs, t).backward()`` on the
outputs as the plan leaves them: a one-mesh plan may keep them split along the batch dim
(``plan.outputs``; each device then computes the loss on its rows, as DDP does —
passes.split_loss — and no device holds all the logits), while ``pmodel(*inputs)`` always
gathers them whole (evaluation).
Parameters keep the model's own names (``blocks.0.qkv.weight``); under a pipeline plan a
rank holds only its stage's parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from autopar.errors import AutoparError, ErrorKind
from autopar.passes.row_order_checkpoint import mark_state_dict, watch_optimizers
from autopar.passes.runtime import ROW_ORDER_ATTR, to_full
from autopar.passes.split_loss import (
    averages_over_rows, batch_split, local_loss, local_outputs, local_rows, split_tensor_dims)
from autopar.plan import Plan

log = logging.getLogger(__name__)
_MISSING = object()  # an input the caller did not give


class ParallelModule(nn.Module):
    def __init__(self, module: torch.fx.GraphModule, plan: Plan, loss_fn: Callable | None = None,
                 runtime=None, relowering=None, pieces: list[torch.fx.GraphModule] | None = None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        # share the lowered module's children, parameters and buffers so names stay the model's
        self._modules = module._modules
        self._parameters = module._parameters
        self._buffers = module._buffers
        # the lowered programs this rank runs — ``module``, or a pipeline rank's stages when it
        # holds several (interleaved) and ``module`` merely holds their parameters; in a list:
        # not registered as children (that would prefix every name)
        self.lowered = list(pieces) if pieces else [module]
        self.plan = plan
        self.loss_fn = loss_fn
        # where this rank's tensors live (its meshes' device): inputs and targets given
        # elsewhere (a CPU batch, a CUDA model) are moved here before they are used
        self.device = torch.device("cpu") if device is None else device
        # how a plan over several device groups runs a step: passes.pipeline_lower.PipelineRuntime
        # (stages) or passes.replica_lower.ReplicaRuntime (data-parallel replicas); None: one mesh
        self.runtime = runtime
        self._averages: bool | None = None  # whether loss_fn averages over rows (passes.split_loss)
        # lowers the plan at other input shapes and keeps each (passes.relower.Relowering)
        self.relowering = relowering
        # watches the links between the plan's device groups after each step (autopar.watch_links)
        self.watcher = None
        # stacked experts stored in a balanced order: checkpointed in the model's order
        if any(hasattr(p, ROW_ORDER_ATTR) for p in self.parameters()):
            self.register_state_dict_post_hook(mark_state_dict)
            watch_optimizers()

    def train(self, mode: bool = True) -> "ParallelModule":
        """As ``nn.Module.train``, and the lowered programs too (not registered children): their
        dropout and batch norm follow the mode (passes.lower), as the model's own would."""
        super().train(mode)
        for piece in self.lowered:  # the flag itself: torch.export's module refuses train()
            piece.training = mode
        return self

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer this rank holds, whole: sharded ones gathered, an expert
        weight that lives on its owner sent from there — a checkpoint one rank can save with
        ``torch.save``. Collective: every rank calls it (tied weights appear under each name)."""
        from autopar.passes.runtime import full_value

        state = {name: full_value(p).detach() for name, p in self.named_parameters(remove_duplicate=False)}
        state.update({name: full_value(b) for name, b in self.named_buffers()})
        return state

    @property
    def code(self) -> str:
        """The lowered graph's code on this rank (its stages', under a pipeline plan)."""
        return "\n".join(piece.code for piece in self.lowered)

    def _lowered_for(self, inputs: tuple) -> torch.fx.GraphModule:
        """The lowered program for these inputs' shapes: the planned one, or the plan lowered
        again at these shapes (once per shape; passes.relower)."""
        module = self.lowered[0] if self.relowering is None else self.relowering.module_for(inputs, self)
        module.training = self.training  # one lowered again since the mode was last set follows it too
        return module

    def _check_runtime_shapes(self, inputs: tuple) -> None:
        """Plans over several device groups run at their planned inputs only (each group's
        graph, a pipeline's micro-batches, are made for them): a clear error for other shapes."""
        scale = self.plan.micro_batches if self.plan.stages else 1  # a pipeline plan's inputs: one micro-batch
        planned = [(spec.shape[0] * scale, *spec.shape[1:]) if spec.shape else () for spec in self.plan.inputs]
        given = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs]
        if given != planned:
            kind = (f"pipeline stages ({len(self.plan.stages)} stages, {self.plan.micro_batches} micro-batches)"
                    if self.plan.stages else f"{len(self.plan.replicas)} data-parallel replica groups")
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"this plan has {kind}: it runs at its planned inputs {planned} only, called with "
                               f"{given}; call it with those shapes, or plan again at these (one-mesh plans run at "
                               "any batch that divides over their devices)")

    def _positional(self, inputs: tuple, named: dict) -> tuple:
        """``inputs`` with keyword inputs (``pmodel(input_ids=..., attention_mask=...)``) put in
        the places the plan's inputs have (they carry the model's argument names)."""
        if not named:
            return inputs
        names = [spec.name for spec in self.plan.inputs]
        given: list = [*inputs, *[_MISSING] * (len(names) - len(inputs))]
        for name, value in named.items():
            if name not in names:
                raise AutoparError(ErrorKind.BAD_INPUT, f"{name}= is not an input this plan was made with (its inputs, "
                                   f"in order: {', '.join(names)}); plan the model with it as an example input")
            if names.index(name) < len(inputs):
                raise AutoparError(ErrorKind.BAD_INPUT, f"{name} is given twice: by position and as {name}=")
            given[names.index(name)] = value
        missing = [name for name, value in zip(names, given) if value is _MISSING]
        if missing:
            raise AutoparError(ErrorKind.BAD_INPUT, f"the plan's inputs {', '.join(missing)} are not given (its "
                               f"inputs, in order: {', '.join(names)})")
        return tuple(given)

    def forward(self, *inputs, **named):
        inputs = on_device(self._positional(inputs, named), self.device)
        if self.runtime is None:
            return tree_map(to_full, self._lowered_for(inputs)(*inputs))
        self._check_runtime_shapes(inputs)
        with torch.no_grad():
            return self.runtime.evaluate(inputs)

    def step(self, *inputs, target=None, **named) -> torch.Tensor:
        """One forward and backward; returns the (detached) loss, the same on every rank.
        Inputs by position, or by the model's argument names as the plan recorded them."""
        loss = self._step(self._positional(inputs, named), target)
        if self.watcher is not None:
            self.watcher.after_step()
        return loss

    def _step(self, inputs: tuple, target) -> torch.Tensor:
        if self.loss_fn is None:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               "step() needs a loss function: pass loss_fn=fn (fn(output, target) -> scalar) to "
                               "autopar.parallelize(...) or autopar.apply(...)")
        inputs, target = on_device((inputs, target), self.device)
        if self.runtime is not None:
            self._check_runtime_shapes(inputs)
            return self.runtime.train_step(inputs, target)
        outputs = self._lowered_for(inputs)(*inputs)
        split = batch_split(outputs, target)
        if split is not None and self._averages is None:  # checked once: is it a mean over the split dims?
            local, rows = local_outputs(outputs), local_rows(target, split[0])
            self._averages = all(averages_over_rows(self.loss_fn, local, rows, dim)
                                 for dim in split_tensor_dims(*split))
            if not self._averages:
                log.warning("loss_fn is not a mean over the batch (a row twice changes its value): it runs "
                            "on the whole outputs, gathered on every device")
        if split is not None and self._averages:
            backward_from, loss = local_loss(self.loss_fn, outputs, target, *split)
            backward_from.backward()
            return loss
        loss = self.loss_fn(tree_map(to_full, outputs), target)
        loss.backward()
        return loss.detach()


def on_device(values, device: torch.device):
    """``values`` (tensors in any nesting) with every tensor on ``device``: moved where it is
    elsewhere (onto a GPU asynchronously: a copy off one must complete before it is read),
    itself where it is there already."""
    ahead = device.type == "cuda"
    return tree_map(lambda v: v.to(device, non_blocking=ahead) if isinstance(v, torch.Tensor) and v.device != device
                    else v, values)
