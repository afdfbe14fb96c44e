"""Pipeline plans over device groups (regions): stage cuts, micro-batches, and each stage's
own intra-operator plan on its group (asymmetric: groups may pick different meshes).

For each micro-batch count ``m`` the model is captured at one micro-batch (``batch / m``);
a stage over layers ``[i, j)`` on group ``s`` is cut out of that graph (passes.stages) and
planned by the same sharding ILP as a whole model (``make_plan`` on the group's cluster),
with ``p − s`` micro-batches of activations in flight (1F1B). Stages of identical layers at
the same position cost the same, so they are solved once. solvers.pipeline then picks the
cuts; the chosen stages are planned again under their own node names and merged into one
:class:`Plan` whose nodes record their stage.

The stages themselves — cut, planned, costed, bounded and assembled — are
autopar.planning.stage_costs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from autopar.cluster import Cluster, DeviceGroup
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.planning.options import PlanOptions
from autopar.planning.schedules import Layout, schedule_layouts
from autopar.planning.stage_costs import StageCosts
from autopar.units import format_bytes
from autopar.passes.capture import Captured
from autopar.passes.layer_recompute import group_modes
from autopar.passes.stages import layer_order

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
        checkpointing as on one mesh, each stage for its own layers (under "auto": only the
        stages that need it, planning.recompute_cut.recompute_where_needed)."""
        views = stage_groupings(graphs, cluster)
        if not views:
            layers = len(layer_order(graphs.full.graph))
            raise AutoparError(ErrorKind.BAD_INPUT, f"{graphs.model_name} has {layers} layers (indexed "
                               f"modules such as blocks.0) and {cluster.describe()} no split of its hosts into 2 or "
                               "more equal stages of at least one layer each")
        best, error = None, None
        for view in views:
            try:
                plan = self._plan(graphs, view, options)
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
        batch = graphs.batch_rows("pipeline micro-batches")
        for m in _micro_batch_counts(batch, len(groups), options.micro_batches):
            rows = batch // m
            captured = graphs.at_rows(rows)
            # the chunks' plans, kept with the graphs: every search of them at this size reuses them
            plans = graphs.derived(("stage_plans", rows, dataclasses.replace(options, baselines=False)), dict)
            stages = StageCosts(captured, cluster, groups, m, options, plans)
            if len(stages.layers) < len(groups):
                raise AutoparError(ErrorKind.BAD_INPUT,
                                   f"{graphs.model_name} has {len(stages.layers)} layers (indexed modules "
                                   f"such as blocks.0) but the cluster has {len(groups)} groups; pipeline stages are "
                                   "cut between layers: use fewer groups or plan without pipeline stages")
            fitted = False
            plain = None  # the best cut with one stage per group: where interleaving starts from
            for layout in schedule_layouts(options.schedule, len(groups), len(stages.layers), m):
                found = layout.partition(len(stages.layers), m, stages.timer(layout), plain, stages.lower_bound(layout))
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
        from autopar.planning.lowering import capture_for
        from autopar.planning.world import device_type, runtime_device

        # the plan's inputs are one micro-batch: a graph of the whole batch does not serve
        device = runtime_device(device_type(model))
        modules, runtime = lower_pipeline(capture_for(model, plan), plan, model, loss_fn, device)
        return ParallelModule(merged_module(modules), plan, loss_fn, runtime, pieces=modules, device=device)


def stage_modes(plan: Plan) -> list[str]:
    """The recompute mode each of ``plan``'s stages was planned with, read from its own layers
    (under "full:N", the N-th, 2N-th, … of the stage; under "auto" each stage chose its own)."""
    try:
        return group_modes([st.layers for st in plan.stages], plan.recompute)
    except ValueError as exc:
        raise AutoparError(ErrorKind.BAD_PLAN, f"{exc}; re-plan") from None


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
    captured = graphs.at_rows(graphs.inputs[0].shape[0] // m)
    modes = stage_modes(plan)
    costs: dict[str, StageCosts] = {}  # a stage's recompute mode -> the stages planned with it
    for mode in modes:
        if mode not in costs:
            costs[mode] = StageCosts(captured, cluster, groups, m,
                                     dataclasses.replace(options, recompute=mode, schedule=layout.schedule))
    layers = [layer for st in plan.stages for layer in st.layers]
    if layers != next(iter(costs.values())).layers:
        raise AutoparError(ErrorKind.BAD_PLAN, "its stages hold other layers than the model has; re-plan")
    cuts = [0]
    for st in plan.stages:
        cuts.append(cuts[-1] + len(st.layers))
    times = [costs[mode].time_s(cuts[g], cuts[g + 1], g, layout) for g, mode in enumerate(modes)]
    return layout.step_s(times, m)


def check_micro_batches(pinned: int, batch: int) -> None:
    """A pinned micro-batch count (a whole number of 1 or more: PlanOptions checks that)
    divides the batch: BAD_INPUT otherwise."""
    if batch % pinned:
        raise AutoparError(ErrorKind.BAD_INPUT, f"micro_batches={pinned} must divide the batch size {batch}")


def _micro_batch_counts(batch: int, stages: int, pinned: int | None) -> list[int]:
    if pinned is not None:
        check_micro_batches(pinned, batch)
        return [pinned]
    counts = [m for m in (stages, 2 * stages, 4 * stages) if batch % m == 0]
    if not counts:
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"batch size {batch} cannot be split into {stages} or more equal micro-batches; use a "
                           f"batch divisible by {stages} or pass micro_batches=")
    return counts


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
