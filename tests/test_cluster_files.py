"""Cluster YAML files: the documented forms load, WAN links decide cross-region groups,
bad files fail with the file, the line and the fix."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import AutoparError
from autopar.cluster import Cluster
from autopar.mesh import mesh_for_shape
from autopar.placements import R, parse_spec
from models import MLP

TWO_REGIONS = """\
regions:
  us-east: {device: A100-80GB, nodes: 2, per_node: 8,
            intra_node: {bandwidth_GBps: 300, latency_us: 2},
            inter_node: {bandwidth_GBps: 25, latency_us: 5}}
  eu-west: {device: A100-80GB, nodes: 1, per_node: 8}
links:
  - {between: [us-east, eu-west], bandwidth_GBps: 0.125, latency_ms: 80}
"""


def write(tmp_path, text, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_two_region_file_and_the_link_each_group_pays(tmp_path):
    cluster = Cluster.from_spec(write(tmp_path, TWO_REGIONS))
    assert cluster.num_devices == 24 and cluster.hosts == 3
    assert cluster.group_link(range(8)).bandwidth_Bps == 300e9  # one host: NVLink
    assert cluster.group_link(range(16)).bandwidth_Bps == 25e9  # two hosts of us-east: the network
    wan = cluster.group_link(range(24))  # spans regions: the WAN link decides
    assert wan.bandwidth_Bps == 0.125e9 and wan.latency_s == pytest.approx(0.08)
    mesh = mesh_for_shape(cluster, (3, 8))
    assert mesh.links[0] == wan and mesh.links[1].bandwidth_Bps == 300e9


def test_single_region_top_level_form_with_defaults_and_reserve(tmp_path):
    cluster = Cluster.from_spec(write(tmp_path, "device: H100\nnodes: 2\nper_node: 4\nmemory_reserve_GB: 5\n"))
    assert (cluster.hosts, cluster.devices_per_host, cluster.device.name) == (2, 4, "H100-SXM")
    assert cluster.memory_limit_bytes == 75 * 10**9
    assert cluster.intra_link.bandwidth_Bps == cluster.device.intra_node_bandwidth_Bps


def test_planning_on_a_cluster_file(tmp_path):
    path = write(tmp_path, "device: cpu\nnodes: 1\nper_node: 2\n")
    plan = autopar.plan(MLP(), (torch.randn(8, 16),), cluster=path)
    assert plan.num_devices == 2


@pytest.mark.parametrize("text, message", [
    ("device: H100\nnodes: 0\nper_node: 8\n", r"cluster.yaml:2: `nodes` must be a positive integer, got 0"),
    ("device: TPU\nnodes: 1\nper_node: 8\n", r"cluster.yaml:1: unknown device 'TPU'"),
    ("device: H100\nnodes: 1\nper_node: 8\ninter_node: {bandwidth_GBps: -3}\n",
     r"cluster.yaml:4: `bandwidth_GBps` must be a positive number, got -3"),
    ("device: H100\nnodes: two\nper_node: 8\n", r"`nodes` must be a positive integer, got 'two'"),
    ("regions:\n  a: {device: H100, nodes: 1, per_node: 8}\n  b: {device: H100, nodes: 1, per_node: 8}\n",
     r"no link between regions 'a' and 'b': add"),
    ("device: H100\nnodes: [1\n", r"cluster.yaml:\d+: not valid YAML"),
    ("device: H100\nper_node: 8\n", r"missing `nodes`"),
    ("device: H100\nnodes: 1\nper_node: 8\ncolour: blue\n", r"cluster.yaml:4: unknown key 'colour'"),
])
def test_bad_cluster_files(tmp_path, text, message):
    with pytest.raises(AutoparError, match=message) as info:
        Cluster.from_spec(write(tmp_path, text))
    assert info.value.kind is autopar.ErrorKind.BAD_CLUSTER


def test_mixed_device_regions_become_groups_and_a_uniform_mesh_runs_at_the_slowest(tmp_path):
    text = TWO_REGIONS.replace("eu-west: {device: A100-80GB", "eu-west: {device: V100-32GB")
    cluster = Cluster.from_spec(write(tmp_path, text))
    groups = cluster.groups()
    assert [(g.name, g.cluster.device.name, g.ranks) for g in groups] == [
        ("us-east", "A100-80GB", tuple(range(16))), ("eu-west", "V100-32GB", tuple(range(16, 24)))]
    assert groups[0].cluster.memory_limit_bytes == 80 * 10**9 and groups[1].cluster.memory_limit_bytes == 32 * 10**9
    assert groups[0].cluster.inter_link.bandwidth_Bps == 25e9
    v100 = groups[1].cluster.device
    assert cluster.device.flops_per_s("float32") == v100.flops_per_s("float32")
    assert cluster.memory_limit_bytes == 32 * 10**9
    assert cluster.link_between(*groups).bandwidth_Bps == 0.125e9
    assert cluster.describe() == "us-east:2x8xA100-80GB + eu-west:1x8xV100-32GB"


def test_regions_with_different_node_sizes_are_refused(tmp_path):
    text = TWO_REGIONS.replace("eu-west: {device: A100-80GB, nodes: 1, per_node: 8", "eu-west: {device: A100-80GB, nodes: 1, per_node: 4")
    with pytest.raises(AutoparError, match=r"different node sizes \(per_node \[4, 8\]\)"):
        Cluster.from_spec(write(tmp_path, text))


def test_no_collective_crosses_a_slow_wan_link(tmp_path):
    """Golden plan: with 1 Gbit/s between regions, nothing is sharded or reduced across the
    mesh dimension that spans them (every placement on that dim is R)."""
    path = write(tmp_path, TWO_REGIONS)
    with torch.device("meta"):
        model, x = MLP(1024, 4096, 1024, 2), torch.randn(48, 1024)
    plan = autopar.plan(model, (x,), cluster=path)
    mesh = mesh_for_shape(Cluster.from_spec(path), plan.mesh_shape)
    wan_dims = [d for d, link in enumerate(mesh.links) if link.bandwidth_Bps == 0.125e9]
    assert wan_dims, plan.mesh_shape  # the chosen mesh does span the regions
    placements = [p.placement for p in plan.parameters.values()]
    placements += [o for n in plan.nodes.values() for o in (*n.outputs, *n.inputs) if o]
    for d in wan_dims:
        assert {parse_spec(p)[d] for p in placements} == {R}


CUSTOM = """\
devices:
  lab-gpu: {peak_TFLOPS: {fp32: 10, bf16: 80}, memory_GB: 24, memory_bandwidth_GBps: 600,
            intra_node: {bandwidth_GBps: 32, latency_us: 8}}
device: lab-gpu
nodes: 1
per_node: 4
"""


def test_a_file_defines_its_own_device_kind(tmp_path):
    cluster = Cluster.from_spec(write(tmp_path, CUSTOM))
    assert cluster.device.name == "lab-gpu" and cluster.num_devices == 4
    assert cluster.device.flops_per_s("bfloat16") == 80e12 and cluster.device.compute_efficiency == 1.0
    assert cluster.memory_limit_bytes == 24 * 10**9 and cluster.intra_link.bandwidth_Bps == 32e9
    with pytest.raises(AutoparError, match=r"cluster.yaml:2: device 'lab-gpu' is missing `memory_GB`"):
        Cluster.from_spec(write(tmp_path, CUSTOM.replace("memory_GB: 24, ", "")))
    with pytest.raises(AutoparError, match=r"unknown device 'lab-gpu2'.* or one of this file's `devices` \(lab-gpu\)"):
        Cluster.from_spec(write(tmp_path, CUSTOM.replace("device: lab-gpu\n", "device: lab-gpu2\n")))
