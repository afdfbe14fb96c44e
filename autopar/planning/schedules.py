"""Pipeline schedules as the stage search sees them: how each lays chunks of layers on the
device groups (:class:`Layout`), what each chunk holds in flight and may use of its
devices' memory, its step time and bubble (solvers.pipeline's formulas), and which layouts
the search tries for a ``schedule=`` option (:func:`schedule_layouts`). The stage search
itself is autopar.planning.pipeline.
"""

from __future__ import annotations

import dataclasses
import functools

from autopar.errors import AutoparError, ErrorKind
from autopar.plan_types import SPLIT_BACKWARD_SCHEDULES, V_SHAPED_SCHEDULES, chunk_group
from autopar.solvers.pipeline import (PipelineSolution, StageTime, bubble, interleaved_bubble, interleaved_step_time,
                                      interleaved_warmup, partition, partition_interleaved, step_time,
                                      zero_bubble_step_time)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a schedule lays stages on ``ranks`` device groups: ``virtual`` chunks of layers per
    group (interleaved 1F1B: chunk ``g`` on group ``g mod ranks``; ZBV: two per group, in a
    V; otherwise 1), and what each chunk holds in flight and may use of its devices' memory."""

    schedule: str
    ranks: int
    virtual: int = 1

    @property
    def zero_bubble(self) -> bool:
        """Weight gradients deferred into the bubbles (the backward split in two)."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SHAPED_SCHEDULES

    @property
    def chunks(self) -> int:
        return self.ranks * self.virtual

    def group_of(self, g: int) -> int:
        return chunk_group(g, self.ranks, self.schedule)

    @property
    def _groups(self) -> list[int] | None:
        """Each chunk's group when it is not ``g mod ranks`` (the V), for the solvers."""
        return [self.group_of(g) for g in range(self.chunks)] if self.v_shaped else None

    def in_flight(self, g: int, micro_batches: int) -> int:
        """Micro-batches whose activations chunk ``g`` holds at once: every one under GPipe;
        under 1F1B the stages from it to the last; under interleaved 1F1B its rank's warm-up
        forwards and one more (torch's ScheduleInterleaved1F1B; the zero-bubble schedule warms up
        less), shared by the rank's chunks; under ZBV (torch's ScheduleZBVZeroBubble) the down
        chunk its ``2p − r − 1`` warm-up forwards, the up chunk ``r + 1`` — ``2p`` chunks, the
        ``p`` micro-batches of a whole stage 1F1B's first stage holds."""
        if self.schedule == "GPipe":
            return micro_batches
        if self.v_shaped:  # down the V: its warm-up forwards; up: one per rank above it
            rank = self.group_of(g)
            return min(micro_batches, 2 * self.ranks - rank - 1 if g < self.ranks else rank + 1)
        if self.virtual == 1:
            return min(self.ranks - g, micro_batches)
        warmup = interleaved_warmup(self.group_of(g), self.ranks, self.virtual, micro_batches,
                                    per_hop=1 if self.zero_bubble else 2)
        return min(micro_batches, -(-(warmup + 1) // self.virtual))

    def memory_share(self) -> int:
        """Chunks sharing one device's memory: each is planned within its share of it."""
        return self.virtual

    def partition(self, num_layers: int, micro_batches: int, timer,
                  plain: PipelineSolution | None = None, lower_bound=None) -> PipelineSolution | None:
        """The best cut under this layout; interleaved layouts start from ``plain`` (the best
        cut with one stage per group), each group's layers split over its chunks. One chunk
        per group: ``lower_bound`` (at most ``timer``'s stage times) lets the search plan only
        the stages a best cut reaches."""
        if self.virtual > 1:
            sizes = None if plain is None else \
                [b - a for a, b in zip((0, *plain.cuts), (*plain.cuts, num_layers))]
            return partition_interleaved(num_layers, self.ranks, self.virtual, micro_batches, timer, sizes,
                                         step=self._interleaved_step, max_cuts=0, groups=self._groups)
        # 1F1B: stage 0 holds at most one micro-batch per stage in flight (solvers.pipeline)
        return partition(num_layers, self.ranks, micro_batches, timer, in_flight=self._round_trip,
                         lower_bound=lower_bound)

    @property
    def _round_trip(self) -> int | None:
        """Micro-batches one round trip may carry (solvers.pipeline.step_time): 1F1B's stage
        count; GPipe no bound."""
        return self.ranks if self.schedule == "1F1B" else None

    @property
    def _interleaved_step(self):
        """The step-time formula of this layout's schedule (solvers.pipeline): ZBV hides three
        weight-gradient slots per rank crossed, the interleaved zero-bubble schedule two."""
        if not self.zero_bubble:
            return interleaved_step_time
        return functools.partial(zero_bubble_step_time, hidden_per_hop=3 if self.v_shaped else 2)

    def step_s(self, times: list[StageTime], micro_batches: int) -> float:
        if self.virtual > 1:
            return self._interleaved_step(times, self.ranks, micro_batches, self._groups)
        return step_time(times, micro_batches, in_flight=self._round_trip)

    def bubble(self, micro_batches: int) -> float:
        if self.zero_bubble:  # a third of each chunk's time (its weight gradients) fills the bubble
            return (self.ranks - 1) / (3 * micro_batches * self.virtual + self.ranks - 1)
        if self.virtual > 1:
            return interleaved_bubble(self.ranks, self.virtual, micro_batches)
        return bubble(self.ranks, micro_batches)


# virtual stages per group interleaved schedules try (torchtitan and Megatron use a few per rank)
VIRTUAL_STAGES = (2, 4)
# schedules with chunks of layers per group; ZBV's V has exactly two
INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble", *V_SHAPED_SCHEDULES)
# what schedule="auto" adds to 1F1B: the two zero-bubble layouts with two chunks per group
AUTO_INTERLEAVED = (("InterleavedZeroBubble", (2,)), ("ZBVZeroBubble", (2,)))


def schedule_layouts(schedule: str, ranks: int, layers: int, micro_batches: int) -> list[Layout]:
    """The layouts the search tries for ``schedule``: a pinned interleaved schedule with 2 and
    4 chunks per group; "auto" 1F1B and the two zero-bubble schedules with 2 (interleaved
    ZB1P and ZBV) — under this cost model zero bubble is never slower than interleaved 1F1B
    and holds fewer activations (a shallower warm-up), and each extra layout plans every chunk
    again (trying all four interleaved ones doubled planning time on the H100 + A100 scenario
    of benchmarks/hetero.py; adding ZBV to auto cost 10-25 % more there). Interleaved
    ones need a layer per chunk and, as torch's interleaved schedules, a whole number of
    micro-batches per round (``m`` divisible by ``max(1, m // ranks)``); ZBV two chunks per
    group and any ``m``."""
    plain = [Layout(schedule, ranks)] if schedule in ("1F1B", "GPipe") else [Layout("1F1B", ranks)] \
        if schedule == "auto" else []
    if schedule not in ("auto", *INTERLEAVED):
        return plain
    rounds = max(1, micro_batches // ranks)
    tried = list(AUTO_INTERLEAVED) if schedule == "auto" else \
        [(schedule, (2,) if schedule in V_SHAPED_SCHEDULES else VIRTUAL_STAGES)]
    interleaved = [Layout(name, ranks, v) for name, counts in tried for v in counts
                   if ranks * v <= layers and (micro_batches % rounds == 0 or name in V_SHAPED_SCHEDULES)]
    if schedule != "auto" and not interleaved:
        raise AutoparError(ErrorKind.BAD_INPUT, f"{schedule} puts {VIRTUAL_STAGES[0]} or more chunks of layers on "
                           f"each of the {ranks} stages' devices: the model's {layers} layers are too few; use "
                           "schedule='1F1B'")
    return plain + interleaved
