"""Watch the links a running plan depends on, and re-plan when one drifts (issue 24, item 2).

Cross-region links are shared: their bandwidth moves by several times over a day (DeepCEE
re-partitions when measured bandwidth drifts from its profile). A :class:`LinkWatcher`
attached to a ``ParallelModule`` (``autopar.watch_links``) times each link the plan
crosses every ``every`` steps — between its device groups (pipeline stages, replicas), or
between the regions or hosts its mesh spans (passes.link_probe: one ping-pong per link, a
few MiB; two replica groups: the plan's own gradient all-reduce between them, timed on the
step before the check) — compares the bandwidth it measures with the cluster's figure, and when a link stays
off by more than ``threshold`` for ``patience`` checks in a row, re-plans the model for the
cluster with that link's measured bandwidth (``autopar.replan``: rank 0 plans, every rank
gets the answer) and calls ``on_change(cluster, answer)`` on every rank. Nothing switches by
itself: the hook decides (``answer.switch``, ``answer.reason``; ``autopar.reshard`` moves
the state to the new plan). The watcher then compares with the new figure, so one drift
calls the hook once.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable

import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.devices import MAX_LINK_BANDWIDTH_Bps
from autopar.errors import AutoparError, ErrorKind

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LinkReading:
    """One link at one check: the name ``Cluster.with_link`` takes (``a-b`` or ``inter_node``),
    the bandwidth the cluster gives it, the one measured, and measured time over expected."""

    link: str
    planned_Bps: float
    measured_Bps: float
    slowdown: float


class LinkWatcher:
    """See the module docstring. ``probe(pairs, nbytes)`` times the links, one rank pair each
    (tests give a stand-in); ``replan(plan, cluster)`` makes the answer (``autopar.watch_links``
    gives ``autopar.replan`` of the model on its example inputs)."""

    def __init__(self, plan, cluster: Cluster, on_change: Callable, replan: Callable, *, every: int = 100,
                 threshold: float = 0.5, patience: int = 3, probe_bytes: int = 4 << 20,
                 probe: Callable | None = None, runtime=None) -> None:
        hops = _hops(plan, cluster)
        if not hops:
            raise AutoparError(ErrorKind.BAD_INPUT, f"watch_links watches the links between hosts, regions or the "
                               f"plan's device groups; this plan runs on one host of {cluster.describe()}: there is "
                               "no such link to watch")
        for name, value, low in (("every", every, 1), ("patience", patience, 1), ("probe_bytes", probe_bytes, 4)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise AutoparError(ErrorKind.BAD_INPUT, f"watch_links: {name} must be a whole number of {low} or "
                                   f"more, got {value!r}")
        if not isinstance(threshold, (int, float)) or not 0 < threshold < float("inf"):
            raise AutoparError(ErrorKind.BAD_INPUT, f"watch_links: threshold is the relative drift that counts (0.5: "
                               f"50% slower or faster), a positive number; got {threshold!r}")
        self.plan, self.cluster, self.on_change, self.replan = plan, cluster, on_change, replan
        self.every, self.threshold, self.patience, self.probe_bytes = every, threshold, patience, probe_bytes
        if probe is None:
            from autopar.passes.link_probe import probe_hops as probe
        self.probe = probe
        self.pairs = [pair for pair, _ in hops]
        self.hops = [link for _, link in hops]
        # two replica groups: the plan's own gradient all-reduce between them is timed instead
        # of a probe (passes.replica_lower.ReplicaRuntime.time_sync, armed a step before a check)
        self.own = runtime if plan.replicas and len(self.hops) == 1 and hasattr(runtime, "time_sync") else None
        self.steps = 0
        self._arm()
        self.readings: list[list[LinkReading]] = []  # every check's, in order
        self._streak: dict[str, list[float]] = {}  # link -> measured bandwidths of its current run off

    def after_step(self):
        """Called by ``ParallelModule.step`` on every rank: a check every ``every`` steps.
        Returns the re-plan answer when a link drifted (the hook got it too), else None."""
        self.steps += 1
        answer = self.check() if self.steps % self.every == 0 else None
        self._arm()
        return answer

    def _arm(self) -> None:
        """Have the runtime time the next step's gradient all-reduce when a check follows it."""
        if self.own is not None and (self.steps + 1) % self.every == 0:
            self.own.time_sync = True

    def check(self):
        """Time the links now (or read the replicas' timed all-reduce); re-plan and call the
        hook when one has drifted for ``patience`` checks in a row."""
        readings = self._own_readings()
        if readings is None:
            times = self.probe(self.pairs, self.probe_bytes)
            readings = [self._reading(link, seconds, self.probe_bytes) for link, seconds in zip(self.hops, times)]
        self.readings.append(readings)
        by_link: dict[str, list[LinkReading]] = {}
        for reading in readings:  # several hops may cross one link (hosts of a region): their median counts
            by_link.setdefault(reading.link, []).append(reading)
        for link, seen in by_link.items():
            middle = sorted(seen, key=lambda r: r.slowdown)[len(seen) // 2]
            off = not 1 / (1 + self.threshold) <= middle.slowdown <= 1 + self.threshold
            self._streak[link] = [*self._streak.get(link, []), middle.measured_Bps] if off else []
        drifted = {link: statistics.median(seen) for link, seen in self._streak.items() if len(seen) >= self.patience}
        if not drifted:
            return None
        cluster = self.cluster
        for link, bandwidth in drifted.items():
            log.warning("link %s measured at %.3g GB/s for %d checks in a row; the cluster gives it %.3g GB/s", link,
                        bandwidth / 1e9, len(self._streak[link]), cluster.link_named(link).bandwidth_Bps / 1e9)
            cluster = cluster.with_link(link, bandwidth)
        answer = self._replanned(cluster)
        self.cluster, self._streak = cluster, {}
        if answer is not None:
            self.on_change(cluster, answer)
        return answer

    def _own_readings(self) -> list[LinkReading] | None:
        """The link between two replica groups as their last timed gradient all-reduce saw it
        (None without one: then a probe): each rank all-reduced ``nbytes`` with its peer in
        the other group — a two-member ring, so it sent them once in 2 latencies, at the link's
        all-reduce efficiency — and the lanes of two regions share their WAN link, as the plan
        costs them (planning.replicas). The slowest rank's time counts."""
        timed = self.own.timed_sync if self.own is not None else None
        if timed is None or timed[0] <= 0:
            return None
        self.own.timed_sync = None
        nbytes, seconds = timed
        if dist.is_initialized():  # every rank decides on the same reading
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, seconds)
            seconds = max(every_rank)
        link = self.hops[0]
        planned = self.cluster.link_named(link)
        sharing = len(self.plan.replicas[0].ranks) if link != "inter_node" else 1
        return [self._reading(link, seconds, nbytes * sharing, latencies=2,
                              efficiency=planned.efficiency("all_reduce"))]

    def _reading(self, link: str, seconds: float, nbytes: int, latencies: int = 1,
                 efficiency: float = 1.0) -> LinkReading:
        """``nbytes`` over ``link`` took ``seconds``, ``latencies`` of its latency included and
        moving at ``efficiency`` of its bandwidth."""
        planned = self.cluster.link_named(link)
        moving_s = nbytes / (planned.bandwidth_Bps * efficiency)
        # the time above the link's latency is the bytes moving: bandwidth = bytes / that time
        moving = seconds - latencies * planned.latency_s
        measured_Bps = min(MAX_LINK_BANDWIDTH_Bps, nbytes / (efficiency * max(moving, 1e-9)))
        return LinkReading(link, planned.bandwidth_Bps, measured_Bps, max(moving, 0.0) / moving_s)

    def _replanned(self, cluster: Cluster):
        """``replan(plan, cluster)`` on rank 0, the answer (or its error) sent to every rank."""
        box: list = [None]
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                box[0] = self.replan(self.plan, cluster)
            except AutoparError as exc:  # every rank learns it
                box[0] = exc
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], AutoparError):
            log.warning("a link drifted (%s) but re-planning failed: %s", cluster.describe(), box[0].message)
            return None
        log.warning("a link drifted: re-planned for %s; %s", cluster.describe(), getattr(box[0], "reason", box[0]))
        return box[0]


def _hops(plan, cluster: Cluster) -> list[tuple[tuple[int, int], str]]:
    """The links to time, each as (the two ranks that probe it, its name for
    ``Cluster.with_link``): between consecutive device groups of a pipeline or replica plan;
    for a plan over one mesh, between the first hosts of every two regions, or — one region
    of several hosts — between the first two hosts."""
    groups = plan.stages or plan.replicas
    if groups:  # interleaved chunks cross the same links again: each once
        hops = [((a.ranks[0], b.ranks[0]), _link_name(cluster, a.group, b.group)) for a, b in zip(groups, groups[1:])]
        return list(dict.fromkeys(hops))
    first_host = {}
    for host in range(cluster.hosts):
        first_host.setdefault(cluster.region_of(host), host)
    if len(first_host) > 1:
        return [((first_host[a] * cluster.devices_per_host, first_host[b] * cluster.devices_per_host), f"{a}-{b}")
                for a, b, _ in cluster.wan_links]
    if cluster.hosts > 1:
        return [((0, cluster.devices_per_host), "inter_node")]
    return []


def _link_name(cluster: Cluster, a: str, b: str) -> str:
    """What ``Cluster.with_link`` calls the link between groups ``a`` and ``b``: the WAN link
    between their regions, or the network between hosts of one region."""
    home_a, home_b = _region_of(cluster, a), _region_of(cluster, b)
    if home_a is not None and home_b is not None and home_a != home_b:
        return f"{home_a}-{home_b}"
    return "inter_node"


def _region_of(cluster: Cluster, group: str) -> str | None:
    """The region of a device group: a region's own name, or the one a host split cut it from
    (``a/host0``); None for host groups of a cluster without regions (``hosts0-1``)."""
    region = cluster.home_region(group).split("/", 1)[0]
    return region if region in set(cluster.host_regions) else None
