"""The plan at input shapes other than the planned ones: the last partial batch of an epoch,
evaluation at another batch size.

A plan's placements do not depend on the batch size, but the lowered program does (the
exported graph's views hold the planned shapes, and its inputs are guarded to them). So a call
with other input shapes captures the model again at those shapes, on a fake copy made when
the plan was applied (fake tensors, no weights copied; the user's model may be gone or changed
by then); checks that it is the planned graph (the same nodes and ops, only sizes differ) and
that every dim the plan shards still divides over its devices; and lowers the plan onto it
with the very parameters and buffers of the first lowering, so an optimizer's parameters,
their gradients and the gradient synchronisation are shared. Each shape is lowered once and
kept.

    >>> pmodel = autopar.apply(model, plan_at_batch_8)   # 4 ranks, batch split 4 ways  # doctest: +SKIP
    >>> pmodel(x[:4])    # lowered again for 4 rows, then kept  # doctest: +SKIP
    >>> pmodel(x[:6])    # refused: "... splits over 4 devices ...; use sizes that divide by 4"  # doctest: +SKIP

Bags of varying size are the exception: their ids' count changes with every batch, and the
lowered program reads it from the ids as they come (passes.bag_runtime.id_count), so a call
whose only other sizes are id counts runs the first lowering (:meth:`Relowering.module_for`).

Every rank must call with the same shapes (lowering creates no process group, but the
collectives of the new program are matched rank by rank).
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from autopar import placements as pl
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.passes.capture import Captured, capture, compute_dtype_of
from autopar.passes.embedding_bag import count_free_inputs, id_indexed, literals_but_id_counts
from autopar.passes.lower import lower

log = logging.getLogger(__name__)


def fake_copy(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are fake tensors on their own devices
    (torch's ``FakeCopyMode``: no data copied). Not a ``meta`` copy: kernels on ``meta`` may
    give other strides than the model's device (SDPA's output does), and export then inserts
    other copies — another graph. None when the model cannot be copied (then other shapes are
    refused with a clear error instead)."""
    try:
        with FakeCopyMode(FakeTensorMode(allow_non_fake_inputs=True)):
            return copy.deepcopy(model)
    except Exception as exc:  # any attribute may refuse to be copied; we only lose other shapes
        log.info("no fake copy of %s (%s: %s): it will run at its planned input shapes only",
                 type(model).__name__, type(exc).__name__, exc)
        return None


def shapes_of(inputs: tuple) -> tuple:
    """The key a lowering is kept under: every input's shape and dtype."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (None, type(x)) for x in inputs)


def structure(graph: torch.fx.Graph) -> list[tuple[str, str, str]]:
    """The graph without its sizes: every node's kind, name and target."""
    return [(node.op, node.name, str(node.target)) for node in graph.nodes]


class Relowering:
    """Lowers one plan at the input shapes it is called with, reusing a first lowering's state."""

    def __init__(self, plan: Plan, mesh: DeviceMesh, model: nn.Module, captured: Captured) -> None:
        self.plan = plan
        self.mesh = mesh
        self.model = fake_copy(model)
        self.structure = structure(captured.graph)
        self.by_shapes: dict[tuple, torch.fx.GraphModule] = {}
        self.planned_sizes = {node.name: tuple(node.meta["val"].shape) for node in captured.graph.nodes
                              if isinstance(node.meta.get("val"), torch.Tensor)}
        free = count_free_inputs(captured.graph)  # ids whose count the lowered program reads as they come
        self.any_id_count = {k for k, spec in enumerate(plan.inputs) if spec.name in free}
        self.literals = literals_but_id_counts(captured.graph) if self.any_id_count else []
        self.count_free: bool | None = None  # checked by a trace at the first other id count

    def module_for(self, inputs: tuple, lowered: nn.Module) -> torch.fx.GraphModule:
        """The planned program (``lowered.lowered[0]``) at the planned shapes, else the plan
        lowered at these shapes, once per shape."""
        key = shapes_of(inputs)
        shapes = [shape for shape, _ in key]
        if shapes == [tuple(spec.shape) for spec in self.plan.inputs]:
            return lowered.lowered[0]
        if self._planned_shapes(shapes) and self._count_free(inputs):
            return lowered.lowered[0]
        if key not in self.by_shapes:
            self.by_shapes[key] = self.lower(inputs, lowered)
        return self.by_shapes[key]

    def _planned_shapes(self, shapes: list) -> bool:
        """Whether inputs of ``shapes`` run the planned program: the planned shapes, but for
        the count of ids in bags of varying size (any count; bags split by bags)."""
        planned = [tuple(spec.shape) for spec in self.plan.inputs]
        return len(shapes) == len(planned) and all(
            given == want or (k in self.any_id_count and given is not None and len(given) == len(want) == 1)
            for k, (given, want) in enumerate(zip(shapes, planned)))

    def _count_free(self, inputs: tuple) -> bool:
        """Whether the planned program serves other id counts: checked once, by tracing the
        model at these inputs (the same graph, and no id count held anywhere but where
        lowering reads it from the ids: passes.embedding_bag.literals_but_id_counts). When not,
        every shape is lowered again, as any other."""
        if self.count_free is None:
            self.count_free = False
            if self.model is not None:
                captured = capture(self.model, inputs, compute_dtype_of(self.plan))
                self.count_free = (structure(captured.graph) == self.structure
                                   and literals_but_id_counts(captured.graph) == self.literals)
            if not self.count_free:
                log.info("the model holds a batch's id count outside its bags' lowering: every id count is lowered "
                         "again")
        return self.count_free

    def lower(self, inputs: tuple, lowered: nn.Module) -> torch.fx.GraphModule:
        """The plan lowered for ``inputs``' shapes; ``lowered`` holds the first lowering's
        parameters and buffers (the ``ParallelModule``)."""
        planned = ", ".join(str(tuple(spec.shape)) for spec in self.plan.inputs)
        given = ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs)
        if self.model is None:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"this plan was made for inputs of shapes {planned}, called with {given}; the model "
                               "could not be copied to lower it again, so it runs at its planned shapes only: "
                               "call it with those shapes, or plan at these")
        if len(inputs) != len(self.plan.inputs) or not all(isinstance(x, torch.Tensor) for x in inputs):
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"this plan takes {len(self.plan.inputs)} tensor input(s) shaped {planned}; "
                               f"called with {given}")
        try:
            captured = capture(self.model, inputs, compute_dtype_of(self.plan))
        except AutoparError as exc:
            raise AutoparError(exc.kind, f"planned for inputs {planned}, called with {given}: {exc}") from exc
        if structure(captured.graph) != self.structure:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"this plan was made for inputs of shapes {planned}; at {given} the model traces to "
                               "another graph (its code depends on the sizes), so the plan does not apply: "
                               "re-plan at these shapes")
        self._check_divisible(captured, given)
        log.info("lowering the plan again for inputs %s (planned at %s)", given, planned)
        return lower(captured, self.plan, self.mesh, lowered, same_graph=True)

    def _check_divisible(self, captured: Captured, given: str) -> None:
        """Every dim a node is split on divides evenly over the devices it is split over (not
        the first dim of a batch's ids in bags of varying size: it splits by bags, unevenly;
        the bags it pools into must divide)."""
        inputs = {spec.name for spec in self.plan.inputs}
        ids = id_indexed(captured.graph)
        for node in captured.graph.nodes:
            planned = self.plan.nodes.get(node.name)
            val = node.meta.get("val")
            if node.name in ids:
                continue
            if planned is None or not isinstance(val, torch.Tensor) or not planned.outputs or not planned.outputs[0]:
                continue
            spec = pl.parse_spec(planned.outputs[0])
            for dim in sorted({p.dim for p in spec if isinstance(p, pl.Shard) and p.dim < val.dim()}):
                devices = pl.split_over(spec, self.plan.mesh_shape, dim)
                unchanged = self.planned_sizes.get(node.name, ())[dim:dim + 1] == (val.shape[dim],)
                if val.shape[dim] % devices and not unchanged:
                    what = f"input {node.name}" if node.name in inputs else f"node {node.name} ({node.target})"
                    raise AutoparError(
                        ErrorKind.BAD_INPUT,
                        f"called with inputs {given}: {what} has size {val.shape[dim]} on dim {dim}, which the plan "
                        f"splits over {devices} devices ({planned.outputs[0]}); use sizes that divide by {devices} "
                        f"(e.g. {math.ceil(val.shape[dim] / devices) * devices}), or re-plan at these shapes")
