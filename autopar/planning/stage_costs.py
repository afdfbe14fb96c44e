"""The pipeline stage search's stages: each candidate stage (layers ``[i, j)`` as chunk ``g``
of a layout) cut out of the one-micro-batch graph (passes.stages) and planned by the sharding
ILP on its group (``make_plan``), its sends to the next group costed, solved once per
distinct stage (memoised); a cheap lower bound of every stage for the search's branch and
bound; and the chosen stages assembled into one :class:`Plan` whose nodes record their stage.
autopar.planning.pipeline runs the search over micro-batch counts and layouts.

Sending a stage's outputs: every lane (the k-th device of each group) sends its slice of the
boundary tensors to its peer in the next group, which all-gathers them, and the gradients
come back the same way; lanes crossing a WAN link share it, lanes inside a region each have
their own network path.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable

import torch

from autopar.cluster import Cluster, DeviceGroup
from autopar.comm import all_gather_s
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import MemoryBreakdown, Plan, StagePlan, TensorSpec
from autopar.planning.one_mesh import MeshSearch, make_plan, plan_or_no_fit
from autopar.planning.options import PlanOptions
from autopar.planning.recompute_cut import recompute_where_needed
from autopar.planning.schedules import Layout
from autopar.passes.build_problem import gradient_path
from autopar.passes.capture import Captured
from autopar.passes.cost import COST_KEY, annotate_costs, tensor_bytes
from autopar.passes.layers import layer_signatures
from autopar.passes.memory import annotate_saved
from autopar.passes.strategies import MEMO_KEY
from autopar.passes.stages import BACK, FRONT, assign_stages, layer_order, lane_slice_dim, split_graph
from autopar.passes.weight_gradients import weight_gradient_flops, weight_gradient_share
from autopar.solvers.pipeline import PipelineSolution, StageTime


class StageCosts:
    """Stage plans for one micro-batch size, solved once per distinct stage."""

    def __init__(self, captured: Captured, cluster: Cluster, groups: list[DeviceGroup], micro_batches: int,
                 options: PlanOptions, plans: dict | None = None) -> None:
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
        # (i, j, g, the group's cluster, micro-batches in flight) -> the chunk's intra-operator plan
        # (or why it does not fit): shared by the searches of these graphs at this micro-batch size
        # (``plans``), so a re-plan whose WAN link changed re-costs only the sends between groups
        self._plans = {} if plans is None else plans

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

    def lower_bound(self, layout: Layout) -> Callable[[int, int, int], StageTime] | None:
        """``(i, j, g) ->`` at most chunk ``g``'s time over layers ``[i, j)``: its ops' compute
        with each split over every device of its group, three times over on the gradient path
        (what a problem node costs at the least, passes.build_problem: its roofline time at the
        largest work split; communication and recomputation only add), and the send of the
        values it makes for later stages (the ones it passes on from earlier stages left out).
        The stage search plans only the stages a best cut reaches (solvers.pipeline.partition).
        None where the graph cannot be cut at every layer (tied weights in two layers)."""
        slots = self._slots()
        if slots is None:
            return None
        graph, last = self.captured.graph, len(self.layers)
        on_path = gradient_path(graph, self.captured)
        prefix: dict[int, list[float]] = {}  # group -> compute of the ops in layers [0, k)
        sends: dict[tuple[int, int], list[tuple[int, int, float, float]]] = {}

        def compute_before(home: int) -> list[float]:
            if home not in prefix:
                device, n = self.groups[home].cluster.device, self.groups[home].cluster.num_devices
                by_slot = [0.0] * last
                for node in graph.nodes:
                    if node.name in slots and COST_KEY in node.meta:
                        by_slot[slots[node.name][0]] += (3 if node.name in on_path else 1) * \
                            node.meta[COST_KEY].time_s(device, n)
                prefix[home] = [0.0, *itertools.accumulate(by_slot)]
            return prefix[home]

        def sent_on(home: int, there: int) -> list[tuple[int, int, float, float]]:
            """(slot, furthest reader's slot, busy, latency) of every tensor an op makes."""
            if (home, there) not in sends:
                sends[(home, there)] = [(slot, reach, *self._send_s([node.meta["val"]], home, there))
                                        for node in graph.nodes if node.name in slots
                                        for slot, reach in [slots[node.name]]
                                        if reach > slot and isinstance(node.meta.get("val"), torch.Tensor)]
            return sends[(home, there)]

        def bound(i: int, j: int, g: int) -> StageTime:
            home = layout.group_of(g)
            before = compute_before(home)
            compute = before[j] - before[i]
            if j == last:
                return StageTime(compute)
            busy = latency = 0.0
            for slot, reach, b, lat in sent_on(home, layout.group_of(g + 1)):
                if i <= slot < j <= reach:
                    busy, latency = busy + b, latency + lat
            return StageTime(compute + busy + latency, max(compute, busy))

        return bound

    def _slots(self) -> dict[str, tuple[int, int]] | None:
        """Per op: the layer it runs with when the graph is cut at every layer (a cut at
        ``c_1 < c_2 < …`` puts it in stage ``bisect(cuts, slot)``: passes.stages.assign_stages
        takes the latest of its layer and its inputs' stages, and bisect keeps that order), and
        the furthest slot that reads it (the output: past the last layer)."""
        last = len(self.layers)
        try:
            stage_of = assign_stages(self.captured.graph, self.layers, list(range(1, last)), self._state,
                                     self.captured.parameter_of)
        except AutoparError:
            return None
        return {node.name: (stage_of[node.name],
                            max((last if u.op == "output" else stage_of[u.name] for u in node.users), default=0))
                for node in self.captured.graph.nodes if node.op == "call_function"}

    def stage(self, i: int, j: int, g: int, layout: Layout) -> tuple[Plan, tuple[float, float]]:
        """Intra-operator plan of layers ``[i, j)`` on chunk ``g``'s group (within its share
        of the devices' memory), and its link's busy time and latency per micro-batch."""
        group = self.groups[layout.group_of(g)]
        cluster = group.cluster if layout.memory_share() == 1 else dataclasses.replace(
            group.cluster, memory_limit_bytes=group.cluster.memory_limit_bytes // layout.memory_share())
        in_flight = layout.in_flight(g, self.micro_batches)
        key = (i, j, g, cluster.fingerprint(), in_flight)
        if key not in self._plans:
            part = self._piece(i, j, g)
            boundary = [n.meta["val"] for n in part.graph.output_node().all_input_nodes]
            self._plans[key] = (plan_or_no_fit(self._chunk_plan, part, cluster, in_flight), boundary)
        plan, boundary = self._plans[key]
        if isinstance(plan, AutoparError):
            raise plan
        send_s = self._send_s(boundary, layout.group_of(g), layout.group_of(g + 1)) if j < len(self.layers) \
            else (0.0, 0.0)
        return plan, send_s

    def _chunk_plan(self, part: Captured, cluster: Cluster, in_flight: int) -> Plan:
        """The intra-operator plan of the stage graph ``part`` on ``cluster`` with ``in_flight``
        micro-batches' activations held, recomputing as ``options.recompute`` says — under
        "auto", the stage's own layers only where its memory requires it (a first stage of
        1F1B holds the most micro-batches: it may recompute while the last keeps everything)."""
        searches: dict[PlanOptions, MeshSearch] = {}

        def searched(options: PlanOptions) -> MeshSearch:
            if options not in searches:
                searches[options] = MeshSearch(part, cluster, options, baselines=False,
                                               activation_copies=in_flight, annotate=False)
            return searches[options]

        return recompute_where_needed(searched, cluster, self.options, layer_order(part.graph))

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
        # "auto" recomputes what does not fit: the least a layer needs is with it recomputed whole
        options = dataclasses.replace(self.options, recompute="full") if self.options.recompute == "auto" \
            else self.options
        worst = ("", 0)
        for k, layer in enumerate(self.layers):
            try:
                make_plan(self._piece(k, k + 1, min(k, 1)), roomiest.cluster, options, baselines=False,
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
            "activations_kept_bytes": max(c["activations_kept_bytes"] for c in costs),
            "rerun_buffer_bytes": max(c["rerun_buffer_bytes"] for c in costs)}
