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
    (:func:`autopar.profile_collectives.collective_overlap`).

The file defines the measured device under ``devices:`` (efficiency 1: these are achieved
rates, not datasheet peaks) and one node of ``world`` such devices.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from autopar.files import atomic_write_text
from autopar.profile_collectives import (GB, collective_overlap, collective_times, fit_collectives,
                                           link_entry, median_time, overlap_entries, square_side)

log = logging.getLogger(__name__)


def matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n×n matmul in ``dtype``."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_time(lambda: torch.mm(a, b), repeats)


def memory_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Achieved bytes/s of a copy (it reads and writes ``nbytes`` each)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), repeats)


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
        found[op_class] = round(min(1.0, roofline / median_time(kernel, repeats)), 4)
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
        times = collective_times(world, sizes, repeats)
        box = [fit_collectives([4 * square_side(b, world) ** 2 for b in sizes], times, world)]
        dist.broadcast_object_list(box, src=0)  # every rank calibrates with rank 0's link figures
        link = box[0]
        box = [{kind: round(eta, 3) for kind, eta in collective_overlap(max(sizes), repeats).items()}]
        dist.broadcast_object_list(box, src=0)
        overlap = box[0]
        calibrated = dict(device, intra_node=link_entry(link, device), collective_efficiency=link["efficiency"],
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
    measured = median_time(step, 2 * repeats + 1)
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
            "intra_node": link_entry(link, device),
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
