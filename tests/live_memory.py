"""What a training step really holds for backward, on CPU (no allocator statistics there): every
storage the step's ops create is watched through a weak reference, and the bytes still alive
when backward starts are what forward — and the loss — handed to backward. Unlike
saved-tensor hooks this also sees what selective checkpointing caches in its own storage."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# ops that make a weight's working copy (mixed precision): their outputs are weights, not activations
_CASTS = (torch.ops.aten._to_copy.default,)


def _plain(t) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (a DTensor's local shard, an async collective's result)."""
    if not isinstance(t, torch.Tensor):
        return []
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _plain(getattr(t, name))]
    return [t]


def _pointers(tensors) -> set[int]:
    return {p.untyped_storage().data_ptr() for t in tensors for p in _plain(t)}


class HeldAtBackward(TorchDispatchMode):
    """Inside it, every storage an op makes is watched; ``held_bytes`` is set when the first op
    of backward runs: the bytes of those storages still alive then, each storage once, the
    ``weights`` (tensors) and casts of them left out."""

    def __init__(self, weights) -> None:
        super().__init__()
        self.weights = _pointers(weights)
        self.made = WeakIdKeyDictionary()  # storage -> its bytes, while it lives
        self.held_bytes: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.held_bytes is None and torch._C._current_graph_task_id() != -1:  # backward has begun
            self.held_bytes = sum(n for storage, n in self.made.items() if storage.data_ptr() not in self.weights)
        out = func(*args, **(kwargs or {}))
        cast_of_weight = func in _CASTS and bool(_pointers(tree_flatten(args)[0]) & self.weights)
        for tensor in tree_flatten(out)[0]:
            for plain in _plain(tensor):
                storage = plain.untyped_storage()
                if cast_of_weight:
                    self.weights.add(storage.data_ptr())
                elif storage.data_ptr() not in self.weights:
                    self.made[storage] = storage.nbytes()
        return out


def held_for_backward(pmodel, *inputs, target) -> int:
    """Bytes ``pmodel.step(*inputs, target=target)`` holds when its backward starts, on this rank."""
    watch = HeldAtBackward(list(pmodel.parameters()))
    with watch:
        pmodel.step(*inputs, target=target)
    assert watch.held_bytes is not None, "the step ran no backward"
    return watch.held_bytes


class PeakGathered(TorchDispatchMode):
    """Inside it, the storages all-gathers make are watched; ``peak_bytes`` is the most bytes of
    them alive at once, looked at around every op (forward and backward): the weights an FSDP
    step holds gathered, which the plan counts as ``memory.gathered_bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.made = WeakIdKeyDictionary()  # storage -> its bytes, while it lives
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._look()
        out = func(*args, **(kwargs or {}))
        if "all_gather" in func.name():
            for tensor in tree_flatten(out)[0]:
                for plain in _plain(tensor):
                    storage = plain.untyped_storage()
                    self.made[storage] = storage.nbytes()
        self._look()
        return out

    def _look(self) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(self.made.values()))
