"""Collectives between local gloo processes, as ``autopar profile`` measures them: their times
per message size, the ring formula's (β, α) fitted to them, how far each kind falls short of
its formula, and how much of each kind the host hides behind compute issued while it runs.
Called inside the measuring processes (autopar.profile starts them).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.distributed as dist

from autopar.devices import OVERLAP_KINDS

GB = 10**9


def median_time(fn, repeats: int, before=None) -> float:
    """Median seconds of ``fn()``; ``before()`` runs untimed ahead of each call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collective_times(world: int, sizes: list[int], repeats: int) -> dict[str, list[float]]:
    """Median seconds of each collective kind per message size (bytes of the whole tensor),
    issued the way lowered programs issue them: a DTensor redistribute on a 1-D mesh, after a
    little compute (so the communication thread's wake-up is paid as in a step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    a = torch.randn(96, 96)
    kinds = {"all_reduce": (Partial(), Replicate(), False), "all_gather": (Shard(0), Replicate(), True),
             "reduce_scatter": (Partial(), Shard(0), False), "all_to_all": (Shard(0), Shard(1), True)}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for nbytes in sizes:
        side = square_side(nbytes, world)
        for kind, (src, dst, sharded) in kinds.items():
            local = torch.ones(side // world if sharded else side, side)
            dist.barrier()
            times[kind].append(median_time(
                lambda: DTensor.from_local(local, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local(),
                2 * repeats + 1, before=lambda: a @ a))
    return times


def collective_overlap(nbytes: int = 2**22, repeats: int = 5, trials: int = 7) -> dict[str, float]:
    """Per collective kind the overlap model runs beside compute (devices.OVERLAP_KINDS), the
    fraction of it this host hides behind compute issued while it runs, as the lowered
    program issues prefetched gathers and gradient buckets (``async_op=True``, then matmuls,
    then ``wait``): (t_compute + t_collective − t_both) / min(t_compute, t_collective), the
    compute sized to take about as long as the collective; clipped to [−1, 1] (below 0 the
    pair took longer than the two one after the other). The median of ``trials``: on a small
    host a trial swings by ±0.3 (on a 2-vCPU VM gloo's thread and the compute share the two
    cores; one all-reduce trial gave −1.48 beside −0.03 and −0.04). Called on every rank of
    the group alike (the collectives must match); each returns its own."""
    return {kind: statistics.median(_overlap_trial(kind, nbytes, repeats) for _ in range(trials))
            for kind in OVERLAP_KINDS}


def _overlap_trial(kind: str, nbytes: int, repeats: int) -> float:
    world = dist.get_world_size()
    flat, a = torch.ones(nbytes // 4 // world * world), torch.randn(256, 256)
    gathered, shard = torch.empty(flat.numel() * world), torch.empty(flat.numel() // world)

    def collective(async_op: bool = False):
        if kind == "all_gather":
            return dist.all_gather_into_tensor(gathered, flat, async_op=async_op)
        if kind == "reduce_scatter":
            return dist.reduce_scatter_tensor(shard, flat, async_op=async_op)
        return dist.all_reduce(flat, async_op=async_op)

    with warnings.catch_warnings():  # the *_tensor names are the ones every torch release has
        warnings.simplefilter("ignore", FutureWarning)
        return hidden_fraction(collective, lambda: a @ a, lambda fn: median_time(fn, repeats, before=dist.barrier),
                               torch.device("cpu"))


def hidden_fraction(collective, matmul, timed, device: torch.device) -> float:
    """How much of ``collective`` (called as ``collective(async_op=...)``) hides behind as many
    ``matmul()`` calls as take about as long, issued while it runs:
    (t_compute + t_collective − t_both) / min(t_compute, t_collective), clipped to [−1, 1].
    ``timed(fn)``: seconds of one call of ``fn``; ``device``: where the group's collectives
    take tensors (every rank agrees on the matmul count through one all-reduce)."""
    alone_s = timed(collective)
    counts = torch.tensor([max(1, round(alone_s / timed(matmul)))], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the same work on every rank
    count = int(counts)

    def compute():
        for _ in range(count):
            matmul()

    def both():
        work = collective(async_op=True)
        compute()
        work.wait()

    compute_s, both_s = timed(compute), timed(both)
    return min(1.0, max(-1.0, (compute_s + alone_s - both_s) / min(compute_s, alone_s)))


def overlap_entries(overlap: dict[str, float]) -> dict:
    """A cluster file's overlap keys for measured per-kind figures: ``collective_overlap``, and
    ``overlap_efficiency`` (for kinds not listed) the least of them, never below 0."""
    if not overlap:
        return {"overlap_efficiency": 0.0}
    return {"overlap_efficiency": max(0.0, min(overlap.values())), "collective_overlap": dict(overlap)}


def square_side(nbytes: int, world: int) -> int:
    """Side of the square fp32 tensor of about ``nbytes`` whose rows split evenly over ``world``."""
    return max(world, int((nbytes / 4) ** 0.5) // world * world)


def link_entry(link: dict, device: dict) -> dict:
    """A cluster file's ``intra_node`` entry for a fitted link; a noisy fit must not claim a link
    faster than the device's memory."""
    bandwidth = min(link["bandwidth_Bps"], device["memory_bandwidth_GBps"] * GB)
    return {"bandwidth_GBps": round(bandwidth / GB, 4), "latency_us": round(link["latency_s"] * 1e6, 2)}


def fit_collectives(sizes: list[int], times: dict[str, list[float]], n: int) -> dict:
    """Link figures from measured collectives: (β, α) fitted on the all-reduces
    (:func:`fit_ring`), then each other kind's efficiency = the median over sizes of the
    formula's time at those figures over the measured time."""
    from autopar import comm
    from autopar.cluster import Link

    bandwidth, latency = fit_ring(sizes, times["all_reduce"], n)
    ideal = Link(bandwidth, latency)
    formulas = {"all_gather": comm.all_gather_s, "reduce_scatter": comm.reduce_scatter_s,
                "all_to_all": comm.all_to_all_s}
    efficiency = {kind: round(statistics.median(formula(b, n, ideal) / t for b, t in zip(sizes, times[kind])), 4)
                  for kind, formula in formulas.items() if kind in times}
    return {"bandwidth_Bps": bandwidth, "latency_s": latency, "efficiency": efficiency}


def fit_ring(sizes: list[int], times: list[float], n: int) -> tuple[float, float]:
    """Least-squares (β, α) of ``t = 2(n−1)/n · bytes/β + 2(n−1)·α`` (α, β kept positive).

    Residuals are relative (weights 1/t²): the sizes span four orders of magnitude, and plain
    least squares would let the largest message decide the latency of the smallest.

    >>> bw, lat = fit_ring([1e6, 2e6, 4e6], [0.0011, 0.0021, 0.0041], 2)
    >>> round(bw / 1e9, 3), round(lat * 1e6, 1)
    (1.0, 50.0)
    """
    xs = [2 * (n - 1) / n * b for b in sizes]
    weights = [1.0 / t**2 for t in times]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_t = sum(w * t for w, t in zip(weights, times)) / total
    slope = (sum(w * (x - mean_x) * (t - mean_t) for w, x, t in zip(weights, xs, times))
             / sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs)))
    slope = max(slope, 1e-15)
    intercept = max(mean_t - slope * mean_x, 0.0)
    return 1.0 / slope, intercept / (2 * (n - 1))
