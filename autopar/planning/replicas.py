"""Heterogeneous data parallelism: every device group (region) runs the whole model on its
own share of the global batch, shares sized by the groups' speed.

Split: each group's throughput is 1 / (its predicted step on an equal share); the batch is
divided in proportion (largest remainders, at least one row per group), unless the caller
pins ``batch_split``. One intra-operator plan, made for the group with the largest share on
that share, is used by every group (placements of corresponding devices then match, so
their gradient shards can be summed lane by lane) and re-costed on each group at its own
share (``costing.recost``).

Training stays identical to one device on the whole batch: group ``g``'s loss is weighted by
``b_g / B`` and the gradients are summed over groups, so with a batch-mean loss the summed
gradient is the mean over all ``B`` rows.

    step = max_g t_g(b_g) + all-reduce of each device's gradient shard between groups

Sparse tables (Parallax) may cross between groups as an all-gather of the rows each group
touched instead of in that all-reduce, whichever the link makes cheaper: over a WAN link a
table's dense gradient is the heaviest traffic of a step. ``plan.sparse[fqn]["between_groups"]``
names the choice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from collections.abc import Callable

from autopar.cluster import Cluster
from autopar.comm import all_gather_s, all_reduce_s
from autopar.errors import AutoparError, ErrorKind
from autopar.placements import split_over
from autopar.plan import Plan, ReplicaPlan, TensorSpec
from autopar.planning.costing import recost
from autopar.planning.one_mesh import group_plan, group_search
from autopar.planning.options import PlanOptions
from autopar.planning.pipeline import groups_unavailable
from autopar.planning.recompute_cut import fastest_that_fits, fewest_needed
from autopar.units import format_bytes
from autopar.passes.capture import Captured
from autopar.passes.stages import layer_order
from autopar.passes.sparse import INDEX_BYTES, LOOKUP_KEY, SPARSE_ALLGATHER, UNIT_LINK

log = logging.getLogger(__name__)


def proportional_split(batch: int, weights: list[float]) -> tuple[int, ...]:
    """Rows per group in proportion to ``weights``, summing to ``batch``, each at least one.

    >>> proportional_split(8, [3.0, 1.0])
    (6, 2)
    """
    if batch < len(weights):
        raise AutoparError(ErrorKind.BAD_INPUT, f"batch of {batch} rows cannot feed {len(weights)} replica groups")
    spare = batch - len(weights)  # one row each first
    exact = [spare * w / sum(weights) for w in weights]
    rows = [1 + int(e) for e in exact]
    for k in sorted(range(len(weights)), key=lambda k: int(exact[k]) - exact[k])[:batch - sum(rows)]:
        rows[k] += 1
    return tuple(rows)


def check_batch_split(split: tuple[int, ...], cluster: Cluster, batch: int) -> None:
    """A pinned ``batch_split`` gives every device group of ``cluster`` its rows (one or more;
    PlanOptions checks that) and sums to the batch: BAD_INPUT otherwise."""
    groups = len(cluster.groups())
    if len(split) != groups or sum(split) != batch:
        raise AutoparError(ErrorKind.BAD_INPUT, f"batch_split={split} must give each of the {groups} groups of "
                           f"{cluster.describe()} its rows ({groups} numbers of 1 or more) summing to the batch "
                           f"size {batch}")


class ReplicaGroups:
    """Family "replicas": every device group runs the whole model on its share of the batch."""

    name = "replicas"

    def unavailable(self, cluster: Cluster, options: PlanOptions) -> str | None:
        return groups_unavailable(cluster, options)

    def plan(self, graphs, cluster: Cluster, options: PlanOptions) -> Plan:
        """Every group a replica of the one-mesh plan of its share of the batch, recomputing
        its layers where keeping their activations does not fit
        (planning.recompute_cut.fastest_that_fits; whole layers only as many as the largest
        replica needs, :meth:`_fewest_layers`)."""
        return fastest_that_fits(options, lambda chosen: self._plan(graphs, cluster, chosen),
                                 cut=lambda full: self._fewest_layers(graphs, cluster, options, full))

    def _fewest_layers(self, graphs, cluster: Cluster, options: PlanOptions, full: Plan) -> Plan:
        """``full`` (every replica recomputing every layer) or, where faster and it fits, every
        group planned again recomputing only the first K layers (``block:K``), K the fewest the
        largest replica's placements need (planning.recompute_cut.fewest_needed, on its group's
        search; the others hold fewer rows)."""
        main = max(full.replicas, key=lambda replica: replica.batch)
        group = next(g for g in cluster.groups() if g.name == main.group)
        shared = group_plan(graphs, main.batch, group.cluster, dataclasses.replace(options, recompute="full"))
        layers = layer_order(graphs.full.graph)
        needed = fewest_needed(layers, group.cluster, options, shared,
                               lambda changed: group_search(graphs, main.batch, group.cluster, changed))
        if needed is None:
            return full
        log.info("replicas fit with the first %d of %d layers recomputed: planning them with block:%d", needed,
                 len(layers), needed)
        try:
            cut = self._plan(graphs, cluster, dataclasses.replace(options, recompute=f"block:{needed}"))
        except AutoparError as exc:
            if exc.kind is not ErrorKind.INFEASIBLE_MEMORY:
                raise
            return full
        return cut if cut.predicted_step_s < full.predicted_step_s else full

    def _plan(self, graphs, cluster: Cluster, options: PlanOptions) -> Plan:
        batch = graphs.batch_rows("replicas")
        groups = cluster.groups()
        start = time.perf_counter()
        if options.batch_split is None:
            share = max(1, batch // len(groups))
            speeds = [1.0 / group_plan(graphs, share, g.cluster, options).predicted_step_s for g in groups]
            split = proportional_split(batch, speeds)
        else:
            split = tuple(int(b) for b in options.batch_split)
            check_batch_split(split, cluster, batch)
        main = max(range(len(groups)), key=lambda g: split[g])
        shared = group_plan(graphs, split[main], groups[main].cluster, options)
        replicas, times = [], []
        for group, rows in zip(groups, split):
            step_s, memory = recost(graphs.at_rows(rows), shared, group.cluster, options.optimizer)
            if memory > group.cluster.memory_limit_bytes:
                raise AutoparError(ErrorKind.INFEASIBLE_MEMORY,
                                   f"replica on {group.name} ({len(group.ranks)}x{group.cluster.device.name}) with "
                                   f"{rows} rows needs {memory} bytes ({format_bytes(memory)}) per device, has "
                                   f"{group.cluster.memory_limit_bytes}; fixes: 1) a smaller batch_split share for "
                                   "it 2) pipeline stages instead", needed_bytes=memory)
            times.append(step_s)
            replicas.append((group, rows, step_s, memory))
        sync_s, between = _gradient_sync(cluster, groups, shared, [graphs.at_rows(rows) for rows in split])
        step = max(times) + sync_s
        lanes = len(groups[0].ranks)
        plan = dataclasses.replace(
            shared, inputs=tuple(TensorSpec.of(spec.name, x) for spec, x in zip(shared.inputs, graphs.inputs)),
            cluster=cluster.plan_header(), mesh_shape=(len(groups), lanes), mesh_dim_names=("replica", "lane"),
            predicted_step_s=step, predicted_comm_s=step - shared.predicted_compute_s,
            replicas=tuple(ReplicaPlan(
                group=g.name, device=g.cluster.device.name, ranks=g.ranks, mesh_shape=shared.mesh_shape,
                mesh_dim_names=shared.mesh_dim_names, step_s=t, sync_s=sync_s,
                memory=dataclasses.replace(shared.memory, activations_bytes=m - shared.memory.total_bytes
                                           + shared.memory.activations_bytes),
                batch=rows, fingerprint=graphs.at_rows(rows).fingerprint) for g, rows, t, m in replicas),
            sparse={fqn: {**table, "between_groups": between[fqn]["method"],
                          "between_groups_bytes": between[fqn]["bytes_per_step"]} if fqn in between else table
                    for fqn, table in shared.sparse.items()},
            options={**shared.options, "replicas": True}, baselines={}, family="replicas",
            timings={"plan_s": time.perf_counter() - start})
        log.info("replica plan: split %s, predicted step %.3g s", split, step)
        return plan

    def lower(self, plan: Plan, model, loss_fn: Callable | None, captured: Captured | None = None):
        from autopar.parallel import ParallelModule
        from autopar.passes.replica_lower import lower_replicas
        from autopar.planning.world import device_type, runtime_device

        # each group captures the model at its own share of the batch (the plan's replicas)
        kind = device_type(model)
        module, runtime = lower_replicas(model, plan, loss_fn, kind)
        return ParallelModule(module, plan, loss_fn, runtime, device=runtime_device(kind))


def _gradient_sync(cluster: Cluster, groups, plan: Plan, captures: list) -> tuple[float, dict[str, dict]]:
    """Time to sum every device's gradient shards over its lane (the k-th device of every
    group), and how each sparse table crosses: all-reduced with the dense gradients, or — where
    it is cheaper (Parallax, across a slow WAN above all) — as an all-gather of the rows each
    group touched. Lanes crossing a WAN link share it. ``captures``: each group's graph, whose
    lookups give the rows that group touches per step."""
    slowest = min((cluster.link_between(a, b) for i, a in enumerate(groups) for b in groups[i + 1:]),
                  key=lambda link: link.bandwidth_Bps)
    sharing = len(groups[0].ranks) if len({g.name for g in groups}) > 1 else 1
    n = len(groups)
    touched = [{lk.parameter: lk for node in c.graph.nodes if (lk := node.meta.get(LOOKUP_KEY)) is not None}
               for c in captures]
    dense_bytes, sparse_s, between = plan.memory.grads_bytes, 0.0, {}
    for fqn in sorted(plan.sparse):
        if not all(fqn in t for t in touched):
            continue
        placement = plan.parameters[fqn].spec
        row_split, col_split = split_over(placement, plan.mesh_shape, 0), split_over(placement, plan.mesh_shape, 1)
        lookup = touched[0][fqn]
        local_bytes = lookup.table_bytes // (row_split * col_split)
        # the busiest group's touched rows, over this device's share of them; the collective pads to it
        rows = max(math.ceil(t[fqn].touched_rows(1) / row_split) for t in touched)
        piece = rows * (lookup.row_bytes // col_split + INDEX_BYTES)
        volumes = {"allreduce": all_reduce_s(local_bytes, n, UNIT_LINK),
                   SPARSE_ALLGATHER: all_gather_s(n * piece, n, UNIT_LINK)}
        dense = all_reduce_s(dense_bytes * sharing, n, slowest) - all_reduce_s(
            (dense_bytes - local_bytes) * sharing, n, slowest)
        sparse = all_gather_s(n * piece * sharing, n, slowest)
        method = SPARSE_ALLGATHER if sparse < dense else "allreduce"
        if method == SPARSE_ALLGATHER:
            dense_bytes -= local_bytes
            sparse_s += sparse
        between[fqn] = {"method": method, "bytes_per_step": volumes}
    dense_s = all_reduce_s(dense_bytes * sharing, n, slowest) if dense_bytes > 0 else 0.0
    return dense_s + sparse_s, between
