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
