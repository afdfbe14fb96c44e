"""A self-contained HTML report of a plan: no scripts from the network, inline SVG only.

Sections: summary (with the imbalance between devices), memory per device (stacked bars),
time per step (compute vs communication), the pipeline schedule (micro-batches per stage over
one step) with the stage table, replicas, baselines comparison, parameter placement map (per
layer), sparse tables and mixture-of-experts layers when the plan has them, and, for graphs of
up to 300 nodes, the ops coloured by the placement of their output. Tables shared with
``autopar show`` are the same rich tables, exported as inline-styled HTML.
"""

from __future__ import annotations

import html
import re
from collections import defaultdict


from autopar.placements import divides, parse_spec
from autopar.files import atomic_write_text
from autopar.plan import MemoryBreakdown, Plan
from autopar.report import (
    context_line, experts_table, replicas_table, sparse_table, stages_table, imbalance, precision_line,
    recompute_line, throughput_line)
from autopar.timeline import exposed_comm_s, overlap_rows, overlap_title, schedule_spans, simulated_step_line
from autopar.units import format_bytes, format_seconds

_COLORS = {"replicated": "#9aa5b1", "sharded": "#2f80ed", "partial": "#f2994a", "no tensor": "#dddddd"}
_CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#1f2933}h1{font-size:22px}
h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #cbd2d9;padding:3px 8px;text-align:left}.legend span{display:inline-block;
width:12px;height:12px;margin:0 4px 0 12px}.op{display:inline-block;width:14px;height:14px;margin:1px}"""


def _kind(placement: str | None) -> str:
    """The colour class of a placement: sharded on some mesh dim, else partial, else whole."""
    if not placement:
        return "no tensor"
    spec = parse_spec(placement)
    if any(divides(p) for p in spec):
        return "sharded"
    return "partial" if any(p.is_partial for p in spec) else "replicated"


def _bar(parts: list[tuple[str, float, str]], total: float, width: int = 520) -> str:
    x, rects = 0.0, []
    for label, value, color in parts:
        w = width * value / total if total else 0
        rects.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="22" fill="{color}">'
                     f'<title>{html.escape(label)}</title></rect>')
        x += w
    return f'<svg width="{width}" height="22" role="img">{"".join(rects)}</svg>'


def _html_table(table) -> str:
    """A rich table (the one ``autopar show`` prints) as an HTML table: its title, header and
    cells as text, so the page's styles, selection and screen readers apply."""
    head = "".join(f"<th>{html.escape(str(column.header))}</th>" for column in table.columns)
    rows = zip(*(list(column.cells) for column in table.columns))
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    caption = f"<caption>{html.escape(str(table.title))}</caption>" if table.title else ""
    return f"<table>{caption}<tr>{head}</tr>{cells}</table>"


# the memory bars' segments: label, MemoryBreakdown field, colour (the legend's order)
_MEMORY_PARTS = (("params", "params_bytes", "#2f80ed"), ("grads", "grads_bytes", "#56ccf2"),
                 ("optimizer", "optimizer_bytes", "#9b51e0"), ("activations", "activations_bytes", "#f2994a"),
                 ("gathered weights", "gathered_bytes", "#27ae60"))


def _memory_parts(memory: MemoryBreakdown, **replaced: int) -> list[tuple[str, int, str]]:
    """A device's bar segments (label, bytes, colour); ``replaced``: fields shown at other bytes."""
    return [(label, replaced.get(name, getattr(memory, name)), colour) for label, name, colour in _MEMORY_PARTS]


def _memory_rows(plan: Plan) -> list[tuple[str, object]]:
    """(devices label, their memory breakdown), identical devices in one row with their count:
    a stage's or replica's devices hold that group's plan; one mesh's devices hold equal shares."""
    groups = plan.stage_groups() or [(r,) for r in plan.replicas]  # a group's chunks share its devices
    if not groups:
        return [(_ranks_label(range(plan.num_devices)), plan.memory)]
    return [(f"{_ranks_label(g[0].ranks)} ({g[0].group})", MemoryBreakdown.together([c.memory for c in g]))
            for g in groups]


def _ranks_label(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"device {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"devices {ranks[0]}–{ranks[-1]} (×{len(ranks)})"
    return f"devices {', '.join(map(str, ranks))} (×{len(ranks)})"


def _schedule_svg(plan: Plan, width: int = 760, row: int = 24) -> str:
    """Micro-batches per stage over one step: forward blue, backward orange, deferred weight
    gradients (zero bubble) green, labelled by index."""
    spans = schedule_spans(plan)
    total = max((end for r in spans for _, end, _, _ in r), default=0.0) or 1.0
    left = 110
    shapes = []
    for s, (stage, stage_spans) in enumerate(zip(plan.stages, spans)):
        y = s * row
        label = "group" if plan.virtual_stages > 1 else "stage"  # interleaved: a row per device group
        shapes.append(f'<text x="0" y="{y + 16}" font-size="12">{label} {s} {html.escape(stage.group)}</text>')
        for start, end, kind, i in stage_spans:
            x, w = left + (width - left) * start / total, max(1.0, (width - left) * (end - start) / total)
            color = {"F": "#2f80ed", "B": "#f2994a", "W": "#27ae60"}[kind]
            what = {"F": "forward", "B": "backward", "W": "weight gradients"}[kind]
            shapes.append(f'<rect class="mb" x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row - 4}" fill="{color}" '
                          f'stroke="#fff"><title>{label} {s}: {what} of micro-batch {i}, '
                          f'{format_seconds(start)}–{format_seconds(end)}</title></rect>')
            if w > 14:
                shapes.append(f'<text x="{x + w / 2:.1f}" y="{y + 16}" font-size="11" fill="#fff" '
                              f'text-anchor="middle">{i}</text>')
    weights = "<span style='background:#27ae60'></span>weight gradients" \
        if any(kind == "W" for row_spans in spans for *_, kind, _ in row_spans) else ""
    return (f'<svg width="{width}" height="{row * len(spans)}" role="img">{"".join(shapes)}</svg>'
            f"<p class='legend'><span style='background:#2f80ed'></span>forward<span style='background:#f2994a'>"
            f"</span>backward{weights} (micro-batch index). {html.escape(simulated_step_line(plan))}</p>")


def render(plan: Plan) -> str:
    limit = plan.cluster["memory_limit_bytes"]
    spread = imbalance(plan)
    body = [f"<h1>autopar plan — {html.escape(plan.cluster['spec'])}</h1>",
            f"<p>mesh {list(plan.mesh_shape)} {list(plan.mesh_dim_names)}, {len(plan.nodes)} nodes, solver "
            f"{html.escape(plan.solver['status'])}; predicted step <b>{format_seconds(plan.predicted_step_s)}</b> "
            f"(compute {format_seconds(plan.predicted_compute_s)}, communication "
            f"{format_seconds(plan.predicted_comm_s)}, exposed {format_seconds(exposed_comm_s(plan))}); imbalance (max/mean over devices): busy time "
            f"{spread['time']:.2f}, memory {spread['memory']:.2f}</p>",
            f"<p>{html.escape(precision_line(plan))}; {html.escape(throughput_line(plan))}; "
            f"{html.escape(recompute_line(plan))}"
            f"{'; ' + html.escape(context_line(plan)) if context_line(plan) else ''}</p>",
            "<h2>Memory per device</h2>"]
    rows = _memory_rows(plan)
    kept = plan.memory.total_bytes - plan.memory.activations_bytes + plan.recompute_cost["activations_kept_bytes"] \
        if plan.recompute_cost else 0
    fullest = max([m.total_bytes for _, m in rows] + [kept])
    # bars span the limit, unless every device uses under a quarter of it: then the fullest
    # device, so that a small model still shows its split
    scale = limit if fullest >= limit / 4 else fullest
    body.append(f"<p>bars span {'the memory limit' if scale == limit else 'the fullest device'} "
                f"({format_bytes(scale)})</p><table><tr><th>devices</th><th>use</th><th>total</th><th></th></tr>")
    for label, m in rows:
        body.append(f"<tr><td>{html.escape(label)}</td><td>{100 * m.total_bytes / limit:.1f}% of "
                    f"{format_bytes(limit)}</td><td>{format_bytes(m.total_bytes)}</td>"
                    f"<td>{_bar(_memory_parts(m), scale)}</td></tr>")
    if plan.recompute_cost:  # the same placements had every activation been kept
        parts = _memory_parts(plan.memory, activations_bytes=plan.recompute_cost["activations_kept_bytes"])
        body.append(f"<tr><td>without recomputation</td><td>{100 * kept / limit:.1f}% of {format_bytes(limit)}"
                    f"</td><td>{format_bytes(kept)}</td><td>{_bar(parts, max(scale, kept))}</td></tr>")
    body.append("</table><p class='legend'>" + "".join(
        f"<span style='background:{c}'></span>{n}" for n, _, c in _MEMORY_PARTS)
        + "</p>")
    hidden = max(plan.predicted_comm_s - exposed_comm_s(plan), 0.0)
    body.append("<h2>Time per step</h2><table><tr><td>compute stream</td><td>"
                + _bar([("compute", plan.predicted_compute_s, "#27ae60"),
                        ("exposed communication", exposed_comm_s(plan), "#eb5757")], plan.predicted_step_s)
                + "</td></tr><tr><td>communication stream</td><td>"
                + _bar([("hidden communication", hidden, "#f4a6a6"),
                        ("exposed communication", exposed_comm_s(plan), "#eb5757")], plan.predicted_step_s)
                + "</td></tr></table><p class='legend'>" + "".join(
                    f"<span style='background:{c}'></span>{n} {format_seconds(t)}" for n, t, c in (
                        ("compute", plan.predicted_compute_s, "#27ae60"),
                        ("exposed communication", exposed_comm_s(plan), "#eb5757"),
                        ("hidden communication (overlapped with compute)", hidden, "#f4a6a6"))) + "</p>")
    if overlap_rows(plan):
        header = "".join(f"<th>{c}</th>" for c in ("layer", "copies", "fwd compute", "fwd gathers", "bwd compute",
                                                    "bwd reductions", "hidden"))
        body.append(f"<h3>Communication beside compute, per layer ({html.escape(overlap_title(plan))}; times per "
                    f"copy)</h3><table><tr>{header}</tr>"
                    + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                              for row in overlap_rows(plan)) + "</table>")
    if plan.stages:
        body.append(f"<h2>Pipeline schedule</h2><p>{plan.schedule}, {plan.micro_batches} micro-batches, bubble "
                    f"{100 * plan.bubble:.1f}%</p>" + _schedule_svg(plan) + _html_table(stages_table(plan)))
    if plan.replicas:
        body.append("<h2>Data-parallel replicas</h2>" + _html_table(replicas_table(plan)))
    body.append("<h2>Baselines</h2><table><tr><th>plan</th><th>predicted step</th><th>vs autopar</th></tr>"
                f"<tr><td>autopar ({html.escape(plan.family)})</td><td>{format_seconds(plan.predicted_step_s)}</td>"
                "<td>1.00</td></tr>")
    others = {f"family {name}": entry for name, entry in plan.families.items() if name != plan.family}
    for name, b in [*others.items(), *sorted(plan.baselines.items())]:
        step = b.get("predicted_step_s")
        why = b.get("skipped") or b.get("reason")
        shown = (format_seconds(step), f"{step / plan.predicted_step_s:.2f}") if step else \
            (html.escape("infeasible" + (f": {why}" if why else "")), "")
        body.append(f"<tr><td>{html.escape(name)}</td><td>{shown[0]}</td><td>{shown[1]}</td></tr>")
    body.append("</table>")
    body.append(_layer_map(plan))
    if plan.sparse:
        body.append("<h2>Sparse tables</h2>" + _html_table(sparse_table(plan)))
    if plan.experts:
        body.append("<h2>Mixture-of-experts layers</h2>" + _html_table(experts_table(plan)))
    if len(plan.nodes) <= 300:
        body.append("<h2>Graph (ops in order, coloured by output placement)</h2><div>" + "".join(
            f"<span class='op' style='background:{_COLORS[_kind(n.outputs[0] if n.outputs else None)]}' "
            f"title='{html.escape(name)}: {html.escape(str(n.outputs))}'></span>" for name, n in plan.nodes.items())
            + "</div>")
    legend = "".join(f"<span style='background:{c}'></span>{k}" for k, c in _COLORS.items())
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>autopar plan</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}<p class='legend'>{legend}</p></body></html>\n")


def _layer_map(plan: Plan) -> str:
    layers: dict[str, dict[str, str]] = defaultdict(dict)
    for fqn, p in plan.parameters.items():
        match = re.match(r"^(.*?\.\d+)\.(.*)$", fqn)
        layer, name = (match.group(1), match.group(2)) if match else ("(top)", fqn)
        layers[layer][name] = p.placement
    groups: dict[tuple, list[str]] = defaultdict(list)  # identical layers are shown once
    for layer, params in layers.items():
        groups[tuple(sorted(params.items()))].append(layer)
    rows = ["<h2>Parameter placements by layer</h2><table><tr><th>layers</th><th>parameter</th>"
            "<th>placement</th></tr>"]
    for params, names in groups.items():
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)} identical)"
        for k, (pname, placement) in enumerate(params):
            rows.append(f"<tr><td>{html.escape(label) if k == 0 else ''}</td><td>{html.escape(pname)}</td>"
                        f"<td style='color:{_COLORS[_kind(placement)]}'>{html.escape(placement)}</td></tr>")
    return "".join(rows) + "</table>"


def write(plan: Plan, path: str) -> None:
    atomic_write_text(path, render(plan))
