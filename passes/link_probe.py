"""Time the links between a running plan's device groups: one ping-pong per hop.

A plan over device groups (pipeline stages, data-parallel replicas) sends its cross-group
traffic along lanes: the k-th rank of each group talks to the k-th rank of the next (the
pipeline's boundary tensors, the replicas' gradient all-reduce). To see whether a link still
runs at the bandwidth the plan was made for, the first lane's ranks of groups ``s`` and
``s + 1`` exchange ``nbytes`` both ways (a round trip: no clock is shared, so the sender
times it), and every rank learns every hop's one-way time (an all-reduce of the times).
Collective: every rank of the world calls it, the same number of times.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def probe_hops(group_ranks: list[tuple[int, ...]], nbytes: int) -> list[float]:
    """Seconds one message of ``nbytes`` takes from group ``s`` to group ``s + 1``, for each
    consecutive pair of the groups whose global ranks are ``group_ranks`` (half a round trip
    between their first ranks)."""
    rank = dist.get_rank()
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times = torch.zeros(max(1, len(group_ranks) - 1), dtype=torch.float64)
    for hop in range(len(group_ranks) - 1):
        here, there = group_ranks[hop][0], group_ranks[hop + 1][0]
        if rank == here:
            start = time.perf_counter()
            dist.send(payload, dst=there)
            dist.recv(payload, src=there)
            times[hop] = (time.perf_counter() - start) / 2
        elif rank == there:
            dist.recv(payload, src=here)
            dist.send(payload, dst=here)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # each hop's time is known on its sender only
    return times.tolist()[: len(group_ranks) - 1]
