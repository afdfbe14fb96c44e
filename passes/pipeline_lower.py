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
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from autopar.plan import Plan
from autopar.plan_types import SPLIT_BACKWARD_SCHEDULES, V_SHAPED_SCHEDULES, chunk_group
from autopar.passes.capture import Captured
from autopar.passes import runtime
from autopar.passes.grad_sync import sync_grads
from autopar.passes.recompute import checkpoint_layers
from autopar.passes.lower import lower_module
from autopar.passes.place_state import group_meshes, owner_submeshes, stage_mesh
from autopar.passes.stages import assign_stages, layer_order, lane_slice_dim, split_graph

LANES_ATTR = "_autopar_lanes"
_SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B,
              "InterleavedZeroBubble": ScheduleInterleavedZeroBubble, "ZBVZeroBubble": ScheduleZBVZeroBubble}


class PipelineRuntime:
    """This rank's stages (one, or its ``virtual_stages`` chunks under an interleaved
    schedule) and the schedule that runs them, micro-batch by micro-batch. Under ZBV the
    first group holds both the first and the last chunk."""

    def __init__(self, modules: dict[int, torch.fx.GraphModule], plan: Plan, lane: dist.ProcessGroup,
                 lane_ranks: list[int], examples: dict[int, tuple[tuple, tuple]], loss_fn: Callable | None,
                 device: torch.device) -> None:
        self.modules, self.lane, self.num_stages, self.device = modules, lane, len(plan.stages), device
        self.last_rank = lane_ranks[-1]  # the lane's rank in the group of the last stage
        stages = [PipelineStage(module, g, self.num_stages, device, input_args=examples[g][0],
                                output_args=examples[g][1], group=lane) for g, module in modules.items()]
        schedule = _SCHEDULES[plan.schedule]
        held = stages if plan.virtual_stages > 1 else stages[0]  # multi-stage schedules take the list
        self.schedule = schedule(held, n_microbatches=plan.micro_batches, loss_fn=loss_fn)
        self.schedule_name, self.micro_batches, self.examples = plan.schedule, plan.micro_batches, examples
        # no loss: evaluation (torch's ZBV runs its backward actions even so: evaluate_in_turn)
        self.forward_only = None if plan.schedule in V_SHAPED_SCHEDULES else \
            schedule(held, n_microbatches=plan.micro_batches)

    @property
    def is_first(self) -> bool:
        return 0 in self.modules

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.modules

    def train_step(self, inputs: tuple, target) -> torch.Tensor:
        """Forward and backward over all micro-batches; the mean micro-batch loss on every rank."""
        losses: list[torch.Tensor] = []
        if self.is_first and self.is_last:
            self.schedule.step(*inputs, target=target, losses=losses)
        elif self.is_first:
            self.schedule.step(*inputs)
        elif self.is_last:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        sync_grads([param for module in self.modules.values() for param in module.parameters()
                    if param.grad is not None])
        # in float32 on every rank: the loss may be bf16 (mixed precision), the receivers' buffer must match
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.is_last \
            else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.lane)
        return loss

    def evaluate(self, inputs: tuple):
        """Forward only; the full outputs on every rank."""
        if self.forward_only is None:
            out = self._evaluate_in_turn(inputs)
        else:
            out = self.forward_only.step(*inputs) if self.is_first else self.forward_only.step()
        box = [out if self.is_last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.lane)
        return box[0]


    @torch.no_grad()
    def _evaluate_in_turn(self, inputs: tuple):
        """Forward only, chunk after chunk down the pipeline, one micro-batch at a time: each
        rank runs its chunks' forwards and hands their outputs on (to the lane's next group, or
        to itself at ZBV's turn). torch's ZBV cannot run without backwards; evaluation needs
        no overlap between micro-batches. The outputs (on the last chunk's rank), whole."""
        groups = self.lane.size()
        pieces = [x.chunk(self.micro_batches) for x in inputs] if self.is_first else []
        outputs = []
        for i in range(self.micro_batches):
            value = tuple(piece[i] for piece in pieces)
            for g in range(self.num_stages):
                if g not in self.modules:
                    continue
                if g > 0 and g - 1 not in self.modules:
                    value = tuple(torch.empty_like(x) for x in self.examples[g][0])
                    for x in value:
                        dist.recv(x, group=self.lane, group_src=chunk_group(g - 1, groups, self.schedule_name))
                value = self.modules[g](*value)
                value = value if isinstance(value, tuple) else (value,)
                if g + 1 < self.num_stages and g + 1 not in self.modules:
                    for x in value:
                        dist.send(x.contiguous(), group=self.lane, group_dst=chunk_group(g + 1, groups, self.schedule_name))
            if self.is_last:
                outputs.append(value)
        if not self.is_last:
            return None
        merged = tuple(torch.cat(parts) for parts in zip(*outputs))
        return merged[0] if len(merged) == 1 else merged


def lower_pipeline(captured: Captured, plan: Plan, model: nn.Module, loss_fn: Callable | None,
                   device: torch.device) -> tuple[list[torch.fx.GraphModule], PipelineRuntime]:
    """This rank's stages lowered (one per chunk it holds, in model order), and the runtime
    that schedules them. Chunk ``g`` runs on group ``chunk_group(g, p, schedule)`` (``p``
    groups: ``g mod p``, or ZBV's V). ``device``: where this rank's tensors live (its meshes'
    device type; the examples the stages are built with, the loss it broadcasts)."""
    p = len(plan.stages) // plan.virtual_stages
    device_type = device.type
    meshes, groups, r, k = group_meshes(plan.stages[:p], device_type)
    meshes += [stage_mesh(st, device_type) for st in plan.stages[p:]]  # chunks may pick other meshes
    lane_meshes = [DeviceMesh(device_type, torch.tensor(st.ranks, device="cpu")) for st in plan.stages[:p]]
    owner_meshes = owner_submeshes(plan, meshes)

    gm = captured.program.module()
    layers = layer_order(gm.graph)
    first_layers = [layers.index(st.layers[0]) for st in plan.stages[1:]]
    stage_of = assign_stages(gm.graph, layers, first_layers, set(), {})
    pieces = split_graph(gm.graph, stage_of, len(plan.stages), set(), gm._out_spec)
    modules, examples = {}, {}
    for g in (g for g in range(len(plan.stages)) if chunk_group(g, p, plan.schedule) == r):
        modules[g], examples[g] = _lower_stage(gm, pieces[g].graph, g, plan, meshes[g], owner_meshes[g],
                                               lane_meshes[r], model, captured, device)
    runtime = PipelineRuntime(modules, plan, groups[k], [st.ranks[k] for st in plan.stages], examples, loss_fn,
                              device)
    return list(modules.values()), runtime


def _lower_stage(gm: torch.fx.GraphModule, graph: torch.fx.Graph, g: int, plan: Plan, mesh: DeviceMesh,
                 owner_meshes: dict, lane_mesh: DeviceMesh, model: nn.Module, captured: Captured,
                 device: torch.device) -> tuple[torch.fx.GraphModule, tuple[tuple, object]]:
    """Stage ``g``'s piece of the graph lowered onto its mesh, with its example inputs and
    outputs (one lane's slice of each boundary tensor) on ``device``."""
    module = torch.fx.GraphModule(gm, graph)
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    names = [spec.name for spec in plan.inputs] if g == 0 else [n.name for n in placeholders]
    examples = tuple(torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
                     for spec in plan.inputs) if g == 0 else tuple(_zeros(n, device) for n in placeholders)
    outputs = tuple(_zeros(n, device) for n in module.graph.output_node().all_input_nodes)
    lower_module(module, names, plan, mesh, model, captured, sync_on_accumulate=False, owner_meshes=owner_meshes)
    recomputed = {layer: mode for layer, mode in plan.recompute.items() if layer in plan.stages[g].layers}
    if recomputed:  # torch.utils.checkpoint around each of the stage's layers (passes.recompute)
        checkpoint_layers(module, recomputed)
    width, last = len(plan.stages[g].ranks), len(plan.stages) - 1
    _slice_boundaries(module, lane_mesh, g > 0, g < last, width)
    if plan.schedule in SPLIT_BACKWARD_SCHEDULES:  # torch detaches outputs in place between the halves
        _own_outputs(module)
    examples = tuple(_sliced(t, width) for t in examples) if g > 0 else examples
    outputs = tuple(_sliced(t, width) for t in outputs) if g < last else outputs
    return module, (examples, outputs[0] if len(outputs) == 1 else outputs)


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


def _own_outputs(module: torch.fx.GraphModule) -> None:
    """Every tensor the stage returns in storage of its own (a copy where it would be a view,
    e.g. a DTensor's local part), so the schedule may detach it in place."""
    graph = module.graph
    out = graph.output_node()
    values = out.args[0]
    with graph.inserting_before(out):
        if isinstance(values, (tuple, list)):
            owned = type(values)(graph.call_method("clone", (v,)) if isinstance(v, torch.fx.Node) else v
                                 for v in values)
        else:
            owned = graph.call_method("clone", (values,))
    out.args = (owned,)
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


def _zeros(node: torch.fx.Node, device: torch.device) -> torch.Tensor:
    """An example of a boundary value on ``device``; floating ones carry gradients between stages."""
    val = node.meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype, device=device, requires_grad=val.dtype.is_floating_point)


def merged_module(modules: list[torch.fx.GraphModule]) -> nn.Module:
    """One module holding every parameter and buffer of this rank's stages under the model's
    own names (``blocks.0.attn.weight``), the very tensors the stages train — what the user's
    optimizer, ``state_dict`` and checkpoints see. One stage: that stage itself."""
    if len(modules) == 1:
        return modules[0]
    root = nn.Module()
    for module in modules:
        for name, param in module.named_parameters(remove_duplicate=False):
            owner, attr = _owner_made(root, name)
            owner.register_parameter(attr, param)
        for name, buffer in module.named_buffers(remove_duplicate=False):
            owner, attr = _owner_made(root, name)
            owner.register_buffer(attr, buffer)
    return root


def _owner_made(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module that holds ``fqn`` under ``root``, made (empty) where missing."""
    *path, attr = fqn.split(".")
    owner = root
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]
    return owner, attr
