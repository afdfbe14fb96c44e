"""What moving a training state from one plan to another costs (``autopar.replan``): the
bytes each device must receive — its new piece of every parameter's master weight and
optimizer states, less what it already holds — and their time on the new cluster.

A device's piece of a tensor under a placement is a box: per tensor dim an interval, cut by
every mesh dim that shards it, in mesh-dim order, as DTensor's ``Shard`` chunks it (the last
chunks may be short or empty); replicated and partial mesh dims keep the whole interval; an
owned ("O") expert weight is counted like rows split by owner. Ranks keep their number from
one plan to the other (rank r of the old mesh is rank r of the new one); a rank the old plan
did not have (a host added) holds nothing yet. Gradients are not moved: the next step makes
them. Plans over several device groups (pipeline stages, replicas) are counted as if every
device received its whole new state — an upper bound, stated as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar import placements as pl
from autopar.cluster import Cluster
from autopar.mesh import mesh_for_shape
from autopar.plan import Plan

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Migration:
    """The busiest device's receive: bytes, seconds on the new cluster's links, and how the
    count was made (exact per placement, or an upper bound)."""

    bytes: int
    seconds: float
    exact: bool


def piece(shape: tuple[int, ...], mesh_shape: tuple[int, ...], spec: pl.Spec, rank: int) -> Box:
    """The box of ``shape`` that ``rank`` holds under ``spec`` on a mesh of ``mesh_shape``."""
    coords = []
    rest = rank
    for size in reversed(mesh_shape):  # row-major: the last mesh dim varies fastest
        coords.append(rest % size)
        rest //= size
    coords.reverse()
    box = [(0, n) for n in shape]
    for k, placement in enumerate(spec):
        dim = placement.dim if isinstance(placement, pl.Shard) else 0 if placement is pl.O else None
        if dim is None or not shape:
            continue
        low, high = box[dim]
        chunk = math.ceil((high - low) / mesh_shape[k])
        box[dim] = (min(low + coords[k] * chunk, high), min(low + (coords[k] + 1) * chunk, high))
    return tuple(box)


def _volume(box: Box) -> int:
    return math.prod(max(high - low, 0) for low, high in box)


def _overlap(a: Box, b: Box) -> int:
    return math.prod(max(min(ha, hb) - max(la, lb), 0) for (la, ha), (lb, hb) in zip(a, b))


def received_elements(shape: tuple[int, ...], old: tuple[tuple[int, ...], pl.Spec] | None,
                      new: tuple[tuple[int, ...], pl.Spec], rank: int, old_ranks: int) -> int:
    """Elements of one tensor ``rank`` must receive to hold its piece under ``new`` (mesh
    shape, spec), holding its piece under ``old`` (None: nothing) if it is one of the old
    plan's ``old_ranks`` ranks."""
    wanted = piece(shape, *new, rank)
    if old is None or rank >= old_ranks:
        return _volume(wanted)
    return _volume(wanted) - _overlap(wanted, piece(shape, *old, rank))


def migration(old: Plan, new: Plan, cluster: Cluster, shapes: dict[str, tuple[int, ...]],
              element_bytes: dict[str, int], states: int) -> Migration:
    """The busiest device's receive moving from ``old`` to ``new`` on ``cluster``: every
    parameter's master weight and its ``states`` optimizer states (``element_bytes`` each
    element, ``shapes`` by parameter name)."""
    copies = 1 + states
    if old.family != "one_mesh" or new.family != "one_mesh":
        most = max(_whole_state(new, shapes, element_bytes, copies, rank) for rank in range(new.num_devices))
        return Migration(most, _seconds(most, new, cluster), exact=False)
    old_ranks = old.num_devices
    busiest = 0
    for rank in range(new.num_devices):
        total = 0
        for fqn, planned in new.parameters.items():
            before = old.parameters.get(fqn)
            old_place = (tuple(old.mesh_shape), before.state_spec) if before is not None else None
            total += copies * element_bytes[fqn] * received_elements(
                shapes[fqn], old_place, (tuple(new.mesh_shape), planned.state_spec), rank, old_ranks)
        busiest = max(busiest, total)
    return Migration(busiest, _seconds(busiest, new, cluster), exact=True)


def _whole_state(plan: Plan, shapes, element_bytes, copies: int, rank: int) -> int:
    """Bytes of ``rank``'s whole state under a one-mesh ``plan``; for other plans every
    parameter's (a bound)."""
    if plan.family != "one_mesh":
        return sum(copies * element_bytes[fqn] * math.prod(shapes[fqn]) for fqn in plan.parameters)
    return sum(copies * element_bytes[fqn] * _volume(piece(shapes[fqn], tuple(plan.mesh_shape), p.state_spec, rank))
               for fqn, p in plan.parameters.items())


def _seconds(nbytes: int, plan: Plan, cluster: Cluster) -> float:
    """``nbytes`` over the slowest link of the new plan's mesh (pieces come from any device);
    of a plan over several device groups, the slowest link of the whole cluster."""
    if not nbytes:
        return 0.0
    shape = tuple(plan.mesh_shape) if plan.family == "one_mesh" else (cluster.num_devices,)
    slowest = min(mesh_for_shape(cluster, shape).links, key=lambda link: link.bandwidth_Bps)
    return slowest.latency_s + nbytes / slowest.bandwidth_Bps
