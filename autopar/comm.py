"""Alpha-beta cost of collectives over one mesh dimension.

``nbytes`` is the size of the *whole* tensor held by the group (before sharding on this
dimension), ``n`` the group size. Each collective takes the faster of the algorithms a
library picks between: ring (bandwidth-optimal, latency linear in n) and a tree / recursive
doubling form (latency logarithmic in n) — on 1024 ranks a ring all-reduce of a small
activation pays 2·1023 latencies, a double binary tree 2·10. Sources: Thakur, Rabenseifner
& Gropp, "Optimization of Collective Communication Operations in MPICH" (2005); NCCL's
ring/tree selection and bus-bandwidth factors.

>>> link = Link(bandwidth_Bps=1e9, latency_s=0.0)
>>> all_reduce_s(4e9, 4, link)       # 2·(n−1)/n · bytes / bw
6.0
>>> all_gather_s(4e9, 4, link)       # (n−1)/n · bytes / bw
3.0
>>> slow = Link(bandwidth_Bps=1e9, latency_s=1e-3)
>>> round(all_reduce_s(1e3, 1024, slow), 6)  # tiny message: the tree's 2·10 latencies, not the ring's 2·1023
0.020002
"""

from __future__ import annotations

from autopar.cluster import Link

# DistributedDataParallel's bucket_cap_mb default: gradients all-reduced in buckets this large
DDP_BUCKET_BYTES = 25 * 2**20


def _symbolic(x) -> bool:
    return type(x).__module__.startswith("sympy")


def smallest(a, b):
    """min() that also takes sympy expressions (symbolic costs, passes.symbolic)."""
    if not (_symbolic(a) or _symbolic(b)):
        return min(a, b)
    import sympy

    return sympy.Min(a, b)


def largest(a, b):
    """max() that also takes sympy expressions."""
    if not (_symbolic(a) or _symbolic(b)):
        return max(a, b)
    import sympy

    return sympy.Max(a, b)


def _log2(n: int) -> int:
    return max(1, (n - 1).bit_length())  # ⌈log2 n⌉ rounds


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """min(ring: 2·(n−1)/n · bytes/bw + 2·(n−1)·latency,
    double binary tree: 2 · bytes/bw + 2·⌈log2 n⌉·latency)."""
    if n <= 1:
        return 0.0
    ring = 2 * (n - 1) / n * nbytes / link.bandwidth_Bps + 2 * (n - 1) * link.latency_s
    tree = 2 * nbytes / link.bandwidth_Bps + 2 * _log2(n) * link.latency_s
    return smallest(ring, tree) / link.efficiency("all_reduce")


def all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """All-gather of a tensor of ``nbytes`` in total: (n−1)/n · bytes/bw, with the ring's
    (n−1) latencies or recursive doubling's ⌈log2 n⌉ (same volume; Bruck for non-powers of 2)."""
    if n <= 1:
        return 0.0
    return _gather_like_s(nbytes, n, link) / link.efficiency("all_gather")


def _gather_like_s(nbytes: float, n: int, link: Link) -> float:
    return (n - 1) / n * nbytes / link.bandwidth_Bps + min(n - 1, _log2(n)) * link.latency_s


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter: same volume as all-gather."""
    if n <= 1:
        return 0.0
    return _gather_like_s(nbytes, n, link) / link.efficiency("reduce_scatter")


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    """Each rank keeps 1/n of its bytes/n shard and sends the rest: (n−1)/n² · bytes / bw."""
    if n <= 1:
        return 0.0
    return ((n - 1) / (n * n) * nbytes / link.bandwidth_Bps + (n - 1) * link.latency_s) / link.efficiency("all_to_all")
