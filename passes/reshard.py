"""FSDP's ``reshard_after_forward`` for the lowered graph: a sharded weight gathered for use is
not kept for backward but gathered again there.

Autograd keeps what an op needs for its backward; a matmul keeps its gathered weight, so
without this a plan that shards its parameters (FSDP, ZeRO-3) would hold every layer's full
weight from forward to backward — the memory the plan says it saves. The planner costs the
second gather (passes.build_problem, ``regather``) and counts no gathered weight in memory.

Lowering writes :meth:`WeightGathers.gather` where a weight (or its compute copy, or a view
of either) is gathered; the gathered tensor's storage is remembered (weakly). While the
lowered module runs forward, :meth:`WeightGathers.hooks` (torch's
``saved_tensors_hooks``) sees what autograd saves: a tensor on such a storage — the gathered
weight or a view of it — is saved as a recipe (its source and the view's geometry) and
gathered again when backward unpacks it (once for all the views saved of one gather). A
ZeRO-2 parameter is gathered by a plain redistribute, not here: it is meant to stay whole
until backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from autopar.passes import runtime

WEIGHT_GATHERS_ATTR = "_autopar_weight_gathers"


class _Gather:
    """One gather of a weight in forward, as backward needs it again: its recipe, how many
    saved tensors still want it, and the whole weight while more of them do (one re-gather
    serves every saved view of the weight). The re-gather is synchronous: issued
    asynchronously a weight ahead (FSDP2's backward prefetch) it corrupted gloo's heap now and
    then on 4 ranks (malloc: unaligned chunk; 2 of 6 runs of test_any_batch), so backward
    gathers each freed weight when it needs it."""

    def __init__(self, source: DTensor, mesh, spec: str, dtype: torch.dtype | None) -> None:
        self.source, self.mesh, self.spec, self.dtype = source, mesh, spec, dtype
        self.uses = 0  # saved tensors of this gather not yet unpacked
        self.whole: torch.Tensor | None = None  # the gathered local tensor, while wanted

    def take(self) -> torch.Tensor:
        """The whole weight for one saved tensor (kept while more of them want it)."""
        if self.whole is None:
            with torch.no_grad():
                self.whole = runtime.redistribute(self.source.detach(), self.mesh, self.spec,
                                                  self.dtype)._local_tensor
        whole = self.whole
        self.uses -= 1
        if self.uses <= 0:
            self.whole = None
        return whole


@dataclass(frozen=True)
class _Regather:
    """How to rebuild a saved tensor: gather its weight again and view its piece as saved."""

    gather: _Gather
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    placements: tuple
    shape: torch.Size
    global_stride: tuple[int, ...]

    def rebuild(self) -> DTensor:
        local = self.gather.take().as_strided(self.size, self.stride, self.offset)
        return DTensor.from_local(local, self.gather.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.global_stride)


@dataclass(frozen=True)
class _OuterPacked:
    """What the caller's own pack hook made of a saved tensor."""

    value: object


class WeightGathers:
    """The weights gathered during one forward, and the saved-tensor hooks that drop them.
    ``overlap``: the gathers and their gradients' reduce-scatters are issued asynchronously
    (off: each waited for where it is issued — a plan made with ``overlap=False``)."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap
        # storage address -> (the gathered local tensor, weakly; the gather)
        self._gathered: dict[int, tuple[weakref.ref, _Gather]] = {}

    def gather(self, source: DTensor, mesh, spec: str, dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None) -> DTensor:
        """``source`` redistributed to ``spec`` (a gather), remembered so autograd does not keep
        it. Mixed precision: ``source`` is the fp32 master, cast to ``dtype`` before the gather,
        its gradient reduced in ``reduce_dtype`` (runtime.redistribute). The gather is issued
        asynchronously (FSDP2's): it runs while the ops before its first reader compute
        (passes.prefetch moves it a layer ahead), and its backward's reduce-scatter runs while
        backward computes the earlier layers (passes.grad_sync waits for it) — unless the
        plan was made without overlap. (On CPU meshes the gather itself is waited for where it
        is issued: runtime._GatherNowReduceLater says why.)"""
        out = runtime.redistribute(source, mesh, spec, dtype, reduce_dtype, async_op=self.overlap)
        local = _buffer(out._local_tensor)
        record = _Gather(source, mesh, spec, dtype)
        self._gathered[local.untyped_storage().data_ptr()] = (weakref.ref(local), record)
        return out

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for one forward, on top of the caller's own (activation offloading, a
        measurement), which still see every other saved tensor."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(saved: torch.Tensor):
            recipe = self._recipe(saved)
            if recipe is not None:
                return recipe
            return _OuterPacked(outer_pack(saved)) if outer_pack is not None else saved

        def unpack(packed):
            if isinstance(packed, _Regather):
                return packed.rebuild()
            return outer_unpack(packed.value) if isinstance(packed, _OuterPacked) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _recipe(self, saved: torch.Tensor) -> _Regather | None:
        if not isinstance(saved, DTensor):
            return None
        local = _buffer(saved._local_tensor)
        found = self._gathered.get(local.untyped_storage().data_ptr())
        # alive: the storage is still the gathered one (a freed one's address may be reused)
        if found is None or found[0]() is None:
            return None
        gather = found[1]
        gather.uses += 1
        return _Regather(gather, tuple(local.size()), tuple(local.stride()), local.storage_offset(),
                         tuple(saved.placements), saved.shape, tuple(saved.stride()))

    def forget(self) -> None:
        """Drop the record of this forward's gathers (the recipes already packed keep theirs)."""
        self._gathered.clear()


def _buffer(local: torch.Tensor) -> torch.Tensor:
    """The tensor holding a local piece's memory: an ``AsyncCollectiveTensor`` (a collective
    still in flight, or a view of one) wraps the buffer the collective writes."""
    return local.elem if isinstance(local, AsyncCollectiveTensor) else local


def install(module: torch.nn.Module, gathers: WeightGathers) -> None:
    """Run ``module``'s forward under ``gathers``' hooks (entered before, left after, also when
    forward raises)."""
    active: list = []

    def enter(_module, _args):
        context = gathers.hooks()
        context.__enter__()
        active.append(context)

    def leave(_module, _args, _output):
        gathers.forget()
        if active:
            active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
