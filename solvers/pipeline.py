"""Inter-operator planning: cut ``L`` layers into ``p`` contiguous pipeline stages, stage
``s`` on device group ``s``, for ``m`` micro-batches.

Per micro-batch, stage ``s`` computes for ``c_s`` (forward and backward with its own
collectives) and its link to the next stage is busy for ``l_s`` plus a latency ``λ_s``.
The link is a pipeline stage of its own (sends overlap the next micro-batch's compute), so a
1F1B or GPipe step takes

    T = Σ_s (c_s + l_s + λ_s) + (m − 1) · max(max_s max(c_s, l_s), Σ_s (c_s + l_s + λ_s) / k)

the first micro-batch passes through every stage and link, the other ``m − 1`` follow at
the pace of the busiest one (Narayanan et al. 2021; with equal stages the idle fraction is
the bubble ``(p − 1)/(m + p − 1)``) — or, under 1F1B, no faster than ``k = p`` micro-batches
per round trip: stage 0 holds at most ``p`` micro-batches in flight (its ``p − 1`` warm-up
forwards and one more), and each must come back through every stage and link before the
next may start, which is what bounds the step when sends dominate (GPipe: no such bound).
``T`` is minimised exactly as Alpa's stage DP does: for every candidate pace ``B`` (each
pace that occurs), a dynamic program over (stage, first layer) finds the cut with the least
``Σ`` among those with every pace ``≤ B``; ``T`` grows with ``Σ`` at a fixed ``B``, so the
best ``T`` over all ``B`` is the optimum.

Stage costs come from a callback (the intra-operator plan of those layers on that group),
so this module sees numbers only.

>>> times = {(0, 1, 0): 1.0, (0, 2, 0): 3.0, (1, 2, 1): 1.0, (2, 2, 1): float("inf")}
>>> partition(2, 2, 4, lambda i, j, s: StageTime(times.get((i, j, s), 2.0)))
PipelineSolution(cuts=(1,), stage_s=(1.0, 1.0), step_s=5.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StageTime:
    """One stage and its outgoing link, per micro-batch: ``total_s`` on the first
    micro-batch's path (c + l + λ), ``pace_s`` = the busier of stage and link (c vs l)."""

    total_s: float
    pace_s: float | None = None  # None: the same as total_s (no link)

    @property
    def pace(self) -> float:
        return self.total_s if self.pace_s is None else self.pace_s


@dataclass(frozen=True)
class PipelineSolution:
    cuts: tuple[int, ...]  # first layer of stages 1 … p−1
    stage_s: tuple[float, ...]  # per-micro-batch time of each stage with its link (total_s)
    step_s: float


def step_time(stages: list[StageTime], micro_batches: int, in_flight: int | None = None) -> float:
    """1F1B / GPipe step time from per-micro-batch stage times (formula above); ``in_flight``:
    the most micro-batches one round trip may carry (1F1B: the stage count; None: no bound)."""
    pace = max(st.pace for st in stages)
    total = sum(st.total_s for st in stages)
    if math.isinf(pace) or math.isinf(total):
        return math.inf
    if in_flight:
        pace = max(pace, total / in_flight)
    return total + (micro_batches - 1) * pace


def bubble(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of a pipeline of equal stages: (p − 1)/(m + p − 1)."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def partition(num_layers: int, num_stages: int, micro_batches: int,
              stage_time: Callable[[int, int, int], StageTime], in_flight: int | None = None
              ) -> PipelineSolution | None:
    """Best cut of layers ``[0, num_layers)`` into ``num_stages`` non-empty stages;
    ``stage_time(i, j, s)`` is stage ``s`` holding layers ``[i, j)`` (``inf`` if it does not
    fit); ``in_flight`` as :func:`step_time`'s. Returns None when no cut fits."""
    if num_stages < 1 or num_layers < num_stages:
        return None
    table: dict[tuple[int, int, int], StageTime] = {}
    for s in range(num_stages):
        first = [0] if s == 0 else range(s, num_layers - num_stages + s + 1)
        for i in first:
            last = [num_layers] if s == num_stages - 1 else range(i + 1, num_layers - num_stages + s + 2)
            for j in last:
                table[(i, j, s)] = stage_time(i, j, s)
    best: PipelineSolution | None = None
    for bound in sorted({t.pace for t in table.values() if math.isfinite(t.pace) and math.isfinite(t.total_s)}):
        if best is not None and (micro_batches - 1) * bound >= best.step_s:
            break  # the sum only grows from here on
        cut = _least_sum(num_layers, num_stages, table, bound)
        if cut is None:
            continue
        cuts, times = cut
        total = step_time(times, micro_batches, in_flight)
        if best is None or total < best.step_s * (1 - 1e-12):
            best = PipelineSolution(tuple(cuts), tuple(t.total_s for t in times), total)
    return best


def _least_sum(num_layers: int, num_stages: int, table, bound: float) -> tuple[list[int], list[StageTime]] | None:
    """DP: least Σ total with every pace ≤ ``bound``; cost[s][j] covers layers [0, j) with stages 0…s."""
    inf = math.inf
    cost = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    back: list[list[int]] = [[-1] * (num_layers + 1) for _ in range(num_stages)]
    for (i, j, s), t in table.items():
        if s == 0 and t.pace <= bound and t.total_s < cost[0][j]:
            cost[0][j] = t.total_s
    for s in range(1, num_stages):
        for (i, j, stage), t in table.items():
            if stage != s or t.pace > bound or not math.isfinite(cost[s - 1][i]):
                continue
            if cost[s - 1][i] + t.total_s < cost[s][j]:
                cost[s][j], back[s][j] = cost[s - 1][i] + t.total_s, i
    if not math.isfinite(cost[num_stages - 1][num_layers]):
        return None
    cuts, times, j = [], [], num_layers
    for s in range(num_stages - 1, 0, -1):
        i = back[s][j]
        cuts.append(i)
        times.append(table[(i, j, s)])
        j = i
    times.append(table[(0, j, 0)])
    return cuts[::-1], times[::-1]
