"""``autopar diff`` and ``autopar explain``: what changed from one plan to another, and why a
node is placed as it is (each alternative costed with every other node as planned).
"""

from __future__ import annotations

import difflib
import io
import math

from rich.console import Console
from rich.table import Table

from autopar.placements import is_replicated, parse_spec
from autopar.plan import Plan
from autopar.units import format_bytes, format_seconds


def diff(a: Plan, b: Plan) -> dict:
    """What changed from plan ``a`` to plan ``b``, and the predicted effect."""
    if a.fingerprint != b.fingerprint:  # placements of different graphs do not compare
        return {**_diff_totals(a, b), "same_model": False, "parameters_changed": {}, "nodes_changed": []}
    params = {fqn: {"from": a.parameters[fqn].placement if fqn in a.parameters else None,
                    "to": b.parameters[fqn].placement if fqn in b.parameters else None}
              for fqn in sorted(set(a.parameters) | set(b.parameters))
              if not _same_placement(a.parameters.get(fqn) and a.parameters[fqn].placement,
                                     b.parameters.get(fqn) and b.parameters[fqn].placement)}
    nodes = sorted(n for n in set(a.nodes) | set(b.nodes)
                   if not (n in a.nodes and n in b.nodes and len(a.nodes[n].outputs) == len(b.nodes[n].outputs)
                           and all(map(_same_placement, a.nodes[n].outputs, b.nodes[n].outputs))))
    return {**_diff_totals(a, b), "same_model": True, "parameters_changed": params, "nodes_changed": nodes}


def _diff_totals(a: Plan, b: Plan) -> dict:
    """The cluster, mesh, step time and memory of two plans side by side."""
    return {
        "cluster": {"from": a.cluster["spec"], "to": b.cluster["spec"]},
        "mesh": {"from": list(a.mesh_shape), "to": list(b.mesh_shape)},
        "predicted_step_s": {"from": a.predicted_step_s, "to": b.predicted_step_s,
                             "ratio": b.predicted_step_s / a.predicted_step_s if a.predicted_step_s else None},
        "memory_bytes": {"from": a.memory.total_bytes, "to": b.memory.total_bytes,
                         "delta": b.memory.total_bytes - a.memory.total_bytes},
    }


def _same_placement(x: str | None, y: str | None) -> bool:
    """Whether two placements mean the same, across meshes of different shapes: equal, or
    both whole on every device (``R`` on a 1-D mesh and ``R,R`` on a 2-D one)."""
    if x is None or y is None:
        return x is y
    a, b = parse_spec(x), parse_spec(y)
    return a == b or (is_replicated(a) and is_replicated(b))


def diff_text(d: dict) -> str:
    step, mem = d["predicted_step_s"], d["memory_bytes"]
    lines = [f"cluster {d['cluster']['from']} -> {d['cluster']['to']}, mesh {d['mesh']['from']} -> {d['mesh']['to']}"
             + ("" if d["same_model"] else "  (plans are for different models: placements not compared)"),
             f"predicted step {format_seconds(step['from'])} -> {format_seconds(step['to'])}"
             + (f" (x{step['ratio']:.3f})" if step["ratio"] else ""),
             f"memory per device {format_bytes(mem['from'])} -> {format_bytes(mem['to'])} "
             f"({'+' if mem['delta'] >= 0 else '-'}{format_bytes(abs(mem['delta']))})",
             *([f"{len(d['parameters_changed'])} parameters and {len(d['nodes_changed'])} ops changed placement"]
               if d["same_model"] else [])]
    lines += [f"  {fqn}: {c['from']} -> {c['to']}" for fqn, c in list(d["parameters_changed"].items())[:20]]
    return "\n".join(lines)


def explain(plan: Plan, node: str) -> dict:
    """The chosen strategy of ``node`` and its best alternatives, each costed with every other
    node as planned: compute, resharding on its edges, memory, and how much slower it is."""
    if node not in plan.nodes:
        raise KeyError(_no_such_node(plan, node))
    n = plan.nodes[node]
    chosen_total = n.compute_s + n.reshard_s
    rows = [{"chosen": True, "outputs": list(n.outputs), "inputs": list(n.inputs), "compute_s": n.compute_s,
             "reshard_s": n.reshard_s, "memory_delta_bytes": 0, "slower_by_s": 0.0}]
    for alt in n.alternatives:
        total = alt["compute_s"] + alt["reshard_s"]
        rows.append({"chosen": False, **alt, "slower_by_s": total - chosen_total})
    mesh = plan.stages[n.stage].mesh_shape if plan.stages else plan.mesh_shape
    result = {"node": node, "op": n.op, "fallback": n.fallback, "candidates": rows, "devices": math.prod(mesh)}
    if plan.stages:
        result["stage"] = n.stage
    if node in plan.symbolic.get("nodes", {}):
        result["formula"] = plan.symbolic["nodes"][node]  # FLOPs and bytes in the batch size
    return result


def _no_such_node(plan: Plan, node: str) -> str:
    """What to say when ``explain`` is asked for a name the plan has no node of: a parameter's
    placement if it names one, else the nearest node names."""
    if node in plan.parameters:
        return (f"{node!r} is a parameter, not an op node: its placement is {plan.parameters[node].placement}; "
                "explain takes an op node's name (autopar show --json lists them under top_nodes)")
    by_lower = {n.lower(): n for n in plan.nodes}
    close = [n for n in plan.nodes if node and node in n][:8] or \
        [by_lower[n] for n in difflib.get_close_matches(node.lower(), list(by_lower), n=5, cutoff=0.5)]
    return f"no node {node!r} in the plan" + (f"; similar: {', '.join(close)}" if close else "")


def explain_text(e: dict) -> str:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    table = Table(title=f"{e['node']} ({e['op']})" + (" — no DTensor rule, runs replicated" if e["fallback"] else ""))
    for column in ("", "outputs", "inputs", "compute", "reshard", "memory Δ", "vs chosen"):
        table.add_column(column)
    for row in e["candidates"]:
        why = "chosen" if row["chosen"] else (
            f"+{format_seconds(row['slower_by_s'])}" if row["slower_by_s"] > 0 else
            "as fast here; a tie" if row["slower_by_s"] == 0 and row["memory_delta_bytes"] == 0 else
            f"{format_seconds(row['slower_by_s'])} here, costlier elsewhere or over memory")
        table.add_row("*" if row["chosen"] else "", " ".join(o or "-" for o in row["outputs"]),
                      " ".join(row["inputs"]), format_seconds(row["compute_s"]), format_seconds(row["reshard_s"]),
                      format_bytes(row["memory_delta_bytes"]), why)
    console.print(table)
    if len(e["candidates"]) == 1:
        console.print("no other candidate: " + ("an op without a DTensor rule runs replicated" if e["fallback"] else
                      "this op has one placement on this mesh (a factory such as arange builds the same tensor on "
                      "every device; an op whose every dim is too small to split)"))
    if e.get("devices") == 1 and len(e["candidates"]) > 1:
        where = f"stage {e['stage']}" if "stage" in e else "this plan"
        console.print(f"{where} runs on one device: every placement is the whole tensor there, so the candidates "
                      "cost the same and the choice among them changes nothing")
    if e.get("formula"):
        console.print(f"as a function of the batch size: FLOPs = {e['formula']['flops']}, "
                      f"bytes moved = {e['formula']['bytes']}")
    return out.getvalue()
