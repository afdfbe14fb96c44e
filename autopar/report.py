"""Human-readable views of a plan (rich tables)."""

from __future__ import annotations

import io
from collections import Counter

from rich.console import Console
from rich.table import Table

from autopar.plan import Plan
from autopar.units import format_bytes, format_seconds


def summary(plan: Plan) -> str:
    """Header, memory per device, and parameter placements grouped by placement."""
    out = io.StringIO()
    console = Console(file=out, width=110, force_terminal=False)
    timing = f", planned in {plan.timings['plan_s']:.1f} s" if plan.timings else ""
    console.print(f"[bold]autopar plan[/] for {plan.cluster['spec']}: mesh {list(plan.mesh_shape)} "
                  f"{list(plan.mesh_dim_names)}, {len(plan.nodes)} nodes, solver {plan.solver['status']}{timing}")
    console.print(f"predicted step {format_seconds(plan.predicted_step_s)} = compute "
                  f"{format_seconds(plan.predicted_compute_s)} + communication {format_seconds(plan.predicted_comm_s)}")
    memory = Table(title="memory per device")
    for column in ("params", "grads", "optimizer", "activations", "total", "limit", "use"):
        memory.add_column(column, justify="right")
    m = plan.memory
    limit = plan.cluster["memory_limit_bytes"]
    memory.add_row(*(format_bytes(b) for b in (m.params_bytes, m.grads_bytes, m.optimizer_bytes,
                                                m.activations_bytes, m.total_bytes, limit)),
                   f"{100 * m.total_bytes / limit:.1f}%")
    console.print(memory)
    params = Table(title="parameters by placement")
    for column in ("placement", "gradient sync", "count", "bytes", "examples"):
        params.add_column(column)
    groups: dict[tuple[str, str], list[str]] = {}
    for fqn, p in plan.parameters.items():
        groups.setdefault((p.placement, p.exchange), []).append(fqn)
    for (placement, exchange), names in sorted(groups.items()):
        size = sum(plan.parameters[n].bytes for n in names)
        params.add_row(placement, exchange, str(len(names)), format_bytes(size), ", ".join(names[:3]))
    console.print(params)
    ops = Counter(n.op for n in plan.nodes.values() if n.fallback)
    if ops:
        console.print(f"ops run replicated (no DTensor rule): {dict(ops)}")
    return out.getvalue()


def diff(a: Plan, b: Plan) -> dict:
    """What changed from plan ``a`` to plan ``b``, and the predicted effect."""
    params = {fqn: {"from": a.parameters[fqn].placement if fqn in a.parameters else None,
                    "to": b.parameters[fqn].placement if fqn in b.parameters else None}
              for fqn in sorted(set(a.parameters) | set(b.parameters))
              if (a.parameters.get(fqn) and a.parameters[fqn].placement) != (b.parameters.get(fqn) and b.parameters[fqn].placement)}
    nodes = sorted(n for n in set(a.nodes) | set(b.nodes)
                   if (a.nodes.get(n) and a.nodes[n].outputs) != (b.nodes.get(n) and b.nodes[n].outputs))
    return {
        "same_model": a.fingerprint == b.fingerprint,
        "cluster": {"from": a.cluster["spec"], "to": b.cluster["spec"]},
        "mesh": {"from": list(a.mesh_shape), "to": list(b.mesh_shape)},
        "predicted_step_s": {"from": a.predicted_step_s, "to": b.predicted_step_s,
                             "ratio": b.predicted_step_s / a.predicted_step_s if a.predicted_step_s else None},
        "memory_bytes": {"from": a.memory.total_bytes, "to": b.memory.total_bytes,
                         "delta": b.memory.total_bytes - a.memory.total_bytes},
        "parameters_changed": params,
        "nodes_changed": nodes,
    }


def diff_text(d: dict) -> str:
    step, mem = d["predicted_step_s"], d["memory_bytes"]
    lines = [f"cluster {d['cluster']['from']} -> {d['cluster']['to']}, mesh {d['mesh']['from']} -> {d['mesh']['to']}"
             + ("" if d["same_model"] else "  (plans are for different models)"),
             f"predicted step {format_seconds(step['from'])} -> {format_seconds(step['to'])}"
             + (f" (x{step['ratio']:.3f})" if step["ratio"] else ""),
             f"memory per device {format_bytes(mem['from'])} -> {format_bytes(mem['to'])} "
             f"({'+' if mem['delta'] >= 0 else '-'}{format_bytes(abs(mem['delta']))})",
             f"{len(d['parameters_changed'])} parameters and {len(d['nodes_changed'])} ops changed placement"]
    lines += [f"  {fqn}: {c['from']} -> {c['to']}" for fqn, c in list(d["parameters_changed"].items())[:20]]
    return "\n".join(lines)
