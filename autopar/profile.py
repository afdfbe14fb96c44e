"""``autopar profile``: measure this machine and write a cluster file the planner accepts.

Short micro-benchmarks, each the median of a few repeats: a plan's prediction stands for a
typical step, so every figure is a typical one (the best of a few repeats, tried before, ran
10–20 % faster than the same kernels inside a step on this shared 2-core machine), and the
kernels are timed in all ``world`` processes at once, as a step runs them (alone, one
process's matmuls ran up to twice as fast as beside the other's):
  * matmul throughput per dtype: ``2·n³`` FLOPs of an ``n × n`` matmul over its time;
  * memory bandwidth: a large tensor copy reads and writes its bytes;
  * the fraction of that roofline each op class reaches (conv, pool, reduction, elementwise;
    one typical kernel each, matmul being the reference);
  * gloo collectives between ``world`` processes, issued the way lowered programs issue them
    (DTensor redistributes, each after a little compute, so the wake-up of the communication
    thread is paid as in a step): median all-reduce times over message sizes fitted to
    autopar.comm's ring formula ``t = 2(n−1)/n · bytes/β + 2(n−1)·α`` by least squares, and
    how far all-gather, reduce-scatter and all-to-all fall short of their formulas at that
    (α, β) (gloo runs a reduce-scatter as an all-reduce, an all-to-all as an all-gather);
  * the fixed cost of each executed op (DTensor dispatch, autograd, hooks), which dominates
    small ops on CPU: fitted on the measured training step of a small model
    (:func:`_calibrated_op_overhead`);
  * per collective kind, the fraction of it hidden behind compute issued while it runs
    (:func:`collective_overlap`).

The file defines the measured device under ``devices:`` (efficiency 1: these are achieved
rates, not datasheet peaks) and one node of ``world`` such devices.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from autopar.devices import OVERLAP_KINDS
from autopar.files import atomic_write_text

log = logging.getLogger(__name__)

GB = 10**9


def _median_time(fn, repeats: int, before=None) -> float:
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


def matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n×n matmul in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_time(lambda: torch.mm(a, b), repeats)


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Achieved bytes/s of a copy (it reads and writes ``nbytes`` each)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats)


def class_efficiencies(flops_per_s: float, bandwidth_Bps: float, repeats: int = 5) -> dict[str, float]:
    """Fraction of the roofline (``max(flops / peak, bytes / bandwidth)`` with this device's
    matmul rate and copy bandwidth) that one typical kernel of each op class reaches, at sizes
    like a small model's activations. Matmul is the reference (its rate is the peak)."""
    aten = torch.ops.aten
    x = torch.randn(16, 16, 32, 32)
    weight = torch.randn(32, 16, 3, 3)
    rows = torch.randn(64, 128, 128)
    flat = torch.randn(2**20)
    cases = {  # class: (kernel, FLOPs, bytes read + written)
        "conv": (lambda: aten.convolution(x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
                 2 * 16 * 32 * 32 * 32 * 16 * 9, 4 * (x.numel() + weight.numel() + 16 * 32 * 32 * 32)),
        "pool": (lambda: aten.max_pool2d_with_indices(x, [2, 2], [2, 2]), 0, 4 * x.numel() + 12 * x.numel() // 4),
        "reduction": (lambda: aten._softmax(rows, -1, False), 0, 8 * rows.numel()),
        "elementwise": (lambda: aten.gelu(flat), 0, 8 * flat.numel()),
    }
    found = {"matmul": 1.0}
    for op_class, (kernel, flops, nbytes) in cases.items():
        roofline = max(flops / flops_per_s, nbytes / bandwidth_Bps)
        found[op_class] = round(min(1.0, roofline / _median_time(kernel, repeats)), 4)
    return found


class CalibrationNet(torch.nn.Module):
    """A small transformer stack (attention, layer norm, GELU, views): its training step on
    DTensor is almost all per-op cost, which is what the calibration run measures."""

    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
            "proj": torch.nn.Linear(width, width), "up": torch.nn.Linear(width, 2 * width),
            "down": torch.nn.Linear(2 * width, width)}) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, tokens, width)
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm"](x)).chunk(3, dim=-1)
            scores = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
            x = x + block["proj"](scores @ v)
            x = x + block["down"](torch.nn.functional.gelu(block["up"](x)))
        return x


def _collective_times(world: int, sizes: list[int], repeats: int) -> dict[str, list[float]]:
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
        side = _side(nbytes, world)
        for kind, (src, dst, sharded) in kinds.items():
            local = torch.ones(side // world if sharded else side, side)
            dist.barrier()
            times[kind].append(_median_time(
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
        alone_s = _median_time(collective, repeats, before=dist.barrier)
        matmul_s = _median_time(lambda: a @ a, repeats)
        count = max(1, round(alone_s / matmul_s))
        counts = torch.tensor([count])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # the same work on every rank
        count = int(counts)

        def compute():
            for _ in range(count):
                a @ a

        def both():
            work = collective(async_op=True)
            compute()
            work.wait()

        compute_s = _median_time(compute, repeats, before=dist.barrier)
        both_s = _median_time(both, repeats, before=dist.barrier)
    hidden = compute_s + alone_s - both_s
    return min(1.0, max(-1.0, hidden / min(compute_s, alone_s)))


def overlap_entries(overlap: dict[str, float]) -> dict:
    """A cluster file's overlap keys for measured per-kind figures: ``collective_overlap``, and
    ``overlap_efficiency`` (for kinds not listed) the least of them, never below 0."""
    if not overlap:
        return {"overlap_efficiency": 0.0}
    return {"overlap_efficiency": max(0.0, min(overlap.values())), "collective_overlap": dict(overlap)}


def _side(nbytes: int, world: int) -> int:
    """Side of the square fp32 tensor of about ``nbytes`` whose rows split evenly over ``world``."""
    return max(world, int((nbytes / 4) ** 0.5) // world * world)


def _link_entry(link: dict, device: dict) -> dict:
    """A cluster file's ``intra_node`` entry for a fitted link; a noisy fit must not claim a link
    faster than the device's memory."""
    bandwidth = min(link["bandwidth_Bps"], device["memory_bandwidth_GBps"] * GB)
    return {"bandwidth_GBps": round(bandwidth / GB, 4), "latency_us": round(link["latency_s"] * 1e6, 2)}


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int,
                       device: dict | None, name: str, quick: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if device is None:  # every rank measures at once: a device's kernels run beside the others' in a step
            dist.barrier()
            box = [_device_entry(name, world, quick)]
            dist.broadcast_object_list(box, src=0)
            device = box[0]
        times = _collective_times(world, sizes, repeats)
        box = [fit_collectives([4 * _side(b, world) ** 2 for b in sizes], times, world)]
        dist.broadcast_object_list(box, src=0)  # every rank calibrates with rank 0's link figures
        link = box[0]
        box = [{kind: round(eta, 3) for kind, eta in collective_overlap(max(sizes), repeats).items()}]
        dist.broadcast_object_list(box, src=0)
        overlap = box[0]
        calibrated = dict(device, intra_node=_link_entry(link, device), collective_efficiency=link["efficiency"],
                          **overlap_entries(overlap))
        overhead = _calibrated_op_overhead(calibrated, world, repeats)
        if rank == 0:
            with open(out, "w") as f:
                f.write(repr((link, overhead, overlap, device)))
    finally:
        dist.destroy_process_group()
    # Device meshes still hold gloo groups; freeing them while the interpreter finalises aborts now
    # and then (pytorch/pytorch#179291). The figures are written: leave without finalising.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def _calibrated_op_overhead(device: dict, world: int, repeats: int) -> float:
    """Seconds each executed op costs beyond its roofline time, fitted from one measured run:
    the :class:`CalibrationNet`'s data-parallel training step (median of ``2·repeats + 1``)
    minus its prediction without per-op cost, divided by the ops the cost model counts for it
    (forward and backward, views included). Fitting it on a whole step, not on a loop of one
    op, makes the figure carry what a lowered program pays around its ops (DTensor dispatch
    and sharding propagation, redistribute calls, autograd and gradient hooks)."""
    import autopar

    torch.manual_seed(0)
    model = CalibrationNet()
    x, target = torch.randn(4 * world, 16, 32), torch.randn(4 * world, 16, 32)
    plans = []
    entry = {key: value for key, value in device.items() if key != "name"}
    with tempfile.TemporaryDirectory() as tmp:
        for overhead_us in (0.0, 1000.0):
            path = os.path.join(tmp, f"{overhead_us}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump({"devices": {device["name"]: dict(entry, op_overhead_us=overhead_us)},
                                "device": device["name"], "nodes": 1, "per_node": world}, f)
            plans.append(autopar.plan(model, (x,), cluster=path, configuration="ddp"))
    predicted = [plan.predicted_step_s for plan in plans]
    pmodel = autopar.apply(model, plans[0], loss_fn=torch.nn.functional.mse_loss)  # DDP: same placements

    def step():
        dist.barrier()
        pmodel.step(x, target=target)
        for p in pmodel.parameters():
            p.grad = None

    step()
    measured = _median_time(step, 2 * repeats + 1)
    ops = (predicted[1] - predicted[0]) / 1e-3  # op executions the model counts per step
    return max(0.0, (measured - predicted[0]) / ops)


def collective_link(world: int = 2, sizes: tuple[int, ...] = (2**10, 2**16, 2**20, 2**22, 2**24),
                    repeats: int = 5, device: dict | None = None, name: str = "cpu-local",
                    quick: bool = True) -> tuple[dict, float, dict[str, float], dict]:
    """The link between ``world`` local gloo processes (:func:`fit_collectives`), the
    per-op cost there (seconds) calibrated on a step of a small model on ``device`` (a
    cluster file's device entry with its ``name``), the fraction of each collective kind the
    host hides behind compute (:func:`collective_overlap`), and the device entry. Without
    ``device`` its kernels are measured in every process at once, as a training step runs
    them: on a small host the processes share caches and memory bandwidth, and a matmul
    alone runs up to twice as fast as beside the others."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        _run_workers(_collective_worker, world, (world, port, list(sizes), repeats, device, name, quick, out))
        with open(out) as f:
            link, overhead, overlap, measured = eval(f.read(), {})  # figures we wrote ourselves
    return link, overhead, overlap, measured


def _run_workers(worker, world: int, args: tuple) -> None:
    """``world`` processes running ``worker(rank, *args)``, waited for; ended when this process
    is interrupted (Ctrl-C, or a SIGINT to it alone) or fails, before the error goes on —
    else multiprocessing's exit handler would wait for every one to finish its measurement."""
    try:
        context = mp.spawn(worker, args=args, nprocs=world, join=False)
        log.info("measuring collectives between %d worker processes", world)
        while not context.join():
            pass
    except BaseException:  # also while spawn is still starting them: every child started so far
        started = multiprocessing.active_children()
        for process in started:
            process.terminate()
        for process in started:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        raise


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


def _device_entry(name: str, world: int, quick: bool) -> dict:
    """Kernel rates of one device (one process's share of the cores), as a cluster file entry."""
    repeats = 2 if quick else 5
    n = 256 if quick else 1024
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # one device = one process's share
    try:
        flops = {"fp32": matmul_flops(torch.float32, n, repeats), "bf16": matmul_flops(torch.bfloat16, n, repeats)}
        bandwidth = memory_bandwidth((32 if quick else 256) * 2**20, repeats)
        efficiency = class_efficiencies(flops["fp32"], bandwidth, repeats)
    finally:
        torch.set_num_threads(threads)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world
    return {"name": name, "peak_TFLOPS": {k: round(v / 1e12, 6) for k, v in flops.items()},
            "memory_GB": round(memory / GB, 3), "memory_bandwidth_GBps": round(bandwidth / GB, 3),
            "op_class_efficiency": efficiency}


def profile_cluster(world: int = 2, name: str = "cpu-local", quick: bool = False) -> dict:
    """Measure, and return the cluster file's content as a mapping."""
    repeats = 2 if quick else 5
    sizes = (2**10, 2**20, 2**22) if quick else (2**10, 2**16, 2**20, 2**22, 2**24)
    if world > 1:
        link, overhead, overlap, device = collective_link(world, sizes, repeats, name=name, quick=quick)
    else:
        link, overhead, overlap = {"bandwidth_Bps": 2 * GB, "latency_s": 50e-6, "efficiency": {}}, 0.0, {}
        device = _device_entry(name, world, quick)
    device.pop("name")
    return {
        "devices": {name: {
            **device,
            "intra_node": _link_entry(link, device),
            "collective_efficiency": link["efficiency"],
            "op_overhead_us": round(overhead * 1e6, 2),
            **overlap_entries(overlap),
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
