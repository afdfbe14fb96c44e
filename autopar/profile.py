"""``autopar profile``: measure this machine and write a cluster file the planner accepts.

Short micro-benchmarks, best of a few repeats (the machine may be shared, so the best run is
the one least disturbed):
  * matmul throughput per dtype: ``2·n³`` FLOPs of an ``n × n`` matmul over its time;
  * memory bandwidth: a large tensor copy reads and writes its bytes;
  * gloo collectives between ``world`` processes: all-reduce times over message sizes, fitted
    to autopar.comm's ring formula ``t = 2(n−1)/n · bytes/β + 2(n−1)·α`` by least squares;
  * the fixed cost of one op on DTensor (dispatch, autograd), which dominates small ops on CPU.

The file defines the measured device under ``devices:`` (efficiency 1: these are achieved
rates, not datasheet peaks) and one node of ``world`` such devices.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from autopar.plan import atomic_write_text

GB = 10**9


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n×n matmul in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), repeats)


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Achieved bytes/s of a copy (it reads and writes ``nbytes`` each)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), repeats)


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        times = []
        for nbytes in sizes:
            x = torch.ones(max(1, nbytes // 4))
            dist.barrier()
            times.append(_best_time(lambda: dist.all_reduce(x), repeats))
        overhead = _dtensor_op_overhead(world)
        if rank == 0:
            with open(out, "w") as f:
                f.write(repr((times, overhead)))
    finally:
        dist.destroy_process_group()


def _dtensor_op_overhead(world: int, ops: int = 200) -> float:
    """Seconds per op of a tiny replicated DTensor op with autograd (forward and backward):
    the fixed cost every planned op pays on this machine, whatever its size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.ones(8, 8, requires_grad=True), mesh, [Replicate()])

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    return _best_time(chain, 3) / (3 * ops)  # one forward and two backward ops' worth per op


def collective_link(world: int = 2, sizes: tuple[int, ...] = (2**10, 2**16, 2**20, 2**22, 2**24),
                    repeats: int = 5) -> tuple[float, float, float]:
    """(bandwidth bytes/s, latency s) of the link between ``world`` local gloo processes, and
    the per-op overhead of DTensor there (seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.spawn(_collective_worker, args=(world, port, list(sizes), repeats, out), nprocs=world, join=True)
        with open(out) as f:
            times, overhead = eval(f.read(), {})  # floats we wrote ourselves
    return (*fit_ring(list(sizes), times, world), overhead)


def fit_ring(sizes: list[int], times: list[float], n: int) -> tuple[float, float]:
    """Least-squares (β, α) of ``t = 2(n−1)/n · bytes/β + 2(n−1)·α`` (α, β kept positive).

    >>> bw, lat = fit_ring([1e6, 2e6, 4e6], [0.0011, 0.0021, 0.0041], 2)
    >>> round(bw / 1e9, 3), round(lat * 1e6, 1)
    (1.0, 50.0)
    """
    xs = [2 * (n - 1) / n * b for b in sizes]
    mean_x, mean_t = sum(xs) / len(xs), sum(times) / len(times)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, times)) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    intercept = max(mean_t - slope * mean_x, 0.0)
    return 1.0 / slope, intercept / (2 * (n - 1))


def profile_cluster(world: int = 2, name: str = "cpu-local", quick: bool = False) -> dict:
    """Measure, and return the cluster file's content as a mapping."""
    repeats = 2 if quick else 5
    n = 256 if quick else 1024
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # one device = one process's share
    try:
        flops = {"fp32": matmul_flops(torch.float32, n, repeats), "bf16": matmul_flops(torch.bfloat16, n, repeats)}
        bandwidth = memory_bandwidth((32 if quick else 256) * 2**20, repeats)
    finally:
        torch.set_num_threads(threads)
    sizes = (2**10, 2**20, 2**22) if quick else (2**10, 2**16, 2**20, 2**22, 2**24)
    link_bw, link_lat, overhead = collective_link(world, sizes, repeats) if world > 1 else (2 * GB, 50e-6, 0.0)
    link_bw = min(link_bw, bandwidth)  # a noisy fit must not claim a link faster than memory
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
    return {
        "devices": {name: {
            "peak_TFLOPS": {k: round(v / 1e12, 6) for k, v in flops.items()},
            "memory_GB": round(memory / GB, 3),
            "memory_bandwidth_GBps": round(bandwidth / GB, 3),
            "intra_node": {"bandwidth_GBps": round(link_bw / GB, 4), "latency_us": round(link_lat * 1e6, 2)},
            "op_overhead_us": round(overhead * 1e6, 2),
            "source": f"autopar profile on {socket.gethostname()}, {time.strftime('%Y-%m-%d')}, "
                      f"{max(1, (os.cpu_count() or 1) // world)} threads per device",
        }},
        "device": name, "nodes": 1, "per_node": world,
    }


def write_profile(path: str, world: int = 2, quick: bool = False) -> dict:
    content = profile_cluster(world, quick=quick)
    atomic_write_text(path, "# measured by `autopar profile`; use as --cluster " + os.path.basename(path) + "\n"
                      + yaml.safe_dump(content, sort_keys=False))
    return content
