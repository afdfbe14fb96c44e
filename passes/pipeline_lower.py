"""Lowering a pipeline plan onto torch.distributed.pipelining.

Every rank builds every stage's DeviceMesh and every lane's process group (group creation is
collective, so all ranks create them in the same order), then keeps its own stage: the
stage's piece of the graph (passes.stages), lowered onto the stage's mesh like a whole model
(passes.lower), wrapped in a ``PipelineStage`` that talks to the same lane of the
neighbouring stages. Lane ``k`` is the k-th device of every group. A boundary tensor is
whole on every device of its stage (stage outputs are gathered, as model outputs are), so
stages on differently shaped meshes connect; lane ``k`` sends only the k-th slice (of the
first dim that divides evenly) and
the receiving group all-gathers it, so each value crosses the link between groups once.

Gradients of a stage's parameters accumulate over the micro-batches (partial sums stay
partial) and are brought to their placements once, after the schedule's last backward.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autopar.plan import Plan
from autopar.passes.capture import Captured
from autopar.passes import runtime
from autopar.passes.grad_sync import sync_grads
from autopar.passes.recompute import checkpoint_layers
from autopar.passes.lower import group_meshes, lower_module, owner_submeshes
from autopar.passes.stages import assign_stages, layer_order, lane_slice_dim, split_graph

LANES_ATTR = "_autopar_lanes"
_SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


class PipelineRuntime:
    """This rank's stage and the schedule that runs it, micro-batch by micro-batch."""

    def __init__(self, module: torch.fx.GraphModule, stage_index: int, plan: Plan, lane: dist.ProcessGroup,
                 lane_ranks: list[int], example_inputs: tuple, example_outputs: tuple,
                 loss_fn: Callable | None, device: torch.device) -> None:
        self.module, self.lane, self.num_stages = module, lane, len(plan.stages)
        self.stage_index = stage_index
        self.last_rank = lane_ranks[-1]  # the lane's rank in the last stage
        stage = PipelineStage(module, stage_index, self.num_stages, device, input_args=example_inputs,
                              output_args=example_outputs, group=lane)
        schedule = _SCHEDULES[plan.schedule]
        self.schedule = schedule(stage, n_microbatches=plan.micro_batches, loss_fn=loss_fn)
        self.forward_only = schedule(stage, n_microbatches=plan.micro_batches)  # no loss: evaluation

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def train_step(self, inputs: tuple, target) -> torch.Tensor:
        """Forward and backward over all micro-batches; the mean micro-batch loss on every rank."""
        losses: list[torch.Tensor] = []
        if self.is_first:
            self.schedule.step(*inputs)
        elif self.is_last:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        sync_grads([param for param in self.module.parameters() if param.grad is not None])
        # in float32 on every rank: the loss may be bf16 (mixed precision), the receivers' buffer must match
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.is_last else torch.zeros(())
        dist.broadcast(loss, src=self.last_rank, group=self.lane)
        return loss

    def evaluate(self, inputs: tuple):
        """Forward only; the full outputs on every rank."""
        out = self.forward_only.step(*inputs) if self.is_first else self.forward_only.step()
        box = [out if self.is_last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.lane)
        return box[0]


def lower_pipeline(captured: Captured, plan: Plan, model: nn.Module, loss_fn: Callable | None,
                   device_type: str) -> tuple[torch.fx.GraphModule, PipelineRuntime]:
    meshes, groups, s, k = group_meshes(plan.stages, device_type)
    lane_meshes = [DeviceMesh(device_type, torch.tensor(st.ranks)) for st in plan.stages]
    owner_meshes = owner_submeshes(plan, meshes)

    gm = captured.program.module()
    layers = layer_order(gm.graph)
    first_layers = [layers.index(st.layers[0]) for st in plan.stages[1:]]
    stage_of = assign_stages(gm.graph, layers, first_layers, set(), {})
    piece = split_graph(gm.graph, stage_of, len(plan.stages), set(), gm._out_spec)[s]
    module = torch.fx.GraphModule(gm, piece.graph)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    names = [spec.name for spec in plan.inputs] if s == 0 else [n.name for n in placeholders]
    examples = tuple(torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype)) for spec in plan.inputs) if s == 0 \
        else tuple(_zeros(n) for n in placeholders)
    outputs = tuple(_zeros(n) for n in module.graph.output_node().all_input_nodes)
    lower_module(module, names, plan, meshes[s], model, captured, sync_on_accumulate=False,
                 owner_meshes=owner_meshes[s])
    recomputed = {layer: mode for layer, mode in plan.recompute.items() if layer in plan.stages[s].layers}
    if recomputed:  # torch.utils.checkpoint around each of the stage's layers (passes.recompute)
        checkpoint_layers(module, recomputed)
    width = len(plan.stages[s].ranks)
    _slice_boundaries(module, lane_meshes[s], s > 0, s < len(plan.stages) - 1, width)
    examples = tuple(_sliced(t, width) for t in examples) if s > 0 else examples
    outputs = tuple(_sliced(t, width) for t in outputs) if s < len(plan.stages) - 1 else outputs
    runtime = PipelineRuntime(module, s, plan, groups[k], [st.ranks[k] for st in plan.stages], examples,
                              outputs[0] if len(outputs) == 1 else outputs, loss_fn, torch.device(device_type))
    return module, runtime


def _slice_boundaries(module: torch.fx.GraphModule, lane_mesh: DeviceMesh, inputs: bool, outputs: bool,
                      lanes: int) -> None:
    """Boundary tensors travel one slice per lane (``runtime.send_slice`` /
    ``receive_slice``) on a dim that divides evenly (``stages.lane_slice_dim``)."""
    graph = module.graph
    setattr(module, LANES_ATTR, lane_mesh)
    first = next(iter(graph.nodes))
    with graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mesh is a plain attribute, not a tensor
        mesh_node = graph.get_attr(LANES_ATTR)
    if inputs:
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            dim = lane_slice_dim(node.meta["val"], lanes)
            if dim is not None:
                with graph.inserting_after(node):
                    whole = graph.call_function(runtime.receive_slice, (node, mesh_node, dim))
                for user in list(node.users):
                    if user is not whole:
                        user.replace_input_with(node, whole)
    if outputs:
        out = graph.output_node()
        with graph.inserting_before(out):
            sent = tuple(v if lane_slice_dim(_val(v), lanes) is None else
                         graph.call_function(runtime.send_slice, (v, mesh_node, lane_slice_dim(_val(v), lanes)))
                         for v in out.args[0])
        out.args = (sent,)
    graph.lint()
    module.recompile()


def _val(node: torch.fx.Node) -> torch.Tensor:
    """The value a boundary output node carries (to_full nodes keep no ``val``: look through)."""
    while "val" not in node.meta:
        node = node.args[0]
    return node.meta["val"]


def _sliced(t: torch.Tensor, lanes: int) -> torch.Tensor:
    dim = lane_slice_dim(t, lanes)
    if dim is None:
        return t
    return t.detach().narrow(dim, 0, t.shape[dim] // lanes).clone().requires_grad_(t.requires_grad)


def _zeros(node: torch.fx.Node) -> torch.Tensor:
    """An example of a boundary value; floating ones carry gradients between stages."""
    val = node.meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype, requires_grad=val.dtype.is_floating_point)
