"""Which layers a recompute mode checkpoints: the one reading of a mode that the problem
builder (what it costs), the plan (``plan.recompute``) and re-costing share.

Modes: ``"none"``; ``"selective"`` (every layer, matmul and attention outputs kept);
``"full"`` (every layer recomputed whole); ``"full:N"`` (every N-th layer recomputed whole,
the others keep their activations: torchtitan's layer-wise selective checkpointing,
``selective_ac_option = "N"``, which wraps the N-th, 2N-th, … block it meets);
``"block:K"`` (the first K layers recomputed whole, the rest keep their activations:
Megatron-LM's ``--recompute-method block --recompute-num-layers K``; in a pipeline, the first
K of each stage's layers, as Megatron counts them per stage). "auto" picks one of them
(planning.recompute_cut: a plan over one mesh may be cut from full to block:K).

>>> recomputed_layers(["blocks.0", "blocks.1", "blocks.2", "blocks.3"], "full:2")
{'blocks.1': 'full', 'blocks.3': 'full'}
>>> recompute_mode(["blocks.0", "blocks.1", "blocks.2", "blocks.3"], {'blocks.1': 'full', 'blocks.3': 'full'})
'full:2'
>>> recomputed_layers(["blocks.0", "blocks.1", "blocks.2", "blocks.3"], "block:3")
{'blocks.0': 'full', 'blocks.1': 'full', 'blocks.2': 'full'}
>>> recompute_mode(["blocks.0", "blocks.1", "blocks.2", "blocks.3"], {'blocks.0': 'full'})
'block:1'
"""

from __future__ import annotations

from collections.abc import Sequence

WHOLE_MODES = ("none", "selective", "full")  # modes that treat every layer alike


def layer_period(mode: str) -> int | None:
    """N of ``"full:N"`` (an integer ≥ 2), None for any other string."""
    head, _, tail = mode.partition(":")
    if head != "full" or not tail.isdigit() or int(tail) < 2:
        return None
    return int(tail)


def block_layers(mode: str) -> int | None:
    """K of ``"block:K"`` (an integer ≥ 1), None for any other string."""
    head, _, tail = mode.partition(":")
    if head != "block" or not tail.isdigit() or int(tail) < 1:
        return None
    return int(tail)


def is_recompute_mode(mode: object) -> bool:
    """A mode the planner can cost and lowering can run (``"auto"`` is not: it picks one)."""
    return isinstance(mode, str) and (mode in WHOLE_MODES or layer_period(mode) is not None
                                      or block_layers(mode) is not None)


def recomputed_layers(layers: Sequence[str], mode: str | None) -> dict[str, str]:
    """layer -> how it is recomputed ("full" or "selective") under ``mode``, for the layers
    (in the order the model runs them) that are; empty for "none", "auto" or None."""
    if mode in ("selective", "full"):
        return dict.fromkeys(layers, mode)
    first = block_layers(mode or "")
    if first is not None:
        return dict.fromkeys(layers[:first], "full")
    period = layer_period(mode or "")
    if period is None:
        return {}
    return {layer: "full" for k, layer in enumerate(layers) if (k + 1) % period == 0}


def recompute_mode(layers: Sequence[str], recomputed: dict[str, str]) -> str:
    """The mode whose :func:`recomputed_layers` is ``recomputed`` (a plan's record read back)."""
    if not recomputed:
        return "none"
    for mode in ("selective", "full"):
        if recomputed == recomputed_layers(layers, mode):
            return mode
    if recomputed == recomputed_layers(layers, f"block:{len(recomputed)}"):
        return f"block:{len(recomputed)}"
    for period in range(2, len(layers) + 1):
        if recomputed == recomputed_layers(layers, f"full:{period}"):
            return f"full:{period}"
    raise ValueError(f"layers recomputed as {recomputed} follow no recompute mode over {list(layers)}")


def recorded_mode(layer_groups: Sequence[Sequence[str]], recomputed: dict[str, str]) -> str:
    """The mode a plan's record ``recomputed`` was made with, where each group of layers applied
    it to its own layers (a one-mesh plan: one group; a pipeline: each stage's layers, so under
    "full:N" the N-th, 2N-th, … of each stage, under "block:K" the first K of each — all of a
    stage with K layers or fewer, which reads back as "full" there). ValueError where a group
    follows no mode or no mode explains every group."""
    records = _records(layer_groups, recomputed)
    modes = {recompute_mode(group, record) for group, record in zip(layer_groups, records)} - {"none"}
    for mode in sorted(modes, key=lambda m: m == "full"):  # a stage all recomputed may be "block:K"'s
        if all(record == recomputed_layers(group, mode) for group, record in zip(layer_groups, records)):
            return mode
    if not modes:
        return "none"
    raise ValueError(f"its layer groups recompute differently ({sorted(modes)})")


def group_modes(layer_groups: Sequence[Sequence[str]], recomputed: dict[str, str]) -> list[str]:
    """Each group's own mode (a pipeline's stages: under "auto" each recomputes only what its
    memory requires, so they may differ). ValueError where a group follows no mode."""
    return [recompute_mode(group, record) for group, record in zip(layer_groups, _records(layer_groups, recomputed))]


def _records(layer_groups: Sequence[Sequence[str]], recomputed: dict[str, str]) -> list[dict[str, str]]:
    """``recomputed`` split by group: each group's own layers' entries."""
    return [{layer: recomputed[layer] for layer in group if layer in recomputed} for group in layer_groups]
