"""The planning layer: candidate families behind one interface, and the one place that picks
the winner (:func:`choose`) and lowers a plan (:func:`lower_plan`).

Families (``FAMILIES``, tried in this order): one mesh over every device
(:mod:`.one_mesh`), pipeline stages over device groups (:mod:`.pipeline`), data-parallel
replicas on the groups (:mod:`.replicas`). Each reads the model through one
:class:`ModelGraphs` (captured once) and one :class:`PlanOptions`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.planning.family import Family
from autopar.planning.graphs import ModelGraphs
from autopar.planning.one_mesh import OneMesh, mesh_search
from autopar.planning.options import PlanOptions
from autopar.planning.pipeline import PipelineStages, check_micro_batches
from autopar.planning.precision import Precision
from autopar.planning.replicas import ReplicaGroups, check_batch_split
from autopar.planning.throughput import step_work
from autopar.passes.layer_recompute import recompute_mode
from autopar.passes.stages import layer_order

log = logging.getLogger(__name__)

FAMILIES: dict[str, Family] = {f.name: f for f in (OneMesh(), PipelineStages(), ReplicaGroups())}

__all__ = ["FAMILIES", "Family", "ModelGraphs", "PlanOptions", "Precision", "choose", "lower_plan"]


def choose(graphs: ModelGraphs, cluster: Cluster, options: PlanOptions) -> Plan:
    """The fastest plan over the families that can serve ``cluster`` under ``options``.

    A family the options force (``pipeline=True``) is the only one tried, and must be
    available; one the options rule out (``False``) is not tried. A family that finds no
    plan that fits is recorded as infeasible; one that does not suit the model (too few
    layers, a batch that does not split …) is recorded as skipped with the reason — unless it
    was the only one tried, or it is the one-mesh family failing for a reason other than
    memory (then that error is the user's). A cluster of one device kind in one region gets
    pipeline stages over its hosts when asked (``pipeline=True``), or when no plan over one
    mesh fits. The plan lists every family tried (``plan.families``) and the hand-written
    baselines on this cluster (``plan.baselines``).
    """
    start = time.perf_counter()
    forced = [name for name in FAMILIES if options.forced(name)]
    for name in forced:
        reason = FAMILIES[name].unavailable(cluster, options)
        if reason:
            raise AutoparError(ErrorKind.BAD_INPUT, f"{name}=True, but {cluster.describe()} cannot host it: {reason}")
    tried = forced or [name for name, family in FAMILIES.items()
                       if options.forced(name) is not False and not family.unavailable(cluster, options)]
    found: dict[str, Plan] = {}
    entries: dict[str, dict] = {}
    error = None
    # a cluster of one kind pipelines over its hosts when no plan over one mesh fits
    over_hosts = "pipeline" not in tried and options.forced("pipeline") is None and not options.forced("replicas") \
        and not FAMILIES["pipeline"].unavailable(cluster, dataclasses.replace(options, pipeline=True))
    _check_pinned(graphs, cluster, options, tried)
    def attempt(name: str, family_options: PlanOptions) -> AutoparError | None:
        """Plan family ``name``: its plan, or why it found none, recorded; the error returned."""
        try:
            found[name] = FAMILIES[name].plan(graphs, cluster, family_options)
        except AutoparError as exc:
            entries[name] = {"predicted_step_s": None, "feasible": False}
            if exc.kind is ErrorKind.INFEASIBLE_MEMORY:
                entries[name]["reason"] = "does not fit in memory"
            else:  # not applicable to this model (batch, layers, tied weights …): say why, go on
                entries[name]["skipped"] = exc.message
                log.info("%s plans skipped: %s", name, exc.message)
            return exc
        entries[name] = {"predicted_step_s": found[name].predicted_step_s, "feasible": True}
        if name == "one_mesh":  # what a re-plan for new link speeds may carry over (planning.replan)
            entries[name]["mesh_bounds"] = _mesh_bounds(graphs, found[name])
        return None

    for name in tried:
        exc = attempt(name, options)
        if exc is None:
            continue
        fallback = over_hosts and exc.kind is ErrorKind.INFEASIBLE_MEMORY
        if (len(tried) == 1 and not fallback) or (name == "one_mesh" and exc.kind is not ErrorKind.INFEASIBLE_MEMORY):
            raise exc
        if exc.kind is ErrorKind.INFEASIBLE_MEMORY:
            error = error or exc
    if not found and over_hosts:
        log.info("no plan over one mesh fits: trying pipeline stages over the %d hosts", cluster.hosts)
        attempt("pipeline", dataclasses.replace(options, pipeline=True))
    if not found:
        raise error
    best = min(found.values(), key=lambda p: p.predicted_step_s)
    baselines = best.baselines if best.family == "one_mesh" else _baselines(graphs, cluster, options)
    best = dataclasses.replace(best, baselines=baselines, families=entries, work=step_work(graphs.full, cluster),
                               timings={**best.timings, "plan_s": time.perf_counter() - start,
                                        "capture_s": graphs.capture_s}, graphs=graphs)
    return _with_symbolic_costs(best, graphs, cluster) if options.symbolic else best


def _mesh_bounds(graphs: ModelGraphs, plan: Plan) -> dict:
    """The one-mesh search's lower bound on each mesh it tried, and the recompute mode it was
    made with: {"recompute", "bounds": [[mesh shape, seconds], …]} (a plan whose recomputed
    layers were cut after the search, planning.recompute_cut.fewest_layers, records the search's
    mode: its bounds are that mode's)."""
    mode = plan.solver.get("searched_recompute") or recompute_mode(layer_order(graphs.full.graph), plan.recompute)
    return {"recompute": mode,
            "bounds": [[list(c["mesh_shape"]), c["bound_s"]] for c in plan.mesh_candidates
                       if c.get("bound_s") is not None]}


def _check_pinned(graphs: ModelGraphs, cluster: Cluster, options: PlanOptions, tried: list[str]) -> None:
    """An option that pins what one family plans (micro_batches: the pipeline's; batch_split:
    the replicas') must reach a family that reads it, and fit the batch: an error now, rather
    than the option ignored or that family quietly skipped."""
    for option, family, meaning in (("micro_batches", "pipeline", "a pipeline's micro-batch count"),
                                    ("batch_split", "replicas", "the rows of each data-parallel replica")):
        value = getattr(options, option)
        if value is None:
            continue
        if family not in tried:
            why = (f"{family}=False" if options.forced(family) is False
                   else FAMILIES[family].unavailable(cluster, options)
                   or f"{family} plans are made on {cluster.describe()} only when forced ({family}=True)")
            raise AutoparError(ErrorKind.BAD_INPUT, f"{option}={value!r} pins {meaning}, but no {family} plan is made "
                               f"here: {why}; drop {option} or plan {family}=True on a cluster that can host it")
        batch = graphs.batch_rows(option)
        if option == "micro_batches":
            check_micro_batches(value, batch)
        else:
            check_batch_split(value, cluster, batch)


def _with_symbolic_costs(plan: Plan, graphs: ModelGraphs, cluster: Cluster) -> Plan:
    """``plan`` with its step time as a formula of the batch size (``plan.symbolic``)."""
    from autopar.planning.costing import symbolic_costs

    if plan.family != "one_mesh":
        raise AutoparError(ErrorKind.BAD_INPUT, "symbolic costs are made for plans over one mesh; this plan uses "
                           f"{'pipeline stages' if plan.stages else 'replicas'} — plan with pipeline=False, "
                           "replicas=False, or re-plan each batch size")
    start = time.perf_counter()
    symbolic = symbolic_costs(graphs.full, plan, cluster, graphs.model, graphs.inputs)
    return dataclasses.replace(plan, symbolic=symbolic,
                               timings={**plan.timings, "symbolic_s": time.perf_counter() - start})


def _baselines(graphs: ModelGraphs, cluster: Cluster, options: PlanOptions) -> dict[str, dict]:
    """The hand-written configurations over every device of ``cluster`` as one mesh (what a
    person would write), whichever family won."""
    if options.configuration is not None or not options.baselines:
        return {}
    try:
        return mesh_search(graphs, cluster, options).baselines
    except AutoparError as exc:  # the plan stands without them; say why they are missing
        log.warning("hand-written baselines not costed: %s", exc.message)
        return {}


def lower_plan(plan: Plan, model, loss_fn: Callable | None, captured=None):
    """``plan`` on ``model`` in the current process group, by the family that made it."""
    family = FAMILIES.get(plan.family)
    if family is None:
        raise AutoparError(ErrorKind.BAD_PLAN, f"plan family {plan.family!r} is not one this autopar knows "
                           f"({', '.join(FAMILIES)}); upgrade autopar or re-plan")
    return family.lower(plan, model, loss_fn, captured)
