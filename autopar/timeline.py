"""The step's time, as the plan predicts it: a pipeline's schedule simulated stage by stage,
and a one-mesh step's compute and communication streams per layer (what overlap hides).
`autopar show`, the HTML report and the Chrome trace (autopar.trace) draw from here."""

from __future__ import annotations

from rich.table import Table

from autopar.plan import Plan
from autopar.plan_types import SPLIT_BACKWARD_SCHEDULES, V_SHAPED_SCHEDULES
from autopar.solvers.pipeline import interleaved_order, zbv_order
from autopar.units import format_seconds


def schedule_spans(plan: Plan) -> list[list[tuple[float, float, str, int]]]:
    """Per device group (a row per stage; under an interleaved schedule a row per group,
    which runs its chunks in turn), the (start, end, "F"/"B"/"W", micro-batch) of every
    forward, backward and (zero bubble) weight-gradient pass in one step, simulated from the
    predicted stage and send times (backward = 2× forward).

    1F1B: stage s runs ``p − s − 1`` warm-up forwards, then alternates one forward and one
    backward, then drains; GPipe: all forwards, then all backwards; interleaved 1F1B: torch's
    order (solvers.pipeline.interleaved_order); interleaved zero bubble: the same skeleton
    with its shorter warm-up, each backward split into the input gradients ("B", what the
    previous stage waits for) and the weight gradients ("W", the stage's
    ``weight_gradients_s``), which run in the first idle time after their "B" that holds
    them, else at the end; ZBV: torch's
    order (solvers.pipeline.zbv_order), its weight gradients run the same way.
    """
    chunks, m, v = len(plan.stages), plan.micro_batches, plan.virtual_stages
    p = chunks // v
    zero_bubble = plan.schedule in SPLIT_BACKWARD_SCHEDULES
    fwd = [st.compute_s / 3 for st in plan.stages]
    # zero bubble: the input gradients; the weight gradients (StagePlan.weight_gradients_s) wait
    bwd = [2 * st.compute_s / 3 - (st.weight_gradients_s if zero_bubble else 0.0) for st in plan.stages]
    send = [st.send_s / 2 for st in plan.stages]  # one way
    per_hop = 1 if zero_bubble else 2
    orders = [zbv_order(r, p, m) if plan.schedule in V_SHAPED_SCHEDULES else
              interleaved_order(r, p, v, m, per_hop) if v > 1 else _one_chunk_order(plan.schedule, r, p, m)
              for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    spans: list[list[tuple[float, float, str, int]]] = [[] for _ in range(p)]
    deferred: list[list[tuple[float, float, int]]] = [[] for _ in range(p)]  # weight gradients: (ready, time, mb)
    clock, position = [0.0] * p, [0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            kind, g, i = orders[r][position[r]]
            need = ("F", g - 1, i) if kind == "F" and g > 0 else ("B", g + 1, i) if kind == "B" and g < chunks - 1 \
                else None
            if need is not None and need not in done:
                continue
            ready = done[need] + send[need[1]] if need is not None and kind == "F" else \
                done[need] + send[g] if need is not None else 0.0
            start = max(clock[r], ready)
            end = start + (fwd[g] if kind == "F" else bwd[g])
            done[(kind, g, i)] = clock[r] = end
            spans[r].append((start, end, kind, i))
            if zero_bubble and kind == "B":
                deferred[r].append((end, plan.stages[g].weight_gradients_s, i))
            position[r] += 1
            progressed = True
        if not progressed:  # cannot happen for these schedules; guard against an endless loop
            break
    return [_with_weight_gradients(row, weights) for row, weights in zip(spans, deferred)]


def _with_weight_gradients(row: list[tuple[float, float, str, int]], weights: list[tuple[float, float, int]]
                           ) -> list[tuple[float, float, str, int]]:
    """``row`` with each deferred weight-gradient pass (ready time, duration, micro-batch) in
    the first idle gap after it is ready that holds it, else after everything else."""
    gaps = [[a[1], b[0]] for a, b in zip(row, row[1:]) if b[0] > a[1]]
    tail = row[-1][1] if row else 0.0
    placed = []
    for ready, length, i in weights:
        gap = next((gap for gap in gaps if max(gap[0], ready) + length <= gap[1] + 1e-15), None)
        if gap is None:
            start = max(tail, ready)
            tail = start + length
        else:
            start = max(gap[0], ready)
            gaps.remove(gap)
            gaps += [piece for piece in ([gap[0], start], [start + length, gap[1]]) if piece[1] > piece[0]]
            gaps.sort()
        placed.append((start, start + length, "W", i))
    return sorted(row + placed)


def _one_chunk_order(schedule: str | None, s: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """Stage ``s``'s (kind, stage, micro-batch) order under 1F1B or GPipe."""
    warm = m if schedule == "GPipe" else min(p - s - 1, m)
    order = [("F", s, i) for i in range(warm)]
    for i in range(warm, m):
        order += [("F", s, i), ("B", s, i - warm)]
    order += [("B", s, i) for i in range(m - warm if schedule != "GPipe" else 0, m)]
    return order


def simulated_step_line(plan: Plan) -> str:
    """The timeline's own length beside the plan's predicted step. The timeline simulates the
    schedule op by op from the stages' times; the planner's formula (solvers.pipeline) charges
    every micro-batch after the first one pace — the busiest stage or link, or under 1F1B a
    round trip shared by one micro-batch per stage — so the two differ, and the line says how."""
    spans = schedule_spans(plan)
    simulated = max((end for row in spans for _, end, _, _ in row), default=0.0)
    line = f"the timeline spans {format_seconds(simulated)}"
    if simulated > 1.02 * plan.predicted_step_s:
        line += (f"; the plan predicts {format_seconds(plan.predicted_step_s)} per step: its formula overlaps "
                 "sends and stages more than this schedule lets them")
    elif simulated < 0.98 * plan.predicted_step_s:
        line += (f"; the plan predicts {format_seconds(plan.predicted_step_s)} per step: its formula charges every "
                 "micro-batch one pace (the busiest stage or link, or the round trip), the timeline lets stages "
                 "run ahead where they can")
    return line


def pipeline_timeline(plan: Plan, width: int = 72) -> list[str]:
    """One text row per stage: which micro-batch's forward (digit), backward (letter, a = 0)
    or deferred weight gradients (capital letter) runs when (:func:`schedule_spans`); '*'
    where several share one cell, '.' is idle."""
    spans = schedule_spans(plan)
    total = max((end for row in spans for _, end, _, _ in row), default=0.0) or 1.0
    rows = []
    for s, st in enumerate(plan.stages[:len(spans)]):  # interleaved: a row per group, its chunks in turn
        cells = ["."] * width
        for start, end, kind, i in spans[s]:
            mark = str(i % 10) if kind == "F" else chr(ord("a" if kind == "B" else "A") + i % 26)
            first = min(int(start / total * width), width - 1)
            for c in range(first, max(first + 1, min(int(end / total * width), width))):
                cells[c] = mark if cells[c] in (".", mark) else "*"
        row = "group" if plan.virtual_stages > 1 else "stage"  # interleaved: a group runs several stages
        rows.append(f"{row} {s} {st.group:>10} |{''.join(cells)}|")
    return rows


def phase_times(plan: Plan, entry: dict, phase: str) -> tuple[float, float, float]:
    """An overlap layer entry's phase, over all its copies: (compute, overlappable communication,
    what overlap hides: min(compute, the communication weighted by its kinds' η), negative
    where overlapping costs more than it hides). Plans made before per-kind η record two
    figures: their hidden share is η·min(compute, communication). The first layer's entry has
    one copy whose communication nothing hides (``exposed_copies``)."""
    times = entry[phase]
    share = (entry["copies"] - entry.get("exposed_copies", 0)) / entry["copies"]
    if len(times) == 3:
        compute, comm, weighted = times
        return compute, comm, share * min(compute, weighted)
    compute, comm = times
    return compute, comm, share * plan.overlap.get("efficiency", 0.0) * min(compute, comm)


def overlap_rows(plan: Plan) -> list[list[str]]:
    """Per layer group with overlappable communication: layer, copies, then forward and
    backward compute and communication per copy, and what overlap hid over all copies."""
    rows = []
    for entry in plan.overlap.get("layers", ()):
        (cf, of, hf), (cb, ob, hb) = phase_times(plan, entry, "forward"), phase_times(plan, entry, "backward")
        if of or ob:
            n = entry["copies"]
            rows.append([entry["layer"] or "(outside layers)", str(n),
                         *(format_seconds(t / n) for t in (cf, of, cb, ob)), format_seconds(hf + hb)])
    return rows


def overlap_title(plan: Plan) -> str:
    """The overlap efficiency the plan was costed with, per collective kind where measured."""
    kinds = plan.overlap.get("by_collective")
    if kinds:
        return "overlap efficiency " + ", ".join(f"{kind} {eta:g}" for kind, eta in sorted(kinds.items()))
    return f"overlap efficiency {plan.overlap.get('efficiency', 0.0):g}"


def overlap_table(plan: Plan) -> Table:
    table = Table(title=f"communication beside compute, per layer ({overlap_title(plan)}; times per copy, "
                        f"hidden over all copies)")
    for column in ("layer", "copies", "fwd compute", "fwd gathers", "bwd compute", "bwd reductions", "hidden"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for row in overlap_rows(plan):
        table.add_row(*row)
    return table


def exposed_comm_s(plan: Plan) -> float:
    """The communication overlap did not hide (all of it in plans made before overlap)."""
    return plan.predicted_comm_s if plan.predicted_exposed_comm_s is None else plan.predicted_exposed_comm_s


def step_line(plan: Plan) -> str:
    """The step as compute plus what communication adds to it, and what overlap hid."""
    line = f"predicted step {format_seconds(plan.predicted_step_s)} = compute {format_seconds(plan.predicted_compute_s)}"
    exposed = exposed_comm_s(plan)
    hidden = plan.predicted_comm_s - exposed
    if hidden <= 1e-3 * plan.predicted_comm_s:
        return line + f" + communication {format_seconds(plan.predicted_comm_s)}"
    return (line + f" + exposed communication {format_seconds(exposed)} (of {format_seconds(plan.predicted_comm_s)}: "
            f"{format_seconds(hidden)} hidden behind compute)")
