"""Candidate device meshes for a cluster, and the link each mesh dimension runs over.

A mesh of shape ``(a, b)`` lays ranks out row-major, so the last dimension holds
consecutive ranks; keeping it inside a host puts tensor-parallel traffic on NVLink.

>>> [m.shape for m in candidate_meshes(Cluster.from_spec("2x4xH100"))]
[(8,), (4, 2), (2, 4)]
>>> [m.shape for m in three_dim_refinements(Cluster.from_spec("8x8xH100"), (8, 8))]
[(2, 4, 8), (4, 2, 8)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.cluster import Cluster, Link
from autopar.errors import AutoparError, ErrorKind


@dataclass(frozen=True)
class MeshSpec:
    """A logical mesh over ``prod(shape)`` ranks with the link of each dimension."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    links: tuple[Link, ...]

    @property
    def num_devices(self) -> int:
        return int(np.prod(self.shape))


def mesh_for_shape(cluster: Cluster, shape: tuple[int, ...]) -> MeshSpec:
    """Link per mesh dim = bottleneck link of the group containing rank 0 along that dim."""
    ranks = np.arange(cluster.num_devices).reshape(shape)
    links = []
    for dim in range(len(shape)):
        index = [0] * len(shape)
        index[dim] = slice(None)
        links.append(cluster.group_link(int(r) for r in ranks[tuple(index)]))
    names = ("dp",) if len(shape) == 1 else tuple(f"d{i}" for i in range(len(shape)))
    return MeshSpec(shape=tuple(shape), dim_names=names, links=tuple(links))


def checked_mesh(cluster: Cluster, shape) -> MeshSpec:
    """The mesh of a shape a user or a plan gives, which must factor the cluster's devices."""
    shape = tuple(int(s) for s in shape)
    if math.prod(shape) != cluster.num_devices or any(s < 1 for s in shape):
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"mesh_shape {shape} has {math.prod(shape)} devices but the cluster has "
                           f"{cluster.num_devices}; use a factorisation of {cluster.num_devices}")
    return mesh_for_shape(cluster, shape)


def candidate_meshes(cluster: Cluster) -> list[MeshSpec]:
    """1-D mesh over all devices, plus 2-D meshes whose inner dim divides a host."""
    n = cluster.num_devices
    shapes: list[tuple[int, ...]] = [(n,)]
    for inner in range(2, n):
        if n % inner == 0 and cluster.devices_per_host % inner == 0 and n // inner > 1:
            shapes.append((n // inner, inner))
    return [mesh_for_shape(cluster, s) for s in shapes]


def three_dim_refinements(cluster: Cluster, shape: tuple[int, ...]) -> list[MeshSpec]:
    """3-D meshes that split a 2-D mesh's outer dim ``x`` into ``a × x/a``: a data-parallel
    dim over ``a`` groups of whole hosts (HSDP's replicate dim; passes.strategies prunes it to
    batch splits) outside the rest — DP-replicate × DP-shard × TP, or DP × FSDP × TP. The
    one-mesh search tries them after the 2-D meshes, from the best of those."""
    if len(shape) != 2:
        return []
    outer, inner = shape
    return [mesh_for_shape(cluster, (a, outer // a, inner)) for a in range(2, outer // 2 + 1)
            if outer % a == 0 and cluster.hosts % a == 0]
