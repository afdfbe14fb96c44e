"""``autopar profile`` on GPUs (issue 23): the cluster file the CPU profile writes, measured
on this host's GPUs with CUDA's clock (every time below is the median of a few repeats,
synchronised on the device, after a warm-up):

  * matmul throughput per dtype: ``2·n³`` FLOPs of an ``n × n`` matmul (fp32 as torch runs it
    by default — TF32 off —, tf32, bf16, fp16);
  * HBM bandwidth: a large copy reads and writes its bytes;
  * the fraction of the roofline each op class reaches, in bf16 against the bf16 matmul rate:
    fused attention (causal SDPA at a Llama layer's shape, FLOPs as passes.cost counts them:
    causal half), conv, pool, reduction, elementwise;
  * the host time of one executed op (eager dispatch and launch, paid per op when kernels are
    short; the cost model adds it to every op, an upper bound where kernels outlast their
    launch): a chain of tiny ops over its length;
  * NCCL between the host's GPUs, one process per GPU (two or more GPUs): all-reduce times
    over message sizes fitted to autopar.comm's ring formula (β, α — NCCL's bus bandwidth),
    how far all-gather, reduce-scatter and all-to-all fall short of their formulas there, and
    per overlapped kind the fraction hidden behind matmuls issued while it runs (NCCL's stream
    beside the default one, as the lowered program issues prefetched gathers and buckets).
    With one GPU the link and overlap keep the catalog's figures for this GPU.

The device entry's rates are achieved ones (efficiency 1), as in the CPU profile.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from autopar.devices import OVERLAP_KINDS, Link, device_for_gpu_name
from autopar.profile_collectives import GB, fit_collectives, hidden_fraction, link_entry, overlap_entries

_SIZES = (2**16, 2**20, 2**24, 2**27)  # collective message bytes
_SIZES_QUICK = (2**20, 2**24)


def cuda_time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` on the current GPU (CUDA events around each call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_rates(n: int, repeats: int) -> dict[str, float]:
    """Achieved FLOP/s of an n×n matmul per dtype (``tf32``: float32 with TF32 allowed)."""
    rates = {}
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        for key, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                 ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.randn(n, n, device="cuda", dtype=dtype)
            b = torch.randn(n, n, device="cuda", dtype=dtype)
            rates[key] = 2 * n**3 / cuda_time(lambda: torch.mm(a, b), repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
    return rates


def hbm_bandwidth(nbytes: int, repeats: int) -> float:
    """Achieved bytes/s of a device-to-device copy (it reads and writes ``nbytes`` each)."""
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_time(lambda: dst.copy_(src), repeats)


def class_efficiencies(bf16_flops: float, bandwidth_Bps: float, quick: bool, repeats: int) -> dict[str, float]:
    """Fraction of the bf16 roofline (``max(flops / peak, bytes / bandwidth)``) one typical
    kernel of each op class reaches; matmul is the reference."""
    from autopar.passes.cost import attention_flops

    aten, bf16 = torch.ops.aten, torch.bfloat16
    tokens = 2048 if quick else 4096
    q = torch.randn(2, 32, tokens, 128, device="cuda", dtype=bf16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    x = torch.randn(64, 64, 56, 56, device="cuda", dtype=bf16)
    weight = torch.randn(64, 64, 3, 3, device="cuda", dtype=bf16)
    rows = torch.randn(64, 1024, 1024, device="cuda", dtype=bf16)
    flat = torch.randn(2**26, device="cuda", dtype=bf16)
    size = 2  # bytes per bf16 element
    cases = {  # class: (kernel, FLOPs, bytes read + written)
        "attention": (lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                      attention_flops(q, k, v, is_causal=True), size * 4 * q.numel()),
        "conv": (lambda: aten.convolution(x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
                 2 * 64 * 56 * 56 * 64 * 64 * 9, size * (2 * x.numel() + weight.numel())),
        "pool": (lambda: aten.max_pool2d_with_indices(x, [2, 2], [2, 2]), 0, size * x.numel() + 10 * x.numel() // 4),
        "reduction": (lambda: aten._softmax(rows, -1, False), 0, 2 * size * rows.numel()),
        "elementwise": (lambda: aten.gelu(flat), 0, 2 * size * flat.numel()),
    }
    found = {"matmul": 1.0}
    for op_class, (kernel, flops, nbytes) in cases.items():
        roofline = max(flops / bf16_flops, nbytes / bandwidth_Bps)
        found[op_class] = round(min(1.0, roofline / cuda_time(kernel, repeats)), 4)
    return found


def op_overhead_s(ops: int = 2000) -> float:
    """Host seconds per executed op: a chain of tiny adds (each waits for nothing on the
    device) timed on the host clock, over its length."""
    x = torch.zeros(8, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ops):
        x = x + 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / ops


def device_entry(quick: bool = False) -> dict:
    """This GPU's measured figures as a cluster file's device entry (``name``: torch's name)."""
    repeats = 5 if quick else 10
    index = torch.cuda.current_device()
    flops = matmul_rates(4096 if quick else 8192, repeats)
    bandwidth = hbm_bandwidth((256 if quick else 1024) * 2**20, repeats)
    return {"name": torch.cuda.get_device_name(index),
            "peak_TFLOPS": {k: round(v / 1e12, 3) for k, v in flops.items()},
            "memory_GB": round(torch.cuda.get_device_properties(index).total_memory / GB, 3),
            "memory_bandwidth_GBps": round(bandwidth / GB, 1),
            "op_class_efficiency": class_efficiencies(flops["bf16"], bandwidth, quick, repeats),
            "op_overhead_us": round(op_overhead_s() * 1e6, 2)}


def _collective(kind: str, nbytes: int, world: int):
    """A callable issuing one ``kind`` collective of about ``nbytes`` (the whole tensor), and
    the bytes it moves as autopar.comm counts them (the whole tensor's)."""
    count = max(world, nbytes // 4 // world * world)
    whole = torch.ones(count, device="cuda")
    part = torch.empty(count // world, device="cuda")
    gathered = torch.empty(count, device="cuda")
    calls = {"all_reduce": lambda async_op=False: dist.all_reduce(whole, async_op=async_op),
             "all_gather": lambda async_op=False: dist.all_gather_into_tensor(gathered, part, async_op=async_op),
             "reduce_scatter": lambda async_op=False: dist.reduce_scatter_tensor(part, whole, async_op=async_op),
             "all_to_all": lambda async_op=False: dist.all_to_all_single(gathered, whole, async_op=async_op)}
    return calls[kind], 4 * count


def _overlap(kind: str, nbytes: int, world: int, repeats: int) -> float:
    """Fraction of a ``kind`` collective hidden behind bf16 matmuls issued while it runs."""
    call, _ = _collective(kind, nbytes, world)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    return hidden_fraction(call, lambda: a @ a, lambda fn: cuda_time(fn, repeats),
                           torch.device("cuda", torch.cuda.current_device()))


def _nccl_worker(rank: int, world: int, port: int, quick: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        repeats = 5 if quick else 10
        sizes = _SIZES_QUICK if quick else _SIZES
        times: dict[str, list[float]] = {}
        moved: list[int] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                for nbytes in sizes:
                    call, whole = _collective(kind, nbytes, world)
                    dist.barrier()
                    times.setdefault(kind, []).append(cuda_time(call, repeats))
                    if kind == "all_reduce":
                        moved.append(whole)
            overlap = {kind: round(_overlap(kind, sizes[-1], world, repeats), 3) for kind in OVERLAP_KINDS}
        if rank == 0:
            with open(out, "w") as f:
                f.write(repr((fit_collectives(moved, times, world), overlap)))
    finally:
        dist.destroy_process_group()


def nccl_link(world: int, quick: bool) -> tuple[dict, dict[str, float]]:
    """The link between this host's first ``world`` GPUs (:func:`fit_collectives`) and the
    overlap per kind, measured in ``world`` processes, one per GPU."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "nccl")
        mp.spawn(_nccl_worker, args=(world, port, quick, out), nprocs=world, join=True)
        with open(out) as f:
            return eval(f.read(), {})  # figures we wrote ourselves


def profile_gpus(world: int | None = None, quick: bool = False) -> dict:
    """Measure this host's GPUs; the cluster file's content as a mapping (``world``: GPUs the
    file describes, all of this host's by default)."""
    world = world or torch.cuda.device_count()
    device = device_entry(quick)
    reported = device.pop("name")
    name = reported.replace(" ", "-")
    catalog = device_for_gpu_name(reported)
    extra = {}
    if catalog is not None:  # between hosts: the catalog's network for this GPU (one host measured)
        extra["inter_node"] = _link_figures(Link.of_device(catalog, inter_node=True))
    if world > 1 and torch.cuda.device_count() >= world:
        link, overlap = nccl_link(world, quick)
        extra.update({"intra_node": link_entry(link, device), "collective_efficiency": link["efficiency"],
                      **overlap_entries(overlap)})
    else:  # nothing to measure between GPUs: the catalog's link for this GPU, where it knows it
        if catalog is not None:
            extra["intra_node"] = _link_figures(Link.of_device(catalog, inter_node=False))
        extra["overlap_efficiency"] = catalog.overlap_efficiency if catalog is not None else 0.9
    source = (f"autopar profile on {socket.gethostname()}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}" + ("" if world > 1 else "; links from the catalog (one GPU)"))
    return {"devices": {name: {**device, **extra, "source": source}}, "device": name, "nodes": 1, "per_node": world}


def _link_figures(link: Link) -> dict:
    return {"bandwidth_GBps": round(link.bandwidth_Bps / GB, 3), "latency_us": round(link.latency_s * 1e6, 2)}


def write_gpu_profile(path: str, world: int | None = None, quick: bool = False) -> dict:
    """:func:`profile_gpus`, written to ``path`` (atomically) as a cluster file."""
    import yaml

    from autopar.files import atomic_write_text

    content = profile_gpus(world, quick)
    atomic_write_text(path, "# measured by `autopar profile`; use as --cluster " + os.path.basename(path) + "\n"
                      + yaml.safe_dump(content, sort_keys=False))
    return content
