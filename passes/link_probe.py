"""Time the links a running plan crosses: one ping-pong per link.

To see whether a link still runs at the bandwidth the plan was made for, two ranks on its
two ends (the first ranks of two pipeline stages, of two replica groups, of two regions or
hosts a mesh spans) exchange ``nbytes`` both ways — a round trip: no clock is shared, so
the sender times it — and every rank learns every link's one-way time (an all-reduce of the
times). Collective: every rank of the world calls it, the same number of times.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def probe_hops(pairs: list[tuple[int, int]], nbytes: int) -> list[float]:
    """Seconds one message of ``nbytes`` takes from rank ``a`` to rank ``b`` for each pair
    ``(a, b)`` (half a round trip, timed by ``a``), on every rank."""
    rank = dist.get_rank()
    # NCCL moves CUDA tensors only (the current device: torch.cuda.set_device(local_rank))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = torch.zeros(max(1, len(pairs)), dtype=torch.float64, device=device)
    for hop, (here, there) in enumerate(pairs):
        if rank == here:
            start = time.perf_counter()
            dist.send(payload, dst=there)
            dist.recv(payload, src=there)
            if device.type == "cuda":  # NCCL's calls return once queued on the stream: wait for the data
                torch.cuda.synchronize(device)
            times[hop] = (time.perf_counter() - start) / 2
        elif rank == there:
            dist.recv(payload, src=here)
            dist.send(payload, dst=here)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each hop's time is known on its sender only
    return times.tolist()[: len(pairs)]
