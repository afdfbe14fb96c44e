"""FSDP's ``reshard_after_forward`` for the lowered graph: a sharded weight gathered for use is
not kept for backward but gathered again there.

Autograd keeps what an op needs for its backward; a matmul keeps its gathered weight, so
without this a plan that shards its parameters (FSDP, ZeRO-3) would hold every layer's full
weight from forward to backward — the memory the plan says it saves. The planner costs the
second gather (passes.build_problem, ``regather``) and counts the gathered weights alive at
once (the running layer's and the prefetched ones: ``memory.gathered_bytes``).

Lowering writes :meth:`WeightGathers.gather` where a weight (or its compute copy, or a view
of either) is gathered; the gathered tensor's storage is remembered (weakly). While the
lowered module runs forward, :meth:`WeightGathers.hooks` (torch's
``saved_tensors_hooks``) sees what autograd saves: a tensor on such a storage — the gathered
weight or a view of it — is saved as a recipe (its source and the view's geometry) and
gathered again when backward unpacks it (once for all the views saved of one gather), with
the rest of its layer and the layer before it (FSDP2's backward prefetch, :class:`_Layer`). A
ZeRO-2 parameter is gathered by a plain redistribute, not here: it is meant to stay whole
until backward.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

from autopar.passes import runtime

WEIGHT_GATHERS_ATTR = "_autopar_weight_gathers"


class _Gather:
    """One gather of a weight in forward, as backward needs it again: its recipe, how many
    saved tensors still want it, and the whole weight while more of them do (one re-gather
    serves every saved view of the weight). ``layer``: the gathers its layer read in forward,
    which backward gathers again together and ahead of need (:class:`_Layer`)."""

    def __init__(self, source: DTensor, mesh, spec: str, dtype: torch.dtype | None,
                 owner: "WeightGathers", layer: "_Layer") -> None:
        self.source, self.mesh, self.spec, self.dtype = source, mesh, spec, dtype
        self.owner, self.layer = owner, layer
        self.uses = 0  # saved tensors of this gather not yet unpacked
        self.whole: torch.Tensor | None = None  # the gathered local tensor, while wanted

    def issue(self, ahead: bool) -> None:
        """Gather the weight again (asynchronously where the plan overlaps: its local tensor
        waits where backward first reads it; on CPU meshes runtime._GatherNowReduceLater waits
        at once). ``ahead``: before any of its saved tensors is needed (counted, for tests)."""
        with torch.no_grad():
            self.whole = runtime.redistribute(self.source.detach(), self.mesh, self.spec, self.dtype,
                                              async_op=self.owner.overlap)._local_tensor
        self.owner.regathers["ahead" if ahead else "when_needed"] += 1

    def take(self) -> torch.Tensor:
        """The whole weight for one saved tensor (kept while more of them want it)."""
        if self.whole is None:
            self.issue(ahead=False)
        self.layer.needed(self.owner.prefetch_layers)
        whole = self.whole
        self.uses -= 1
        if self.uses <= 0:
            self.whole = None
        return whole


class _Layer:
    """The gathers of one layer's weights, in the order forward issued them, and the layer whose
    gathers forward issued first before them — FSDP2's backward prefetch: when backward first
    needs a weight of layer k, the rest of layer k's weights are gathered again and so are those
    of the ``prefetch_layers`` layers before it, so layer k − 1's all-gathers run while layer
    k's backward computes (issued asynchronously on NCCL meshes; on CPU meshes the gathers wait
    where issued — gloo's in-flight all-gather corrupts the heap, runtime._GatherNowReduceLater —
    so there only the order changes). The plan counts the weights held so (the layer and the
    ``prefetch_layers`` before it), as with forward's prefetch (passes.prefetch). Weights read outside every layer (an embedding,
    an LM head) make one such group per run of gathers."""

    def __init__(self, label: str | None, before: "_Layer | None") -> None:
        self.label, self.before = label, before
        self.gathers: list[_Gather] = []
        self.issued = False  # its weights were gathered again (backward needed them, or prefetched them)
        self.reached = False  # backward has needed one of its weights

    def needed(self, depth: int) -> None:
        """Backward reads a weight of this layer: gather the rest, then ``depth`` layers ahead
        (none with depth 0: every weight is gathered when it is needed)."""
        if self.reached or depth < 1:
            return
        self.reached = True
        layer: _Layer | None = self
        for _ in range(depth + 1):
            if layer is None:
                break
            if not layer.issued:
                layer.issued = True
                for gather in layer.gathers:
                    if gather.uses > 0 and gather.whole is None:
                        gather.issue(ahead=True)
            layer = layer.before


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

    def __init__(self, overlap: bool = True, prefetch_layers: int = 1) -> None:
        self.overlap = overlap
        self.prefetch_layers = prefetch_layers if overlap else 0  # backward's, as forward's (passes.prefetch)
        # storage address -> (the gathered local tensor, weakly; the gather)
        self._gathered: dict[int, tuple[weakref.ref, _Gather]] = {}
        self._layers: dict[str, _Layer] = {}  # this forward's gathers by the layer that reads them
        self._last: _Layer | None = None  # the group of the gather this forward issued last
        self._newest: _Layer | None = None  # the group this forward made last
        self.regathers: Counter[str] = Counter()  # backward's gathers: "ahead" of need, "when_needed"

    def gather(self, source: DTensor, mesh, spec: str, dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, layer: str | None = None) -> DTensor:
        """``source`` redistributed to ``spec`` (a gather), remembered so autograd does not keep
        it. Mixed precision: ``source`` is the fp32 master, cast to ``dtype`` before the gather,
        its gradient reduced in ``reduce_dtype`` (runtime.redistribute). The gather is issued
        asynchronously (FSDP2's): it runs while the ops before its first reader compute
        (passes.prefetch moves it a layer ahead), and its backward's reduce-scatter runs while
        backward computes the earlier layers (passes.grad_sync waits for it) — unless the
        plan was made without overlap. (On CPU meshes the gather itself is waited for where it
        is issued: runtime._GatherNowReduceLater says why.) ``layer``: the layer of the op that
        reads the weight, which backward gathers again as one (:class:`_Layer`)."""
        out = runtime.redistribute(source, mesh, spec, dtype, reduce_dtype, async_op=self.overlap)
        local = _buffer(out._local_tensor)
        group = self._layers.get(layer) if layer is not None else \
            self._last if self._last is not None and self._last.label is None else None
        if group is None:
            group = self._newest = _Layer(layer, self._newest)
            if layer is not None:
                self._layers[layer] = group
        self._last = group
        record = _Gather(source, mesh, spec, dtype, self, group)
        group.gathers.append(record)
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
        self._layers.clear()
        self._last = self._newest = None


def _buffer(local: torch.Tensor) -> torch.Tensor:
    """The tensor holding a local piece's memory: an ``AsyncCollectiveTensor`` (a collective
    still in flight, or a view of one) wraps the buffer the collective writes."""
    return local.elem if isinstance(local, AsyncCollectiveTensor) else local


def install(module: torch.nn.Module, gathers: WeightGathers) -> None:
    """Run ``module``'s forward under ``gathers``' hooks (entered before, left after, also when
    forward raises)."""
    active: list = []

    def enter(_module, _args):
        gathers.forget()  # what a recomputed layer gathered in the last backward
        context = gathers.hooks()
        context.__enter__()
        active.append(context)

    def leave(_module, _args, _output):
        gathers.forget()
        if active:
            active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
