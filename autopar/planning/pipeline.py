"""Pipeline plans over device groups (regions): stage cuts, micro-batches, and each stage's
own intra-operator plan on its group (asymmetric: groups may pick different meshes).

For each micro-batch count ``m`` the model is captured at one micro-batch (``batch / m``);
a stage over layers ``[i, j)`` on group ``s`` is cut out of that graph (passes.stages) and
planned by the same sharding ILP as a whole model (``make_plan`` on the group's cluster),
with ``p − s`` micro-batches of activations in flight (1F1B). Stages of identical layers at
the same position cost the same, so they are solved once. solvers.pipeline then picks the
cuts; the chosen stages are planned again under their own node names and merged into one
:class:`Plan` whose nodes record their stage.

Sending a stage's outputs: every lane (the k-th device of each group) sends its
slice of the boundary tensors to its peer in the next group, which all-gathers them, and
the gradients come back the same way; lanes crossing a WAN link share it, lanes inside a
region each have their own network path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

import torch

from autopar.cluster import Cluster, DeviceGroup
from autopar.comm import all_gather_s
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import MemoryBreakdown, Plan, StagePlan, TensorSpec
from autopar.planning.one_mesh import make_plan
from autopar.planning.options import PlanOptions
from autopar.planning.schedules import Layout, schedule_layouts
from autopar.units import format_bytes
from autopar.passes.capture import Captured, leading_batch
from autopar.passes.cost import annotate_costs, tensor_bytes
from autopar.passes.layers import layer_signatures
from autopar.passes.memory import annotate_saved
from autopar.passes.strategies import MEMO_KEY
from autopar.passes.stages import assign_stages, layer_order, lane_slice_dim, split_graph
from autopar.passes.weight_gradients import BACK, FRONT, weight_gradient_flops, weight_gradient_share
from autopar.solvers.pipeline import PipelineSolution, StageTime

log = logging.getLogger(__name__)


def groups_unavailable(cluster: Cluster, options: PlanOptions) -> str | None:
    """Why ``cluster`` cannot host plans over its device groups (pipeline stages, replica
    groups); None when it can."""
    if options.mesh_shape or options.configuration:
        return f"{'mesh_shape' if options.mesh_shape else 'configuration'}= asks for one mesh over every device"
    groups = cluster.groups()
    if len(groups) < 2:
        return "the cluster has one device group (give it regions to pipeline over)"
    if len({len(g.ranks) for g in groups}) > 1:
        return (f"its groups have different sizes ({[len(g.ranks) for g in groups]} devices); stages talk lane by "
                "lane, so every group needs the same number of devices")
    return None


# recompute option -> the modes a search over device groups tries, in order (the first that fits wins)
RECOMPUTE_MODES = {"auto": ("none", "selective", "full"), "none": ("none",), "selective": ("selective",),
                   "full": ("full",)}


def stage_groupings(graphs, cluster: Cluster) -> list[Cluster]:
    """The device groupings pipeline stages may run on: the regions (when there are several),
    and every cut of each region's hosts into k equal groups of consecutive hosts (k dividing
    every region's host count, at most one stage per layer; Cluster.host_stages). None may
    fit the model: fewer layers than groups."""
    layers = len(layer_order(graphs.full.graph))
    regions = cluster.groups()
    hosts = [g.cluster.hosts for g in regions]
    views = [cluster] if len(regions) > 1 else []
    return views + [cluster.host_stages(k) for k in range(2, min(hosts) + 1)
                    if all(h % k == 0 for h in hosts) and k * len(regions) <= layers]


def first_that_fits(options: PlanOptions, plan_with: Callable[[PlanOptions], Plan]) -> Plan:
    """``plan_with(options)`` under each recompute mode ``options.recompute`` allows, in order,
    until one fits in memory: keeping every activation is fastest, recomputing the cheap ops
    of every layer (selective) frees memory for a little more forward work, whole layers
    (full) the most."""
    modes = RECOMPUTE_MODES[options.recompute]
    for mode in modes[:-1]:
        try:
            return plan_with(dataclasses.replace(options, recompute=mode))
        except AutoparError as exc:
            if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
                raise
            log.info("no plan over the device groups fits with recompute=%s: trying the next mode", mode)
    return plan_with(dataclasses.replace(options, recompute=modes[-1]))


class PipelineStages:
    """Family "pipeline": stages over the cluster's device groups, in their order."""

    name = "pipeline"

    def unavailable(self, cluster: Cluster, options: PlanOptions) -> str | None:
        if len(cluster.groups()) > 1 or options.mesh_shape or options.configuration:
            return groups_unavailable(cluster, options)
        if cluster.hosts < 2:
            return "the cluster has one device group (give it regions, or hosts, to pipeline over)"
        if not options.forced(self.name):
            return ("its devices are of one kind in one region: stages over its hosts are planned when asked "
                    "(pipeline=True) or when no plan over one mesh fits")
        return None

    def plan(self, graphs, cluster: Cluster, options: PlanOptions) -> Plan:
        """The best pipeline plan over the cluster's device groups: its regions, and each
        region's hosts cut into k equal groups of consecutive hosts (:func:`stage_groupings`;
        a cluster of one kind only the latter). Sparse tables and MoE experts are planned inside
        their stage as on one mesh (touched rows and expert loads per micro-batch). Activation
        checkpointing as on one mesh (:func:`first_that_fits`)."""
        views = stage_groupings(graphs, cluster)
        if not views:
            layers = len(layer_order(graphs.full.graph))
            raise AutoparError(ErrorKind.BAD_INPUT, f"{type(graphs.model).__name__} has {layers} layers (indexed "
                               f"modules such as blocks.0) and {cluster.describe()} no split of its hosts into 2 or "
                               "more equal stages of at least one layer each")
        best, error = None, None
        for view in views:
            try:
                plan = first_that_fits(options, lambda chosen: self._plan(graphs, view, chosen))
            except AutoparError as exc:
                if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
                    raise
                error = error or exc
                continue
            log.info("%d stages on %s: predicted step %.3g s", len(plan.stages), view.describe(), plan.predicted_step_s)
            if best is None or plan.predicted_step_s < best.predicted_step_s * (1 - 1e-9):
                best = plan
        if best is None:
            raise error
        return best

    def _plan(self, graphs, cluster: Cluster, options: PlanOptions) -> Plan:
        groups = cluster.groups()
        start = time.perf_counter()
        best, tried, smallest = None, [], None
        for m in _micro_batch_counts(graphs.inputs, len(groups), options.micro_batches):
            captured = graphs.at_rows(graphs.inputs[0].shape[0] // m)
            stages = _StageCosts(captured, cluster, groups, m, options)
            if len(stages.layers) < len(groups):
                raise AutoparError(ErrorKind.BAD_INPUT,
                                   f"{type(graphs.model).__name__} has {len(stages.layers)} layers (indexed modules "
                                   f"such as blocks.0) but the cluster has {len(groups)} groups; pipeline stages are "
                                   "cut between layers: use fewer groups or plan without pipeline stages")
            fitted = False
            plain = None  # the best cut with one stage per group: where interleaving starts from
            for layout in schedule_layouts(options.schedule, len(groups), len(stages.layers), m):
                found = layout.partition(len(stages.layers), m, stages.timer(layout), plain)
                plain = found if layout.virtual == 1 else plain
                tried.append({"micro_batches": m, "schedule": layout.schedule, "virtual_stages": layout.virtual,
                              "cuts": list(found.cuts) if found else None,
                              "predicted_step_s": found.step_s if found else None})
                fitted = fitted or found is not None
                if found is not None and (best is None or found.step_s < best[2].step_s * (1 - 1e-9)):
                    best = (stages, layout, found)
            if not fitted:
                smallest = stages.largest_layer()
        if best is None:
            raise _no_fit(cluster, groups, smallest)
        stages, layout, found = best
        plan = stages.assemble(found, layout, tried, start)
        log.info("pipeline plan: %d stages, %s × %d, %d micro-batches, cuts %s, predicted step %.3g s",
                 len(groups), layout.schedule, layout.virtual, stages.micro_batches, found.cuts, found.step_s)
        return plan

    def lower(self, plan: Plan, model, loss_fn: Callable | None, captured: Captured | None = None):
        from autopar.parallel import ParallelModule
        from autopar.passes.pipeline_lower import lower_pipeline, merged_module
        from autopar.planning.lowering import capture_for, device_type

        # the plan's inputs are one micro-batch: a graph of the whole batch does not serve
        modules, runtime = lower_pipeline(capture_for(model, plan), plan, model, loss_fn, device_type())
        return ParallelModule(merged_module(modules), plan, loss_fn, runtime, pieces=modules)


def recost_pipeline(graphs, plan: Plan, cluster: Cluster, options: PlanOptions) -> float:
    """``plan``'s step on ``cluster`` (a link changed, say): its stage cuts, micro-batches and
    schedule kept, each stage planned on its group of ``cluster`` as the search plans it (a
    stage's own placements depend only on its group, so where only the links between groups
    changed they are the plan's), the sends costed on the new links. An AutoparError where the
    plan's device groups are not the cluster's."""
    wanted = [(st.group, tuple(st.ranks)) for st in plan.stages[:len(plan.stages) // plan.virtual_stages]]
    cluster = next((view for view in stage_groupings(graphs, cluster)
                    if [(g.name, g.ranks) for g in view.groups()] == wanted), None)
    if cluster is None:
        raise AutoparError(ErrorKind.BAD_PLAN, f"its stages run on groups {[st.group for st in plan.stages]}, which "
                           "no grouping of this cluster's regions or hosts gives")
    groups = cluster.groups()
    m = plan.micro_batches
    layout = Layout(plan.schedule or "1F1B", len(groups), plan.virtual_stages)
    options = dataclasses.replace(options, recompute=next(iter(plan.recompute.values()), "none"),
                                  schedule=layout.schedule)
    stages = _StageCosts(graphs.at_rows(graphs.inputs[0].shape[0] // m), cluster, groups, m, options)
    layers = [layer for st in plan.stages for layer in st.layers]
    if layers != stages.layers:
        raise AutoparError(ErrorKind.BAD_PLAN, "its stages hold other layers than the model has; re-plan")
    cuts = [0]
    for st in plan.stages:
        cuts.append(cuts[-1] + len(st.layers))
    times = [stages.time_s(cuts[g], cuts[g + 1], g, layout) for g in range(layout.chunks)]
    return layout.step_s(times, m)


def check_micro_batches(pinned: int, batch: int) -> None:
    """A pinned micro-batch count (a whole number of 1 or more: PlanOptions checks that)
    divides the batch: BAD_INPUT otherwise."""
    if batch % pinned:
        raise AutoparError(ErrorKind.BAD_INPUT, f"micro_batches={pinned} must divide the batch size {batch}")


def _micro_batch_counts(inputs: tuple, stages: int, pinned: int | None) -> list[int]:
    batch = leading_batch(inputs, "pipeline micro-batches")
    if pinned is not None:
        check_micro_batches(pinned, batch)
        return [pinned]
    counts = [m for m in (stages, 2 * stages, 4 * stages) if batch % m == 0]
    if not counts:
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"batch size {batch} cannot be split into {stages} or more equal micro-batches; use a "
                           f"batch divisible by {stages} or pass micro_batches=")
    return counts


class _StageCosts:
    """Stage plans for one micro-batch size, solved once per distinct stage."""

    def __init__(self, captured: Captured, cluster: Cluster, groups: list[DeviceGroup], micro_batches: int,
                 options: PlanOptions) -> None:
        annotate_costs(captured.graph)
        annotate_saved(captured.graph)
        for node in captured.graph.nodes:  # stage graphs copy meta: strategies enumerated once per mesh
            node.meta[MEMO_KEY] = {}
        self.captured, self.cluster, self.groups = captured, cluster, groups
        self.micro_batches, self.options = micro_batches, options
        self.layers = layer_order(captured.graph)
        self._weight_flops = weight_gradient_flops(captured)
        signature = layer_signatures(captured)
        self._signature = [signature.get(layer) for layer in self.layers]
        self._state = set(captured.parameter_of) | set(captured.buffer_of)
        # stage key -> (time, (i, j) it was solved for, its plan with send time, or the error)
        self._memo: dict[tuple, tuple[float, tuple[int, int], tuple[Plan, float] | AutoparError]] = {}

    def timer(self, layout: Layout) -> Callable[[int, int, int], StageTime]:
        """``(i, j, g) ->`` the per-micro-batch time of chunk ``g`` of ``layout`` over layers
        ``[i, j)`` and its link (inf if it does not fit)."""
        return lambda i, j, g: self.time_s(i, j, g, layout)

    def _key(self, i: int, j: int, g: int, layout: Layout) -> tuple:
        """Chunks of identical layers at the same ends, on one group, holding as much in
        flight within the same share of memory, and sending to the same group cost the same."""
        last = j == len(self.layers)
        return (i == 0, last, tuple(self._signature[i:j]), layout.group_of(g),
                None if last else layout.group_of(g + 1), layout.in_flight(g, self.micro_batches),
                layout.memory_share())

    def time_s(self, i: int, j: int, g: int, layout: Layout) -> StageTime:
        key = self._key(i, j, g, layout)
        if key not in self._memo:
            try:
                plan, (busy_s, latency_s) = self.stage(i, j, g, layout)
                # weight gradients, which zero-bubble schedules defer into the bubbles: their
                # share of the chunk's FLOPs (passes.weight_gradients) of its compute
                ends = [FRONT] * (i == 0) + [BACK] * (j == len(self.layers))
                share = weight_gradient_share(self._weight_flops, [*self.layers[i:j], *ends])
                self._memo[key] = (StageTime(plan.predicted_step_s + busy_s + latency_s,
                                             max(plan.predicted_step_s, busy_s), plan.predicted_compute_s * share),
                                   (i, j, g), (plan, (busy_s, latency_s)))
            except AutoparError as exc:
                if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
                    raise
                self._memo[key] = (StageTime(math.inf), (i, j, g), exc)
        return self._memo[key][0]

    def chosen(self, i: int, j: int, g: int, layout: Layout) -> tuple[Plan, tuple[float, float]]:
        """Plan of chunk ``g`` over exactly layers ``[i, j)`` (node names differ between
        identical stages at other positions, so those are planned again)."""
        _t, solved_for, result = self._memo.get(self._key(i, j, g, layout), (None, None, None))
        return result if solved_for == (i, j, g) else self.stage(i, j, g, layout)

    def stage(self, i: int, j: int, g: int, layout: Layout) -> tuple[Plan, tuple[float, float]]:
        """Intra-operator plan of layers ``[i, j)`` on chunk ``g``'s group (within its share
        of the devices' memory), and its link's busy time and latency per micro-batch."""
        part = self._piece(i, j, g)
        group = self.groups[layout.group_of(g)]
        cluster = group.cluster if layout.memory_share() == 1 else dataclasses.replace(
            group.cluster, memory_limit_bytes=group.cluster.memory_limit_bytes // layout.memory_share())
        plan = make_plan(part, cluster, self.options, baselines=False,
                         activation_copies=layout.in_flight(g, self.micro_batches), annotate=False)
        send_s = self._send_s([n.meta["val"] for n in part.graph.output_node().all_input_nodes],
                              layout.group_of(g), layout.group_of(g + 1)) if j < len(self.layers) else (0.0, 0.0)
        return plan, send_s

    def _send_s(self, vals: list[torch.Tensor], s: int, t: int) -> tuple[float, float]:
        """Boundary tensors of a stage on group ``s`` to the next on group ``t``, and their
        gradients back, per micro-batch (nothing on one group: ZBV's turn): each lane sends its
        slice (whole where no dim divides evenly), lanes crossing a WAN link share it, and the
        receiving group all-gathers the slices (the sending group gathers the gradients' slices
        in backward). Returns (busy, latency)."""
        if s == t:  # the turn of ZBV's V: the next chunk is on the same devices
            return 0.0, 0.0
        here, there = self.groups[s], self.groups[t]
        lanes = len(here.ranks)
        link = self.cluster.link_between(here, there)
        busy = latency = 0.0
        for val in vals:
            trips = 2 if val.dtype.is_floating_point else 1
            sliced = lane_slice_dim(val, lanes) is not None
            per_lane = tensor_bytes(val) // (lanes if sliced else 1)
            # lanes of two regions share the WAN link between them; hosts of one region each have their own path
            sharing = lanes if self.cluster.home_region(here.name) != self.cluster.home_region(there.name) else 1
            busy += trips * sharing * per_lane / link.bandwidth_Bps
            latency += trips * link.latency_s
            if sliced:
                busy += all_gather_s(tensor_bytes(val), lanes, there.cluster.group_link(range(lanes)))
                if trips == 2:
                    busy += all_gather_s(tensor_bytes(val), lanes, here.cluster.group_link(range(lanes)))
        return busy, latency

    def _piece(self, i: int, j: int, g: int) -> Captured:
        """The graph of layers ``[i, j)`` as stage ``g`` (its boundary inputs are named after
        the stage, as the lowered pipeline names them: passes.stages), a Captured of its own.
        Stages before it cut one layer each (``i >= g``): where earlier layers are cut does
        not change what enters stage ``g``."""
        cuts = [*range(1, g), *(c for c in (i, j) if 0 < c < len(self.layers))]
        stage_of = assign_stages(self.captured.graph, self.layers, cuts, self._state, self.captured.parameter_of)
        index = g
        piece = split_graph(self.captured.graph, stage_of, len(cuts) + 1, self._state, only=index)[index]
        names = {n.name for n in piece.graph.nodes if n.op == "placeholder"}
        boundary = [n for n in piece.graph.nodes if n.op == "placeholder" and n.name not in self._state]
        inputs = [TensorSpec.of(n.name, n.meta["val"]) for n in boundary]
        return dataclasses.replace(
            self.captured, inputs=inputs,
            parameter_of={k: v for k, v in self.captured.parameter_of.items() if k in names},
            buffer_of={k: v for k, v in self.captured.buffer_of.items() if k in names},
            fingerprint=f"{self.captured.fingerprint}/layers{i}-{j}@{g}", aliases={}, stage_graph=piece.graph,
            grad_inputs=frozenset(n.name for n in boundary if index and n.meta["val"].dtype.is_floating_point))

    def largest_layer(self) -> tuple[str, int]:
        """The layer needing the most memory per device on its own, on the group with the
        most memory (for the error when nothing fits)."""
        roomiest = max(self.groups, key=lambda g: g.cluster.memory_limit_bytes)
        worst = ("", 0)
        for k, layer in enumerate(self.layers):
            try:
                make_plan(self._piece(k, k + 1, min(k, 1)), roomiest.cluster, self.options, baselines=False,
                          annotate=False)
            except AutoparError as exc:
                if exc.kind is ErrorKind.INFEASIBLE_MEMORY and (exc.needed_bytes or 0) > worst[1]:
                    worst = (layer, exc.needed_bytes)
        return worst

    def assemble(self, found: PipelineSolution, layout: Layout, tried: list[dict], start: float) -> Plan:
        """One plan from the chosen stages (interleaved: every chunk, in model order), each
        planned again under its own node names."""
        cuts = [0, *found.cuts, len(self.layers)]
        stage_plans, stages = [], []
        for g in range(layout.chunks):
            group = self.groups[layout.group_of(g)]
            plan, (busy_s, latency_s) = self.chosen(cuts[g], cuts[g + 1], g, layout)
            send_s = busy_s + latency_s
            weight_grad_s = self.time_s(cuts[g], cuts[g + 1], g, layout).deferrable_s
            stage_plans.append(plan)
            stages.append(StagePlan(
                group=group.name, device=group.cluster.device.name, ranks=group.ranks,
                mesh_shape=plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names,
                layers=tuple(self.layers[cuts[g]:cuts[g + 1]]), compute_s=plan.predicted_step_s, send_s=send_s,
                in_flight=layout.in_flight(g, self.micro_batches), memory=plan.memory, weight_grad_s=weight_grad_s))
        nodes, parameters, buffers = {}, {}, {}
        for g, plan in enumerate(stage_plans):
            nodes.update({k: dataclasses.replace(v, stage=g) for k, v in plan.nodes.items()})
            parameters.update(plan.parameters)
            buffers.update(plan.buffers)
        m, p = self.micro_batches, len(self.groups)
        # per group: its chunks' compute and memory add up (one chunk per group without interleaving)
        by_group = [[plan for g, plan in enumerate(stage_plans) if layout.group_of(g) == r] for r in range(p)]
        compute = m * max(sum(plan.predicted_compute_s for plan in plans) for plans in by_group)
        memory = max((MemoryBreakdown.together([plan.memory for plan in plans]) for plans in by_group),
                     key=lambda mem: mem.total_bytes)
        lanes = len(self.groups[0].ranks)
        return Plan(
            fingerprint=self.captured.fingerprint,
            cluster=self.cluster.plan_header(),
            mesh_shape=(p, lanes), mesh_dim_names=("pp", "lane"), inputs=tuple(self.captured.inputs),
            nodes=nodes, parameters=parameters, buffers=buffers,
            predicted_step_s=found.step_s, predicted_compute_s=compute, predicted_comm_s=found.step_s - compute,
            memory=memory,
            solver={"name": "pipeline-dp", "status": "OPTIMAL", "method": "dp",
                    "objective_s": found.step_s, "bound_s": found.step_s, "micro_batch_candidates": tried,
                    "stage_solvers": [plan.solver for plan in stage_plans]},
            mesh_candidates=tuple(c for plan in stage_plans for c in plan.mesh_candidates),
            options={**self.options.recorded(), "pipeline": True},
            sparse={k: v for plan in stage_plans for k, v in plan.sparse.items()},
            experts={k: v for plan in stage_plans for k, v in plan.experts.items()},
            recompute={k: v for plan in stage_plans for k, v in plan.recompute.items()},
            recompute_cost=_recompute_cost(stage_plans),
            stages=tuple(stages), micro_batches=m, schedule=layout.schedule, virtual_stages=layout.virtual,
            bubble=layout.bubble(m), family="pipeline",
            timings={"plan_s": time.perf_counter() - start})


def _recompute_cost(stage_plans: list[Plan]) -> dict[str, float]:
    """A pipeline's recomputation: the reruns of every stage (per micro-batch), and the
    activations the fullest stage keeps."""
    costs = [plan.recompute_cost for plan in stage_plans if plan.recompute_cost]
    if not costs:
        return {}
    return {"rerun_s": sum(c["rerun_s"] for c in costs),
            "activations_kept_bytes": max(c["activations_kept_bytes"] for c in costs)}


def _no_fit(cluster: Cluster, groups: list[DeviceGroup], worst: tuple[str, int] | None) -> AutoparError:
    largest = max(groups, key=lambda g: g.cluster.memory_limit_bytes)
    limit = largest.cluster.memory_limit_bytes
    layer, needed = worst or ("", 0)
    what = f"a stage holding only layer {layer} needs at least {needed} bytes ({format_bytes(needed)}) per device; " \
        if layer else "no cut into stages fits; "
    return AutoparError(
        ErrorKind.INFEASIBLE_MEMORY,
        f"no pipeline plan fits on {cluster.describe()}: {what}the largest group, {largest.name} "
        f"({len(largest.ranks)}x{largest.cluster.device.name}), has {limit} bytes ({format_bytes(limit)}) per device. "
        "Fixes: 1) more micro-batches (micro_batches=) 2) more or larger devices per group 3) an optimizer with "
        "less state (sgd)")
