"""Cluster topology: devices on hosts, links between them, and the link a device group pays.

A cluster is held as a networkx graph: one vertex per device (``("dev", rank)``) and per host
(``("host", i)``), a device-host edge carrying the intra-node link and a host-"network" edge
carrying the inter-node link. Ranks are numbered host-major, as torchrun numbers them.

>>> c = Cluster.from_spec("2x8xH100")
>>> c.num_devices, c.devices_per_host, c.device.name
(16, 8, 'H100-SXM')
>>> c.group_link(range(8)).bandwidth_Bps == c.device.intra_node_bandwidth_Bps
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import networkx as nx

from autopar.devices import MAX_DEVICES, DeviceSpec, Link, check_device_count, get_device
from autopar.errors import AutoparError, ErrorKind


_SHORTHAND = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*x\s*([A-Za-z][\w.\-]*)\s*$")


MAX_MEMORY_BYTES = 2 ** 60  # an exbibyte per device: beyond any device, still exact as a float


def checked_memory_limit(value) -> int:
    """A memory limit in bytes per device as an int: a finite positive number up to
    :data:`MAX_MEMORY_BYTES` (``nan``, ``inf`` and ``1e300`` are refused, not overflowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AutoparError(ErrorKind.BAD_CLUSTER, f"memory limit must be a number of bytes, got "
                           f"{type(value).__name__} {value!r}; pass e.g. memory_limit=8e9")
    if not math.isfinite(value):
        raise AutoparError(ErrorKind.BAD_CLUSTER,
                           f"memory limit must be a finite number of bytes, got {value}; pass e.g. memory_limit=8e9")
    if value < 1:
        raise AutoparError(ErrorKind.BAD_CLUSTER,
                           f"memory limit must be positive, at least 1 byte, got {value} bytes; pass e.g. "
                           "memory_limit=8e9")
    if value > MAX_MEMORY_BYTES:
        raise AutoparError(ErrorKind.BAD_CLUSTER, f"memory limit {value:g} bytes is beyond any device (at most "
                           f"{MAX_MEMORY_BYTES:.3g} bytes per device); give bytes, e.g. memory_limit=8e9")
    return int(value)


@dataclass(frozen=True)
class Cluster:
    """``hosts`` hosts with ``devices_per_host`` identical devices each (homogeneous spine)."""

    device: DeviceSpec
    hosts: int
    devices_per_host: int
    intra_link: Link
    inter_link: Link
    memory_limit_bytes: int
    host_regions: tuple[str, ...] = ()  # region of each host; empty = one region
    wan_links: tuple[tuple[str, str, Link], ...] = ()  # links between regions
    # regions whose devices or links differ from the fields above, as homogeneous clusters
    # of their own hosts; ``device`` and ``memory_limit_bytes`` are then the slowest and the
    # smallest, what one uniform mesh over every device runs at
    region_clusters: tuple[tuple[str, "Cluster"], ...] = ()
    # after host_stages: each group's region (lanes of groups in two regions share their WAN link)
    group_regions: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_spec(cls, spec: "str | Cluster", memory_limit_bytes: int | None = None) -> "Cluster":
        """Parse ``"NxDEVICE"`` (one host) or ``"HOSTSxGPUSxDEVICE"``; a Cluster passes through."""
        if isinstance(spec, Cluster):
            if memory_limit_bytes is None:
                return spec
            return dataclasses.replace(spec, memory_limit_bytes=checked_memory_limit(memory_limit_bytes))
        if isinstance(spec, str) and spec.strip().endswith((".yaml", ".yml")):
            from autopar.cluster_file import load_cluster_file

            fields = load_cluster_file(spec)  # this Cluster's fields, and each region's as its own
            regions = tuple((name, cls(**region)) for name, region in fields.pop("region_clusters", ()))
            return cls.from_spec(cls(**fields, region_clusters=regions), memory_limit_bytes)
        if not isinstance(spec, str):
            raise AutoparError(ErrorKind.BAD_CLUSTER,
                               f"cluster must be a string like '8xH100' or a Cluster, got {type(spec).__name__}")
        match = _SHORTHAND.match(spec)
        if match is None:
            hint = ""
            if os.path.isdir(spec):
                hint = f"; {spec} is a folder: name the cluster file (.yaml) inside it"
            elif os.path.exists(spec):
                hint = f"; {spec} is a file, but cluster files are YAML and end in .yaml or .yml (docs/clusters.md)"
            raise AutoparError(ErrorKind.BAD_CLUSTER,
                               f"cannot parse cluster {spec!r}; write 'NxDEVICE' (e.g. '8xH100') "
                               f"or 'HOSTSxGPUSxDEVICE' (e.g. '2x8xA100-80GB'), or give a cluster file{hint}")
        if max(len(match.group(1) or ""), len(match.group(2))) > 9:  # before int(): 10^9 of either is too many
            raise AutoparError(ErrorKind.BAD_CLUSTER,
                               f"cluster {spec if len(spec) <= 40 else spec[:40] + '…'!r} has more than "
                               f"{MAX_DEVICES:,} devices, the most autopar plans: check the host and device counts")
        hosts = int(match.group(1)) if match.group(1) else 1
        per_host = int(match.group(2))
        check_device_count(hosts * per_host, f"cluster {spec!r}")
        if hosts < 1 or per_host < 1:
            raise AutoparError(ErrorKind.BAD_CLUSTER,
                               f"cluster {spec!r} has {hosts * per_host} devices; it needs at least one")
        return cls.homogeneous(get_device(match.group(3)), hosts, per_host, memory_limit_bytes)

    @classmethod
    def homogeneous(cls, device: DeviceSpec, hosts: int, per_host: int,
                    memory_limit_bytes: int | None = None) -> "Cluster":
        check_device_count(hosts * per_host, f"a cluster of {hosts} x {per_host} {device.name}")
        limit = device.memory_bytes if memory_limit_bytes is None else checked_memory_limit(memory_limit_bytes)
        return cls(device=device, hosts=hosts, devices_per_host=per_host,
                   intra_link=Link.of_device(device, inter_node=False),
                   inter_link=Link.of_device(device, inter_node=True),
                   memory_limit_bytes=limit)

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.devices_per_host

    def graph(self) -> nx.Graph:
        """The topology as a graph whose edges carry ``link`` attributes."""
        g = nx.Graph()
        for host in range(self.hosts):
            g.add_edge(("host", host), ("network", self.region_of(host)), link=self.inter_link)
        for a, b, link in self.wan_links:
            g.add_edge(("network", a), ("network", b), link=link)
        for rank in range(self.num_devices):
            g.add_edge(("dev", rank), ("host", self.host_of(rank)), link=self.intra_link)
        return g

    def region_of(self, host: int) -> str:
        return self.host_regions[host] if self.host_regions else "default"

    def wan_link(self, a: str, b: str) -> Link:
        for x, y, link in self.wan_links:
            if {x, y} == {a, b}:
                return link
        raise AutoparError(ErrorKind.BAD_CLUSTER, f"no link between regions {a!r} and {b!r}")

    def group_link(self, ranks: Iterable[int]) -> Link:
        """The bottleneck link of a collective over ``ranks``: intra-node if they share a host,
        the network between hosts of one region, and the slowest WAN link across regions."""
        hosts = {self.host_of(r) for r in ranks}
        if len(hosts) <= 1:
            return self.intra_link
        regions = sorted({self.region_of(h) for h in hosts})
        if len(regions) == 1:
            return self.inter_link
        links = [self.wan_link(a, b) for i, a in enumerate(regions) for b in regions[i + 1:]]
        return min(links, key=lambda link: (link.bandwidth_Bps, -link.latency_s))

    def groups(self) -> list["DeviceGroup"]:
        """Device groups a pipeline can put its stages on: the regions, in the file's order,
        each a homogeneous cluster of its own hosts (one group when there are no regions)."""
        if not self.host_regions:
            return [DeviceGroup("default", self, tuple(range(self.num_devices)))]
        own = dict(self.region_clusters)
        found = []
        for name in dict.fromkeys(self.host_regions):
            hosts = [h for h in range(self.hosts) if self.host_regions[h] == name]
            ranks = tuple(r for h in hosts for r in range(h * self.devices_per_host, (h + 1) * self.devices_per_host))
            sub = own.get(name) or dataclasses.replace(self, hosts=len(hosts), host_regions=(), wan_links=(),
                                                       region_clusters=())
            found.append(DeviceGroup(name, sub, ranks))
        return found

    def link_between(self, a: "DeviceGroup", b: "DeviceGroup") -> Link:
        """Link that point-to-point traffic between two groups crosses."""
        return self.inter_link if a.name == b.name else self.wan_link(a.name, b.name)

    def describe(self) -> str:
        if self.host_regions and len(set(self.host_regions)) > 1:
            counts = {r: self.host_regions.count(r) for r in dict.fromkeys(self.host_regions)}
            device = {g.name: g.cluster.device.name for g in self.groups()}
            return " + ".join(f"{r}:{n}x{self.devices_per_host}x{device[r]}" for r, n in counts.items())
        if self.hosts == 1:
            return f"{self.devices_per_host}x{self.device.name}"
        return f"{self.hosts}x{self.devices_per_host}x{self.device.name}"

    def host_stages(self, per_region: int) -> "Cluster":
        """This cluster with each region's hosts cut into ``per_region`` groups of consecutive
        hosts, each group a region of its own (the device groups pipeline stages run on; issue
        21): groups of one region are joined by its hosts' network (``inter_link``), groups of
        two regions by the WAN link between those. ``per_region`` divides every region's hosts."""
        regions = list(dict.fromkeys(self.host_regions)) or ["default"]
        own = dict(self.region_clusters)
        names, home, clusters, group_of = [], [], [], {}
        for region in regions:
            hosts = [h for h in range(self.hosts) if self.region_of(h) == region]
            if len(hosts) % per_region:
                raise AutoparError(ErrorKind.BAD_CLUSTER, f"region {region!r} of {self.describe()} has {len(hosts)} "
                                   f"hosts: they do not split into {per_region} equal groups")
            per = len(hosts) // per_region
            for g in range(per_region):
                mine = hosts[g * per:(g + 1) * per]
                span = f"hosts{mine[0]}-{mine[-1]}" if per > 1 else f"host{mine[0]}"
                names.append(span if region == "default" else f"{region}/{span}")
                home.append(region)
                group_of.update(dict.fromkeys(mine, names[-1]))
                if region in own:
                    clusters.append((names[-1], dataclasses.replace(own[region], hosts=per)))
        wan = []
        for i, a in enumerate(names):
            for j in range(i + 1, len(names)):
                inside = own[home[i]].inter_link if home[i] in own else self.inter_link
                wan.append((a, names[j], inside if home[i] == home[j] else self.wan_link(home[i], home[j])))
        return dataclasses.replace(self, host_regions=tuple(group_of[h] for h in range(self.hosts)),
                                   wan_links=tuple(wan), region_clusters=tuple(clusters),
                                   group_regions=tuple(zip(names, home)))

    def home_region(self, group: str) -> str:
        """The region a device group lies in: itself, or the region a host split cut it from."""
        return dict(self.group_regions).get(group, group)

    def with_link(self, which: str, bandwidth_Bps: float, latency_s: float | None = None) -> "Cluster":
        """This cluster with one link changed (``autopar replan --link``): ``"intra_node"`` (the
        devices of a host), ``"inter_node"`` (hosts of a region) — in every region — or
        ``"a-b"``, the WAN link between regions a and b. ``latency_s`` None keeps the link's."""
        def changed(link: Link) -> Link:
            return dataclasses.replace(link, bandwidth_Bps=bandwidth_Bps,
                                       latency_s=link.latency_s if latency_s is None else latency_s)

        if which in ("intra_node", "inter_node"):
            field = "intra_link" if which == "intra_node" else "inter_link"
            regions = tuple((name, dataclasses.replace(sub, **{field: changed(getattr(sub, field))}))
                            for name, sub in self.region_clusters)
            return dataclasses.replace(self, **{field: changed(getattr(self, field))}, region_clusters=regions)
        a, b = self._regions_of_link(which)
        old = self.wan_link(a, b)
        links = tuple((x, y, changed(link) if link is old and {x, y} == {a, b} else link)
                      for x, y, link in self.wan_links)
        return dataclasses.replace(self, wan_links=links)

    def link_named(self, which: str) -> Link:
        """The link ``with_link`` would change: ``"intra_node"``, ``"inter_node"`` (this
        cluster's own figure) or the WAN link ``"a-b"``."""
        if which in ("intra_node", "inter_node"):
            return self.intra_link if which == "intra_node" else self.inter_link
        return self.wan_link(*self._regions_of_link(which))

    def _regions_of_link(self, which: str) -> tuple[str, str]:
        """The two regions of the WAN link named ``"a-b"`` (region names may hold '-')."""
        names = set(self.host_regions)
        pairs = [(which[:i], which[i + 1:]) for i, c in enumerate(which) if c == "-"]
        found = next(((x, y) for x, y in pairs if x in names and y in names and x != y), None)
        if found is None:
            known = ", ".join(f"{x}-{y}" for x, y, _ in self.wan_links) or "none: the cluster has one region"
            raise AutoparError(ErrorKind.BAD_CLUSTER,
                               f"no link {which!r} to change: name intra_node, inter_node or two regions joined by "
                               f"'-' (WAN links: {known})")
        return found

    def plan_header(self) -> dict:
        """What a plan records of its cluster (``plan.cluster``): its shape, every link's figures
        and a digest of the rest (what a re-plan needs to tell a change of link speeds alone)."""
        return {"spec": self.describe(), "device": self.device.name, "hosts": self.hosts,
                "devices_per_host": self.devices_per_host, "memory_limit_bytes": self.memory_limit_bytes,
                "links": {name: link.record() for name, link in self.named_links().items()},
                "topology": self.topology_digest()}

    def named_links(self) -> dict[str, Link]:
        """Every link by name: ``intra_node``, ``inter_node``, ``a-b`` between regions a and b,
        and a region's own as ``region/intra_node`` (its cluster's links)."""
        found = {"intra_node": self.intra_link, "inter_node": self.inter_link}
        found.update({f"{a}-{b}": link for a, b, link in self.wan_links})
        for name, sub in self.region_clusters:
            found.update({f"{name}/{key}": link for key, link in sub.named_links().items()})
        return found

    def fingerprint(self) -> str:
        """A digest of every field: two clusters with one fingerprint plan alike (a re-plan finds
        the plans of device groups whose own cluster did not change: planning.one_mesh.group_plan)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def topology_digest(self) -> str:
        """A digest of everything but the links' figures (devices, hosts, regions, memory limit):
        two clusters with the same digest differ at most in how fast their links are."""
        return self._without_links().fingerprint()

    def _without_links(self) -> "Cluster":
        return dataclasses.replace(self, intra_link=_NO_LINK, inter_link=_NO_LINK,
                                   wan_links=tuple((a, b, _NO_LINK) for a, b, _ in self.wan_links),
                                   region_clusters=tuple((n, c._without_links()) for n, c in self.region_clusters))


_NO_LINK = Link(1.0, 0.0)  # stands for every link in a topology digest


@dataclass(frozen=True)
class DeviceGroup:
    """Identical devices with fast links between them (a region): a pipeline stage's home."""

    name: str
    cluster: Cluster  # the group alone, as a homogeneous cluster
    ranks: tuple[int, ...]  # global ranks, host-major
