"""Alpha-beta cost of collectives over one mesh dimension (ring algorithms).

``nbytes`` is the size of the *whole* tensor held by the group (before sharding on this
dimension), ``n`` the group size. Sources: Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH" (2005); the NCCL performance notes use the
same bus-bandwidth factors.

>>> link = Link(bandwidth_Bps=1e9, latency_s=0.0)
>>> all_reduce_s(4e9, 4, link)       # 2·(n−1)/n · bytes / bw
6.0
>>> all_gather_s(4e9, 4, link)       # (n−1)/n · bytes / bw
3.0
"""

from __future__ import annotations

from autopar.cluster import Link


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2·(n−1)/n · bytes / bw + 2·(n−1)·latency."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth_Bps + 2 * (n - 1) * link.latency_s


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather of a tensor of ``nbytes`` in total: (n−1)/n · bytes / bw + (n−1)·latency."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth_Bps + (n - 1) * link.latency_s


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter: same volume as all-gather."""
    return all_gather_s(nbytes, n, link)


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """Each rank keeps 1/n of its bytes/n shard and sends the rest: (n−1)/n² · bytes / bw."""
    if n <= 1:
        return 0.0
    return (n - 1) / (n * n) * nbytes / link.bandwidth_Bps + (n - 1) * link.latency_s
