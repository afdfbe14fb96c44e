"""Re-planning for a changed cluster (issue 24): a link got slower, a host went away, a device
kind changed. The new plan is made the usual way (:func:`autopar.planning.choose`, every
family, the old plan's options) but warm-started — the old plan's mesh solved first, its
placements the solver's first incumbent there — and without costing the hand-written
baselines (the new plan lists none); it comes with what switching costs:
the state to move (autopar.planning.migration) and after how many steps the faster step pays
that back. Whether to switch is the caller's call; the answer says why.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.planning.costing import recost
from autopar.planning.pipeline import recost_pipeline
from autopar.planning.migration import Migration, migration
from autopar.planning.one_mesh import searched_cost
from autopar.planning.options import MeshBounds, PlanOptions
from autopar.units import format_bytes, format_seconds


@dataclass(frozen=True)
class Replan:
    """``plan``: the best plan on the new cluster. ``previous_step_s``: the old plan's step
    re-costed on the new cluster (None when it cannot run there: other device count, or a
    plan over device groups). ``migration_bytes`` / ``migration_s``: what the busiest device
    receives to move from the old placements to the new ones, and its time on the new links
    (``migration_exact`` False: an upper bound, every device receiving its whole state).
    ``break_even_steps``: steps after which the switch has paid for itself (0: the old plan
    cannot run; None: the new plan is no faster). ``switch``: whether switching pays off at
    all; ``reason`` says why in one sentence; ``replan_s``: the time of the whole answer (the
    search, the old plan costed, the migration)."""

    plan: Plan
    previous_step_s: float | None
    migration_bytes: int
    migration_s: float
    migration_exact: bool
    break_even_steps: int | None
    switch: bool
    reason: str
    replan_s: float

    def to_json(self) -> dict:
        """The answer without the plan (the CLI prints it beside the plan's summary)."""
        answer = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        return answer | {"predicted_step_s": self.plan.predicted_step_s}


def _planned_rows(plan: Plan) -> int:
    """The batch rows a plan over device groups fingerprints its graph at: a pipeline's one
    micro-batch, a replica plan's largest group's share (the plan its groups share)."""
    if plan.replicas:
        return next((r.batch for r in plan.replicas if r.fingerprint == plan.fingerprint), plan.replicas[0].batch)
    return plan.inputs[0].shape[0] if plan.inputs and plan.inputs[0].shape else 1


def replan(graphs, old: Plan, cluster: Cluster, options: PlanOptions) -> Replan:
    """The best plan of ``graphs`` on ``cluster``, warm-started from ``old``, with the cost of
    switching to it (see :class:`Replan`)."""
    from autopar.planning import choose

    captured = graphs.at_rows(_planned_rows(old)) if old.stages or old.replicas else graphs.full
    if captured.fingerprint != old.fingerprint:
        raise AutoparError(ErrorKind.BAD_PLAN, f"the plan was made for a different graph (fingerprint "
                           f"{old.fingerprint}, this model captures as {captured.fingerprint}); plan it afresh")
    start = time.perf_counter()
    searched = dataclasses.replace(options, warm_start=old, baselines=False,
                                   mesh_bounds=known_bounds(graphs, old, cluster))
    new = choose(graphs, cluster, searched)
    previous, why_not = _previous_step(graphs, old, cluster, options, searched)
    moved = _migration(graphs, old, new, cluster, options)
    replan_s = time.perf_counter() - start  # the whole answer: the search, the old plan costed, the move
    saved = None if previous is None else previous - new.predicted_step_s
    if previous is None:
        steps, switch = 0, True
        reason = f"the old plan cannot run on {cluster.describe()} ({why_not}): switch"
    elif saved <= 1e-9 * previous:
        steps, switch = None, False
        reason = (f"the old plan runs {format_seconds(previous)} per step on {cluster.describe()}, the new one "
                  f"{format_seconds(new.predicted_step_s)}: keep the old plan")
    else:
        steps, switch = max(1, math.ceil(moved.seconds / saved)), True
        reason = (f"the new plan saves {format_seconds(saved)} per step ({format_seconds(previous)} → "
                  f"{format_seconds(new.predicted_step_s)}); moving {format_bytes(moved.bytes)} per device takes "
                  f"{format_seconds(moved.seconds)}: it pays off after {steps} step{'s' if steps > 1 else ''}")
    return Replan(new, previous, moved.bytes, moved.seconds, moved.exact, steps, switch, reason, replan_s)


def known_bounds(graphs, old: Plan, cluster: Cluster) -> MeshBounds | None:
    """The old one-mesh search's lower bound on each mesh (``old.families["one_mesh"]``'s
    ``mesh_bounds``, whichever family won), turned into one valid on ``cluster`` when only
    link speeds changed (same devices, hosts, regions and memory: the plan's ``topology``
    digest); None otherwise, or for a plan that records no links or bounds.

    Why it holds: every communication time is alpha-beta (autopar.comm: bytes / bandwidth +
    latencies, over an efficiency; the faster of ring and tree), so a link ``k`` times faster
    at most (:func:`link_speedup`) makes each collective at least ``1/k`` of its old time;
    compute is unchanged, and the objective is sums and maxima (overlap) of those terms. So
    on any assignment, fractional ones included, the new step is at least the old one over
    ``k`` (at least the old one where no link got faster), and so is each bound. Only for
    the problem the old search solved: the recompute mode it was made with, no pinned
    configuration (its bounds are the configuration's), and the same sparse-table densities
    (the graphs it was made from or saved beside it, ModelGraphs.lookups_of; or a model without sparse tables)."""
    recorded = old.families.get("one_mesh", {}).get("mesh_bounds")
    if recorded is None or old.cluster.get("topology") != cluster.topology_digest() \
            or "configuration" in old.options or (old.sparse and not graphs.lookups_of(old)):
        return None
    speedup = link_speedup(old.cluster.get("links"), cluster)
    if speedup is None:
        return None
    return MeshBounds(recorded["recompute"], tuple((tuple(shape), bound / speedup)
                                                   for shape, bound in recorded["bounds"]))


def link_speedup(recorded: dict | None, cluster: Cluster) -> float | None:
    """How many times faster than ``recorded`` (a plan's ``cluster["links"]``) any link of
    ``cluster`` got at most, in bandwidth or latency times collective efficiency; 1 when none
    got faster. None when the links are not the same ones, when a latency dropped to zero,
    or when regions are joined by several WAN links (a collective over three regions runs at
    the slowest of them, which may be another link after the change)."""
    links = cluster.named_links()
    if not recorded or set(recorded) != set(links) or len(cluster.wan_links) > 1:
        return None
    speedup = 1.0
    for name, link in links.items():
        was = recorded[name]
        if link.latency_s <= 0 < was["latency_s"]:
            return None
        faster = max(link.bandwidth_Bps / was["bandwidth_Bps"],
                     was["latency_s"] / link.latency_s if link.latency_s > 0 else 1.0)
        kinds = set(was["collective_efficiency"]) | {kind for kind, _ in link.collective_efficiency}
        efficient = max((link.efficiency(kind) / was["collective_efficiency"].get(kind, 1.0) for kind in kinds),
                        default=1.0)
        if not (math.isfinite(faster) and math.isfinite(efficient)):  # an infinite link, recorded or new
            return None
        speedup = max(speedup, faster * max(efficient, 1.0))
    return speedup


def _previous_step(graphs, old: Plan, cluster: Cluster, options: PlanOptions,
                   searched: PlanOptions) -> tuple[float | None, str]:
    """The old plan's step on the new cluster, or None and why it cannot be costed there. A
    one-mesh plan is costed on the problem the search (made with ``searched``) built for its
    mesh, where it can (planning.one_mesh.searched_cost: the warm mesh is built first), else
    by building that problem again (planning.costing.recost)."""
    if old.family not in ("one_mesh", "pipeline"):
        return None, f"a {old.family} plan is tied to the device groups it was made for"
    if old.num_devices != cluster.num_devices:
        return None, f"it runs on {old.num_devices} devices, the cluster has {cluster.num_devices}"
    try:
        if old.family == "pipeline":
            step_s = recost_pipeline(graphs, old, cluster, options)
            return (step_s, "") if math.isfinite(step_s) else (None, "a stage no longer fits its group's memory")
        cost = searched_cost(graphs, cluster, searched, old)
        step_s, memory = cost if cost is not None else recost(graphs.full, old, cluster, options.optimizer)
    except AutoparError as exc:
        return None, exc.message
    if memory > cluster.memory_limit_bytes:
        return None, f"it needs {format_bytes(memory)} per device, {format_bytes(cluster.memory_limit_bytes)} fit"
    return step_s, ""


def _migration(graphs, old: Plan, new: Plan, cluster: Cluster, options: PlanOptions) -> Migration:
    captured = graphs.full
    shapes, element_bytes = {}, {}
    for node in captured.graph.nodes:
        fqn = captured.parameter_of.get(node.name)
        if fqn is None or "val" not in node.meta:
            continue
        value = node.meta["val"]
        shapes[fqn] = tuple(value.shape)
        # mixed precision keeps fp32 masters whatever the graph computes in
        element_bytes[fqn] = 4 if options.mixed_precision is not None else value.element_size()
    return migration(old, new, cluster, shapes, element_bytes, options.optimizer_states)
