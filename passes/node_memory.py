"""Bytes one device holds for a problem node under each of its strategies: a parameter's
master weight, gradient, optimizer states and working copy; an op's activations kept for
backward, with or without recomputation; the loss's on the outputs. passes.build_problem puts
them in the problem.

A parameter's bytes divide by how its placement splits it, except where ZeRO-2 keeps it whole
for use (its working copy) while the master, gradient and states are split
(``Strategy.state``). Under mixed precision the master, gradient and states are fp32 and the
working copy is in the compute dtype; without it, the parameter is its own working copy, and
only a ZeRO-2 parameter holds a second (the gathered one).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from autopar import placements as pl
from autopar.passes.cost import tensor_bytes
from autopar.passes.stages import node_layer
from autopar.passes.strategies import Strategy, evenly_sharded, output_vals

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}  # states each optimizer keeps per weight


@dataclass(frozen=True)
class ParameterBytes:
    """One device's bytes of a parameter under one strategy."""

    master: int  # the weight the optimizer updates (fp32 under mixed precision)
    grad: int
    states: int  # every optimizer state together (Adam: two)
    working: int  # the copy compute reads, beside the master (mixed precision, ZeRO-2); else 0

    @property
    def total(self) -> int:
        return self.master + self.grad + self.states + self.working


def parameter_bytes(val: torch.Tensor, strategy: Strategy, mesh_shape: tuple[int, ...], states: int,
                    master_itemsize: int | None, stored_divisor: int | None = None,
                    trainable: bool = True) -> ParameterBytes:
    """``master_itemsize``: bytes per element of the fp32 master under mixed precision, else
    None. ``stored_divisor`` overrides how many devices the master, gradient and states are
    divided over (a table-wise bound counts tables whole). A frozen parameter (not
    ``trainable``) has no gradient and no optimizer state."""
    used = pl.divided_over(strategy.outputs[0], mesh_shape)
    stored = stored_divisor or pl.divided_over(strategy.stored, mesh_shape)
    keep = 1 if trainable else 0
    if master_itemsize:
        master = val.numel() * master_itemsize // stored
        return ParameterBytes(master, keep * master, keep * states * master, tensor_bytes(val) // used)
    own = tensor_bytes(val) // stored
    working = tensor_bytes(val) // used if strategy.state is not None else 0
    return ParameterBytes(own, keep * own, keep * states * own, working)


def zero_twins(options: list[Strategy], val: torch.Tensor, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """ZeRO-2 twins of a parameter's strategies: used as the strategy places it, master,
    gradient and optimizer states split over the mesh dims it is replicated on (each one, and
    all together), along the first tensor dim that splits evenly."""
    twins = []
    for option in options:
        spec = option.outputs[0]
        if pl.O in spec or pl.D in spec:  # an expert's weight on its owner: its states stay with it
            continue
        whole = [d for d, p in enumerate(spec) if p is pl.R]
        for dims in [(d,) for d in whole] + ([tuple(whole)] if len(whole) > 1 else []):
            state = _split_on(val, spec, dims, mesh_shape)
            if state is not None:
                twins.append(Strategy(option.outputs, option.inputs, option.exchange, state))
    return twins


def _split_on(val: torch.Tensor, spec: pl.Spec, dims: tuple[int, ...], mesh_shape: tuple[int, ...]
              ) -> pl.Spec | None:
    for tensor_dim in range(val.dim()):
        state = spec
        for d in dims:
            state = pl.with_dim(state, d, pl.Shard(tensor_dim))
        if evenly_sharded(val.shape, state, mesh_shape):
            return state
    return None


# A training step's loss on the outputs keeps, beside the outputs themselves (passes.memory
# counts them, in their own dtype), a copy of each floating output for backward
# (cross-entropy's log-softmax, in the outputs' dtype), and backward starts from a gradient of
# the same size: both are held at the step's peak. Measured on a lowered GPT at the start of
# backward (tests/test_recompute.py): outputs + one copy, in fp32 and in bf16.
LOSS_COPIES = 2


def loss_bytes(outputs: list[torch.fx.Node], sink: Strategy, mesh_shape: tuple[int, ...]) -> int:
    """Bytes one device holds for the loss on the graph's outputs, beyond the outputs kept,
    delivered as ``sink`` places them (split outputs: each device its part)."""
    total = 0
    for node, spec in zip(outputs, sink.inputs):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            total += val.numel() * LOSS_COPIES * val.element_size() // pl.divided_over(spec, mesh_shape)
    return total


def kept_bytes(node: torch.fx.Node, strategy: Strategy, saved: list[bool], mesh_shape: tuple[int, ...],
               copies: int) -> int:
    """Bytes of ``node``'s outputs autograd keeps for backward (``saved``, from
    passes.memory), by their placement, for ``copies`` micro-batches in flight."""
    return copies * sum(tensor_bytes(v) // pl.divided_over(p, mesh_shape)
                        for v, p, keep in zip(output_vals(node), strategy.outputs, saved)
                        if keep and p is not None and isinstance(v, torch.Tensor))


def leaving_bytes(node: torch.fx.Node, strategy: Strategy, layer: str, mesh_shape: tuple[int, ...],
                  copies: int) -> int:
    """Bytes a checkpointed ``layer`` keeps of ``node``: its outputs when read outside the
    layer (the next layer's input), else nothing."""
    return output_bytes(node, strategy, mesh_shape, copies) if leaves_layer(node, layer) else 0


def output_bytes(node: torch.fx.Node, strategy: Strategy, mesh_shape: tuple[int, ...], copies: int) -> int:
    """Bytes of all of ``node``'s tensor outputs by their placement, for ``copies`` micro-batches:
    what selective checkpointing caches of an op it saves (whether or not autograd would)."""
    return copies * sum(tensor_bytes(v) // pl.divided_over(p, mesh_shape)
                        for v, p in zip(output_vals(node), strategy.outputs)
                        if p is not None and isinstance(v, torch.Tensor))


def leaves_layer(node: torch.fx.Node, layer: str) -> bool:
    """Whether a value of ``node`` is read outside ``layer`` (through getitems too): a
    checkpointed layer keeps exactly those."""
    for user in node.users:
        if user.op != "call_function" or (node_layer(user) != layer and user.target is not operator.getitem):
            return True
        if user.target is operator.getitem and leaves_layer(user, layer):
            return True
    return False
