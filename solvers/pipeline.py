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

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass


EXHAUSTIVE_CUTS = 500  # interleaved cuts tried one by one up to this many (small stacks), else a few


@dataclass(frozen=True)
class StageTime:
    """One stage and its outgoing link, per micro-batch: ``total_s`` on the first
    micro-batch's path (c + l + λ), ``pace_s`` = the busier of stage and link (c vs l)."""

    total_s: float
    pace_s: float | None = None  # None: the same as total_s (no link)
    # the share of total_s that is weight gradients: what a zero-bubble schedule defers into
    # the bubbles (it runs after the input gradients the previous stage waits for)
    deferrable_s: float = 0.0

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
              stage_time: Callable[[int, int, int], StageTime], in_flight: int | None = None,
              lower_bound: Callable[[int, int, int], StageTime] | None = None) -> PipelineSolution | None:
    """Best cut of layers ``[0, num_layers)`` into ``num_stages`` non-empty stages;
    ``stage_time(i, j, s)`` is stage ``s`` holding layers ``[i, j)`` (``inf`` if it does not
    fit); ``in_flight`` as :func:`step_time`'s. Returns None when no cut fits.

    ``lower_bound(i, j, s)`` (cheap; at most ``stage_time``'s total and pace) makes the
    search lazy, branch and bound over stages: the best cut is found on a table of bounds,
    and only that cut's stages are timed exactly, again and again until the best cut's
    stages are all exact — it is then optimal, as every cut's time on the table is at most
    its real time (the step grows with every stage's total and pace). Stages no best cut
    ever reaches are never planned."""
    if num_stages < 1 or num_layers < num_stages:
        return None
    keys = _stage_keys(num_layers, num_stages)
    if lower_bound is None:
        return _best_cut(num_layers, num_stages, micro_batches, {k: stage_time(*k) for k in keys}, in_flight)
    table = {k: lower_bound(*k) for k in keys}
    exact: set[tuple[int, int, int]] = set()
    while True:
        best = _best_cut(num_layers, num_stages, micro_batches, table, in_flight)
        if best is None:
            return None
        bounds = [0, *best.cuts, num_layers]
        unknown = [k for k in ((bounds[s], bounds[s + 1], s) for s in range(num_stages)) if k not in exact]
        if not unknown:
            return best
        for k in unknown:
            table[k] = stage_time(*k)
            exact.add(k)


def _best_cut(num_layers: int, num_stages: int, micro_batches: int, table: dict[tuple[int, int, int], StageTime],
              in_flight: int | None) -> PipelineSolution | None:
    """The least step over every cut whose stages ``table`` times (the formula's DP)."""
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


def _on_rank(chunks: list[StageTime], ranks: int, groups: list[int] | None, r: int) -> list[StageTime]:
    """The chunks rank ``r`` runs: every ``ranks``-th (torch's loop placement) unless
    ``groups`` gives each chunk's rank (ZBV's V)."""
    return chunks[r::ranks] if groups is None else [st for st, g in zip(chunks, groups) if g == r]


def interleaved_step_time(chunks: list[StageTime], ranks: int, micro_batches: int,
                          groups: list[int] | None = None) -> float:
    """Interleaved 1F1B step time: ``chunks`` are the ``p · v`` virtual stages in model order,
    chunk ``g`` on rank ``g mod p`` (``v`` chunks per rank, torch's loop placement).

        T = Σ_{g < p} total_g + (m − 1/v) · P,   P = max(max_r Σ_{g ≡ r} pace_g, Σ_g total_g / p)

    The first micro-batch's first round crosses every rank once (the fill); after it every
    rank works through ``m`` micro-batches of all its chunks at the pace of the busiest rank
    ``P``, less the one chunk the fill already ran — so with equal chunks of time ``c`` the
    step is ``(m·v + p − 1)·c`` and the bubble ``(p − 1)/(m·v + p − 1)``, ``v`` times smaller
    than 1F1B's (Narayanan et al. 2021). As under 1F1B, at most ``p`` micro-batches make the
    round trip through every chunk and link at once (the second term of ``P``). With
    ``v = 1`` this is :func:`step_time` under 1F1B exactly. ``groups``: each chunk's rank
    when it is not ``g mod p`` (ZBV's V; its fill is the same ``p`` chunks down one arm)."""
    v = len(chunks) // ranks
    if v < 1 or len(chunks) % ranks:
        raise ValueError(f"{len(chunks)} chunks do not spread evenly over {ranks} ranks")
    if any(math.isinf(st.total_s) or math.isinf(st.pace) for st in chunks):
        return math.inf
    fill = sum(st.total_s for st in chunks[:ranks])
    per_rank = max(sum(st.pace for st in _on_rank(chunks, ranks, groups, r)) for r in range(ranks))
    pace = max(per_rank, sum(st.total_s for st in chunks) / ranks)
    return fill + (micro_batches - 1 / v) * pace


def zero_bubble_step_time(chunks: list[StageTime], ranks: int, micro_batches: int,
                          groups: list[int] | None = None, hidden_per_hop: int = 2) -> float:
    """Interleaved zero-bubble step time (torch's ``ScheduleInterleavedZeroBubble``, ZB1P of
    Qi et al. 2024): the backward splits into input gradients, which the previous stage waits
    for, and weight gradients ``W``, which wait for nothing and fill the idle slots. Against
    interleaved 1F1B the bubble loses ``2·W`` per rank it crosses — ``(p − 1)(F + B − W)``
    instead of ``(p − 1)(F + B + W)`` in the paper's terms:

        T = T_interleaved − 2 (p − 1)/p · Σ_{g < p} W_g,
            at least max_r (Σ_{g < r} F_g + m · Σ_{g ≡ r} pace_g)

    — no rank finishes before the first micro-batch's forwards reach it (``F`` = ``W``: a
    matmul's forward costs as much as its weight gradient) and it has done all its work: where
    one rank is much busier than the others there is no bubble on it for ``W`` to fill.

    ZBV (``groups`` in a V: torch's ``ScheduleZBVZeroBubble``, two chunks per rank;
    ``hidden_per_hop=3``) hides ``3·W`` per rank crossed, ``(p − 1)(F + B − 2W)`` in the paper's terms (its section 6):
    the turn of the V needs no hand-over, so the last rank starts its backwards a forward
    earlier. With equal chunks both reach the floor; they differ in what they hold in flight
    (autopar.planning.schedules.Layout.in_flight) and with uneven chunks.
    """
    interleaved = interleaved_step_time(chunks, ranks, micro_batches, groups)
    if math.isinf(interleaved):
        return math.inf
    hidden = hidden_per_hop * (ranks - 1) / ranks * sum(st.deferrable_s for st in chunks[:ranks])
    floor = max(sum(st.deferrable_s for st in chunks[:r])
                + micro_batches * sum(st.pace for st in _on_rank(chunks, ranks, groups, r)) for r in range(ranks))
    return max(interleaved - hidden, floor)


def interleaved_bubble(ranks: int, virtual: int, micro_batches: int) -> float:
    """Idle fraction of interleaved 1F1B with equal chunks: (p − 1)/(m·v + p − 1)."""
    return (ranks - 1) / (micro_batches * virtual + ranks - 1)


def interleaved_warmup(rank: int, ranks: int, virtual: int, micro_batches: int, per_hop: int = 2) -> int:
    """Forwards rank ``rank`` runs before its first backward under torch's interleaved 1F1B
    (``ScheduleInterleaved1F1B``): a round of micro-batches per extra chunk, ``per_hop`` more
    per rank after it (2; the interleaved zero-bubble schedule: 1), at most every forward it has."""
    per_round = micro_batches // max(1, micro_batches // ranks)
    return min((virtual - 1) * per_round + per_hop * (ranks - 1 - rank), micro_batches * virtual)


def interleaved_order(rank: int, ranks: int, virtual: int, micro_batches: int,
                      per_hop: int = 2) -> list[tuple[str, int, int]]:
    """The (``"F"``/``"B"``, chunk, micro-batch) operations of ``rank`` in the order torch's
    interleaved 1F1B runs them: warm-up forwards, one forward and one backward in turn, then
    the remaining backwards; forwards take the rank's chunks in rounds of micro-batches in
    model order, backwards in reverse.

    >>> interleaved_order(1, 2, 2, 2)
    [('F', 1, 0), ('F', 1, 1), ('F', 3, 0), ('B', 3, 0), ('F', 3, 1), ('B', 3, 1), ('B', 1, 0), ('B', 1, 1)]
    """
    per_round = micro_batches // max(1, micro_batches // ranks)
    warmup = interleaved_warmup(rank, ranks, virtual, micro_batches, per_hop)
    total = virtual * micro_batches
    fwd_count: dict[int, int] = {}
    bwd_count: dict[int, int] = {}
    order: list[tuple[str, int, int]] = []

    def forward(k: int) -> None:
        chunk = ((k // per_round) % virtual) * ranks + rank
        order.append(("F", chunk, fwd_count.setdefault(chunk, 0)))
        fwd_count[chunk] += 1

    def backward(k: int) -> None:
        chunk = (virtual - 1 - (k // per_round) % virtual) * ranks + rank
        order.append(("B", chunk, bwd_count.setdefault(chunk, 0)))
        bwd_count[chunk] += 1

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(warmup + k)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return order


def zbv_order(rank: int, ranks: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """The (``"F"``/``"B"``, chunk, micro-batch) operations of ``rank`` in the order torch's
    ZBV schedule runs them (weight gradients left out: a simulator runs them where it finds
    idle time). The rank holds chunk ``rank`` on the way down the V and chunk
    ``2p − 1 − rank`` on the way up: it fills with forwards of its first chunk (more the
    nearer the top), then of both in turn, starts the backwards once the first micro-batch
    has come back up to it, then alternates a forward and a backward of each chunk, and
    drains the backwards.

    >>> zbv_order(1, 2, 2)
    [('F', 1, 0), ('F', 2, 0), ('F', 1, 1), ('F', 2, 1), ('B', 2, 0), ('B', 1, 0), ('B', 2, 1), ('B', 1, 1)]
    """
    down, up = rank, 2 * ranks - 1 - rank
    counts = {("F", down): 0, ("F", up): 0, ("B", down): 0, ("B", up): 0}
    order: list[tuple[str, int, int]] = []

    def run(kind: str, chunk: int) -> None:
        i = counts[(kind, chunk)]
        if i < micro_batches:
            order.append((kind, chunk, i))
        counts[(kind, chunk)] = i + 1

    def phase(times: int, *ops: tuple[str, int]) -> None:
        for _ in range(times):
            for kind, chunk in ops:
                run(kind, chunk)

    steps = max(2 * ranks - 1, micro_batches)  # torch plans the schedule for at least this many
    phase(2 * (ranks - rank) - 1, ("F", down))  # warm-up
    phase(rank, ("F", up), ("F", down))
    phase(ranks - rank, ("F", up), ("B", up))
    while counts[("F", up)] < counts[("F", down)] or counts[("F", down)] < steps:  # steady
        phase(int(counts[("F", down)] < steps), ("F", down))
        phase(1, ("B", down), ("F", up), ("B", up))
    phase(rank, ("B", down), ("B", up))  # drain
    phase(ranks - rank, ("B", down))
    return order


def partition_interleaved(num_layers: int, ranks: int, virtual: int, micro_batches: int,
                          stage_time: Callable[[int, int, int], StageTime],
                          per_rank: list[int] | None = None,
                          step: Callable[..., float] = interleaved_step_time,
                          max_cuts: int = EXHAUSTIVE_CUTS, groups: list[int] | None = None) -> PipelineSolution | None:
    """A cut of ``[0, num_layers)`` into ``ranks · virtual`` chunks for interleaved 1F1B
    (:func:`interleaved_step_time`); ``stage_time(i, j, g)`` is chunk ``g`` over layers
    ``[i, j)``; ``step`` the schedule's time (:func:`interleaved_step_time`, or
    :func:`zero_bubble_step_time`). Every cut is tried while there are at most ``max_cuts`` of
    them: the optimum. Otherwise only a few are: the equal cut (Megatron's rule) and, given
    ``per_rank`` (the layers each rank holds in the best plain 1F1B cut: what its speed and
    memory carry), each rank's layers split evenly over its chunks; the best by ``step``
    wins. The planner passes ``max_cuts=0``: there each new chunk is an ILP of its own, and
    every cut of an 8-layer stack into 4 chunks made interleaving cost more planning time
    than all of 1F1B's. ``groups``: each chunk's rank when it is not ``g mod p`` (ZBV's V;
    ``step`` then takes them too). None when no cut tried fits."""
    chunks = ranks * virtual
    if virtual < 1 or num_layers < chunks:
        return None
    if math.comb(num_layers - 1, chunks - 1) <= max_cuts:
        candidates = [list(c) for c in itertools.combinations(range(1, num_layers), chunks - 1)]
    else:
        candidates = [_equal_cut(num_layers, chunks)]
        if per_rank is not None and all(n >= virtual for n in per_rank) and sum(per_rank) == num_layers:
            rank_of = groups or [g % ranks for g in range(chunks)]
            candidates.append(_cut_of([per_rank[r] // virtual + (g // ranks < per_rank[r] % virtual)
                                       for g, r in enumerate(rank_of)]))
    best: PipelineSolution | None = None
    for cuts in dict.fromkeys(tuple(c) for c in candidates):
        bounds = [0, *cuts, num_layers]
        times = [stage_time(bounds[g], bounds[g + 1], g) for g in range(chunks)]
        total = step(times, ranks, micro_batches) if groups is None else step(times, ranks, micro_batches, groups)
        if math.isfinite(total) and (best is None or total < best.step_s * (1 - 1e-12)):
            best = PipelineSolution(tuple(cuts), tuple(t.total_s for t in times), total)
    return best


def _cut_of(sizes: list[int]) -> list[int]:
    """First layers of chunks 1 … n−1 for chunks of these sizes."""
    return list(itertools.accumulate(sizes))[:-1]


def _equal_cut(num_layers: int, chunks: int) -> list[int]:
    """First layers of chunks 1 … chunks−1 when the layers split as evenly as they can, the
    extra ones on the middle chunks."""
    base, extra = divmod(num_layers, chunks)
    start = (chunks - extra) // 2
    return _cut_of([base + (start <= g < start + extra) for g in range(chunks)])


def _stage_keys(num_layers: int, num_stages: int) -> list[tuple[int, int, int]]:
    """Every stage ``(i, j, s)`` a cut of ``num_layers`` into ``num_stages`` non-empty stages may use."""
    keys = []
    for s in range(num_stages):
        first = [0] if s == 0 else range(s, num_layers - num_stages + s + 1)
        for i in first:
            last = [num_layers] if s == num_stages - 1 else range(i + 1, num_layers - num_stages + s + 2)
            keys.extend((i, j, s) for j in last)
    return keys


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
