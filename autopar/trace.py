"""The predicted training step as a Chrome / Perfetto trace (``autopar show plan.json --trace
step.json``), to open beside a real ``torch.profiler`` trace of the same step.

One process per device group (every device of a one-mesh plan runs the same program: one
group), one track per stream. A one-mesh plan is drawn the way the cost model sees it
(autopar.problem, issue 20): each layer's forward, then the layers' backwards in reverse,
the compute stream busy for the layer's compute and the communication stream for its
parameter collectives (gathers, gradient reductions) started with it, the phase as long as
``C + O − η·min(C, O)`` (the longer stream's span stretched by what it could not hide of the
other, η the device's overlap efficiency), the layer's ops nested in its compute span under
their names in ``pmodel.code`` (each its share by predicted time); the critical-path collectives (reshards between ops,
tensor-parallel all-reduces, exchanges) follow as one block, which is where the plan's step
time puts them in total though the program runs them between their ops. A pipeline plan is
drawn from its simulated schedule (autopar.timeline.schedule_spans): one process per stage.
"""

from __future__ import annotations

import json
import re

from autopar.errors import AutoparError, ErrorKind
from autopar.files import atomic_write_text
from autopar.plan import Plan, layer_of_path
from autopar.timeline import phase_times, schedule_spans

_US = 1e6  # trace timestamps are in microseconds


def step_trace(plan: Plan) -> dict:
    """The trace's JSON object: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    if plan.stages:
        events = _pipeline_events(plan)
    elif plan.overlap and not plan.replicas:
        events = _one_mesh_events(plan)
    else:
        raise AutoparError(ErrorKind.BAD_PLAN, "this plan has no timeline to trace: it was made before autopar "
                           "recorded one (re-plan it), or it runs replica groups (their step is each group's "
                           "one-mesh plan plus the gradient all-reduce between groups, in `autopar show`)")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"predicted_step_s": plan.predicted_step_s, "cluster": plan.cluster.get("spec")}}


def write_trace(plan: Plan, path: str) -> None:
    atomic_write_text(path, json.dumps(step_trace(plan), indent=0) + "\n")


def _one_mesh_events(plan: Plan) -> list[dict]:
    devices = f"all {plan.num_devices} devices (mesh {list(plan.mesh_shape)})"
    events = _names(0, devices, ("compute", "communication"))
    layers = [entry for entry in plan.overlap["layers"] if any(entry["forward"]) or any(entry["backward"])]
    ops: dict[str, list[tuple[str, float, str]]] = {}  # layer -> its ops with a cost, in graph order
    for name, node in sorted(plan.nodes.items(), key=lambda item: item[1].position):
        if node.compute_s > 0 and node.op != "input":
            ops.setdefault(node.layer, []).append((name, node.compute_s, node.op))
    clock = 0.0
    for phase, order in (("forward", layers), ("backward", layers[::-1])):
        for entry in order:
            copies = entry["copies"]
            compute, comm, hidden = (t / copies for t in phase_times(plan, entry, phase))
            names = _copy_names(entry["layer"] or "outside layers", copies)
            length = compute + comm - hidden
            # the longer stream is slowed by what of the shorter one overlap could not hide
            slowed = {"phase": phase, "slowed_by_the_other_stream_s": length - max(compute, comm)}
            for name in (names if phase == "forward" else names[::-1]):
                if compute:
                    span = length if compute >= comm else compute
                    events.append(_span(f"{name} {phase}", clock, span, 0, 0,
                                        slowed if compute >= comm else {"phase": phase}))
                    mine = ops.get(name if entry["layer"] else "", [])
                    events += _op_spans(mine if phase == "forward" else mine[::-1], clock, span, phase)
                if comm:
                    what = "gathers" if phase == "forward" else "gradient reductions, re-gathers"
                    moved = {fqn: p.placement for fqn, p in plan.parameters.items()
                             if (layer_of_path(fqn) or "") == (name if entry["layer"] else "")}
                    events.append(_span(f"{name} {what}", clock, length if comm > compute else comm, 0, 1,
                                        {**(slowed if comm > compute else {"phase": phase}), "parameters": moved}))
                clock += length
    rest = plan.predicted_step_s - clock
    if rest > 1e-12 * plan.predicted_step_s:
        events.append(_span("critical-path communication (reshards, tensor-parallel collectives, exchanges)",
                            clock, rest, 0, 1, {"exposed": True}))
    return events


def _pipeline_events(plan: Plan) -> list[dict]:
    events = []
    for s, (stage, spans) in enumerate(zip(plan.stages, schedule_spans(plan))):
        events += _names(s, f"stage {s}: {stage.group} ({len(stage.ranks)} devices)", ("compute",))
        for start, end, kind, micro_batch in spans:
            name = f"{ {'F': 'forward', 'B': 'backward', 'W': 'weight gradients'}[kind]} micro-batch {micro_batch}"
            events.append(_span(name, start, end - start, s, 0, {"micro_batch": micro_batch}))
    return events


def _op_spans(ops: list[tuple[str, float, str]], start_s: float, span_s: float, phase: str) -> list[dict]:
    """A layer's ops inside its compute span, each its share of the span by its predicted
    time, named as in ``pmodel.code`` (the graph's node names)."""
    total = sum(seconds for _, seconds, _ in ops)
    events, clock = [], start_s
    for k, (name, seconds, op) in enumerate(ops):
        end = start_s + span_s if k == len(ops) - 1 else clock + span_s * seconds / total
        events.append(_span(name, clock, end - clock, 0, 0, {"op": op, "phase": phase}))
        clock = end
    return events


def _copy_names(layer: str, copies: int) -> list[str]:
    """``blocks.0`` standing for 4 identical layers -> blocks.0 … blocks.3."""
    match = re.fullmatch(r"(.*\.)(\d+)", layer)
    if copies == 1 or match is None:
        return [layer] if copies == 1 else [f"{layer} (copy {k + 1} of {copies})" for k in range(copies)]
    first = int(match.group(2))
    return [f"{match.group(1)}{first + k}" for k in range(copies)]


def _names(pid: int, process: str, threads: tuple[str, ...]) -> list[dict]:
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}}]
    return meta + [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": name}}
                   for t, name in enumerate(threads)]


def _span(name: str, start_s: float, duration_s: float, pid: int, tid: int, args: dict) -> dict:
    # the duration as the difference of the microsecond ends: a span that starts where another
    # ends starts exactly there, not a rounding error inside it
    start = start_s * _US
    return {"name": name, "ph": "X", "ts": start, "dur": (start_s + duration_s) * _US - start, "pid": pid, "tid": tid,
            "args": args}
