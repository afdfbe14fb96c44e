"""Human-readable views of a plan (rich tables)."""

from __future__ import annotations

import io
from collections import Counter

from rich.console import Console
from rich.table import Table

from autopar.passes.layer_recompute import group_modes, recorded_mode
from autopar.placements import Shard, is_replicated, owned_dim, parse_spec
from autopar.plan import Plan, layer_of_path
from autopar.plan_types import ATTENTION_SEQUENCE_DIM, SPLIT_BACKWARD_SCHEDULES
from autopar.timeline import overlap_rows, overlap_table, pipeline_timeline, simulated_step_line, step_line
from autopar.units import format_bytes, format_seconds


def summary(plan: Plan) -> str:
    """Header; memory and time per device; baselines; placements per layer; the top nodes by
    time and by memory; parameters grouped by placement."""
    out = io.StringIO()
    console = Console(file=out, width=124, force_terminal=False)
    timing = f", planned in {plan.timings['plan_s']:.1f} s" if plan.timings else ""
    console.print(f"[bold]autopar plan[/] for {plan.cluster['spec']}: mesh {list(plan.mesh_shape)} "
                  f"{list(plan.mesh_dim_names)}, {len(plan.nodes)} nodes, solver {plan.solver['status']}{timing}")
    console.print(step_line(plan))
    console.print(precision_line(plan))
    console.print(throughput_line(plan))
    console.print(recompute_line(plan))
    context = context_line(plan)
    if context:
        console.print(context)
    memory = Table(title="memory per device in the fullest stage, and time" if plan.stages else
                   "memory per device in the largest replica's plan, and time" if plan.replicas else
                   f"memory per device, and time (all {plan.num_devices} devices run the same program)")
    m = plan.memory
    gathered = ("gathered",) if m.gathered_bytes else ()  # weights gathered whole for use (FSDP), where any
    for column in ("params", "grads", "optimizer", "activations", *gathered, "total", "limit", "use", "compute",
                   "comm", "sent/step"):
        memory.add_column(column, justify="right")
    limit = plan.cluster["memory_limit_bytes"]
    memory.add_row(*(format_bytes(b) for b in (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.activations_bytes,
                                                *(m.gathered_bytes for _ in gathered), m.total_bytes, limit)),
                   f"{100 * m.total_bytes / limit:.1f}%", format_seconds(plan.predicted_compute_s),
                   format_seconds(plan.predicted_comm_s),
                   "-" if plan.stages or plan.replicas else format_bytes(plan.comm_bytes))
    console.print(memory)
    spread = imbalance(plan)
    console.print(f"imbalance (max/mean over devices): busy time {spread['time']:.2f}, memory {spread['memory']:.2f}")
    if plan.stages:
        console.print(stages_table(plan))
        weights = ", capitals: its weight gradients (A = 0)" if plan.schedule in SPLIT_BACKWARD_SCHEDULES else ""
        console.print(f"{plan.schedule} timeline, one step ({plan.micro_batches} micro-batches; digits: forward of "
                      f"that micro-batch, letters: backward (a = 0){weights}, '*' several in one cell, '.' idle)")
        console.print(simulated_step_line(plan))
        for line in pipeline_timeline(plan):
            console.print(line, markup=False, highlight=False)
    if plan.replicas:
        console.print(replicas_table(plan))
    console.print(_baselines_table(plan))
    if overlap_rows(plan):
        console.print(overlap_table(plan))
    console.print(_layers_table(plan))
    for title, rows in top_nodes(plan).items():
        table = Table(title=f"top {len(rows)} nodes by {title.removeprefix('by_')}")
        for column in ("node", "op", "output placement", "compute", "reshard", "memory kept"):
            table.add_column(column)
        for row in rows:
            table.add_row(row["node"], row["op"], str(row["outputs"]), format_seconds(row["compute_s"]),
                          format_seconds(row["reshard_s"]), format_bytes(row["memory_bytes"]))
        console.print(table)
    params = Table(title="parameters by placement")
    zero = any(p.zero for p in plan.parameters.values())  # a column for where states live, when apart
    for column in ("placement", *(("optimizer states",) if zero else ()), "gradient sync", "count", "bytes",
                   "examples"):
        params.add_column(column)
    groups: dict[tuple[str, str, str], list[str]] = {}
    for fqn, p in plan.parameters.items():
        groups.setdefault((p.placement, p.optimizer_state or p.placement, p.exchange), []).append(fqn)
    for (placement, state, exchange), names in sorted(groups.items()):
        size = sum(plan.parameters[n].bytes for n in names)
        states = (state if state == placement else f"{state} (ZeRO-2)",) if zero else ()
        params.add_row(placement, *states, exchange, str(len(names)), format_bytes(size), ", ".join(names[:3]))
    console.print(params)
    if plan.sparse:
        console.print(sparse_table(plan))
    if plan.experts:
        console.print(experts_table(plan))
    ops = Counter(n.op for n in plan.nodes.values() if n.fallback)
    if ops:
        console.print(f"ops run replicated (no DTensor rule): {dict(ops)}")
    return out.getvalue()


def stages_table(plan: Plan) -> Table:
    chunks = f" ({plan.virtual_stages} chunks of layers per group)" if plan.virtual_stages > 1 else ""
    table = Table(title=f"pipeline: {len(plan.stages)} stages{chunks}, {plan.micro_batches} micro-batches, "
                        f"{plan.schedule}, bubble {100 * plan.bubble:.1f}%")
    for column in ("stage", "group", "devices", "mesh", "layers", "compute/mb", "send/mb", "in flight", "memory"):
        table.add_column(column)
    for k, st in enumerate(plan.stages):
        layers = f"{st.layers[0]} … {st.layers[-1]} ({len(st.layers)})" if len(st.layers) > 1 else st.layers[0]
        table.add_row(str(k), st.group, f"{len(st.ranks)}x{st.device}", str(list(st.mesh_shape)), layers,
                      format_seconds(st.compute_s), format_seconds(st.send_s), str(st.in_flight),
                      format_bytes(st.memory.total_bytes))
    return table


def replicas_table(plan: Plan) -> Table:
    total = sum(r.batch for r in plan.replicas)
    table = Table(title=f"data-parallel replicas: the batch of {total} split by group speed, gradients summed "
                        f"between groups ({format_seconds(plan.replicas[0].sync_s)} per step)")
    for column in ("group", "devices", "mesh", "rows", "share", "step", "memory"):
        table.add_column(column)
    for r in plan.replicas:
        table.add_row(r.group, f"{len(r.ranks)}x{r.device}", str(list(r.mesh_shape)), str(r.batch),
                      f"{100 * r.batch / total:.0f}%", format_seconds(r.step_s), format_bytes(r.memory.total_bytes))
    return table


def mesh_dim_roles(plan: Plan) -> list[str]:
    """What each dim of the plan's mesh does, in the words hand-written configurations use:
    "dp_shard" (the batch split and most parameter bytes, or their optimizer states, sharded:
    FSDP / ZeRO), "dp_replicate" (the batch split, parameters whole: DDP, HSDP's outer dim),
    "tp" (parameters split, the batch not), "cp" (attention's sequence split — context
    parallelism —, or the inputs split on another dim than the batch, parameters whole),
    "replicate" (none of these), "none" (a dim of one device). A pipeline plan's mesh is
    ["pp", "lane"], replica groups' ["dp_replicate", "lane"] (each group's own mesh inside)."""
    if plan.stages or plan.replicas:
        return ["pp" if plan.stages else "dp_replicate", "lane"]
    inputs = [node.output_spec() for node in plan.nodes.values() if node.op == "input" and node.outputs[0]]
    specs = [(p.bytes, parse_spec(p.placement), parse_spec(p.optimizer_state or p.placement))
             for p in plan.parameters.values()]
    total = sum(size for size, _, _ in specs) or 1
    context = context_split(plan)
    roles = []
    for d, devices in enumerate(plan.mesh_shape):
        split = {spec[d] for spec in inputs if d < len(spec) and spec[d].is_shard}
        sharded = sum(size for size, _, state in specs if not is_replicated((state[d],)))
        tensor_split = any(not is_replicated((placement[d],)) for _, placement, _ in specs)
        if devices == 1:
            roles.append("none")
        elif d in context:
            roles.append("cp")  # attention's sequence split: context parallelism
        elif Shard(0) in split:
            roles.append("dp_shard" if 2 * sharded >= total else "dp_replicate")
        elif tensor_split:
            roles.append("tp")
        elif split:
            roles.append("cp")
        else:
            roles.append("replicate")
    return roles


def imbalance(plan: Plan) -> dict[str, float]:
    """max/mean over devices of the time each is busy per step and of its memory: 1.00 when
    every device runs the same program (one mesh); pipeline stages and replicas differ."""
    groups = plan.stage_groups() or [(r,) for r in plan.replicas]  # a group's chunks share its devices
    if not groups:
        return {"time": 1.0, "memory": 1.0}
    busy = [sum(g.busy_s for g in chunks) for chunks in groups for _ in chunks[0].ranks]
    memory = [sum(g.memory.total_bytes for g in chunks) for chunks in groups for _ in chunks[0].ranks]

    def ratio(values: list[float]) -> float:
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    return {"time": ratio(busy), "memory": ratio(memory)}


_TOP = 5


def throughput(plan: Plan) -> dict:
    """Predicted ``tokens_per_s_per_device`` (None when the first input is not token ids) and
    ``predicted_mfu`` (autopar.planning.throughput; None for plans made before plans recorded
    their work)."""
    work, step = plan.work, plan.predicted_step_s
    if not work or step <= 0:
        return {"tokens_per_s_per_device": None, "predicted_mfu": None}
    tokens = work.get("tokens_per_step")
    return {"tokens_per_s_per_device": tokens / step / work["devices"] if tokens else None,
            "predicted_mfu": work["flops_per_step"] / (step * work["peak_flops_per_s"])}


def throughput_line(plan: Plan) -> str:
    rates = throughput(plan)
    if rates["predicted_mfu"] is None:
        return "throughput: not recorded in this plan"
    tokens = rates["tokens_per_s_per_device"]
    per = f"{tokens:,.0f} tokens/s per device, " if tokens else ""
    return (f"predicted {per}MFU {100 * rates['predicted_mfu']:.1f}% "
            f"({plan.work['flops_per_step']:.3g} FLOPs per step in {plan.work['flops_dtype']})")


def _plan_layers(plan: Plan) -> list[str]:
    """The model's layers, in the order the plan's nodes run them."""
    return list(dict.fromkeys(node.layer for node in plan.nodes.values() if node.layer))


def recompute_label(plan: Plan) -> str:
    """The recompute mode and how many layers it reruns: "none", "full (80 layers)",
    "full:2 (40 of 80 layers)" (the benchmarks' tables)."""
    if not plan.recompute:
        return "none"
    layers = _plan_layers(plan)
    of = f" of {len(layers)}" if len(plan.recompute) < len(layers) else ""
    return f"{_recorded_mode(plan, layers)} ({len(plan.recompute)}{of} layers)"


def _recorded_mode(plan: Plan, layers: list[str]) -> str:
    """The mode ``plan`` recomputes with: one ("full", "full:2", …), or per pipeline stage
    where they differ ("per stage: full / block:1 / none")."""
    groups = [st.layers for st in plan.stages] if plan.stages else [layers]
    try:  # a pipeline's stages count their N-th layers each
        return recorded_mode(groups, plan.recompute)
    except ValueError:
        pass
    try:  # under "auto" each stage recomputes what its own memory requires
        return "per stage: " + " / ".join(group_modes(groups, plan.recompute))
    except ValueError:  # a record no mode gives (edited by hand): show what it says
        return next(iter(plan.recompute.values()))


def recompute_line(plan: Plan) -> str:
    """Which layers run their forward again in backward (activation checkpointing)."""
    if not plan.recompute:
        return "recompute: none (every activation kept for backward)"
    layers = list(plan.recompute)
    named = ", ".join(layers) if len(layers) <= 3 else f"{layers[0]} … {layers[-1]}"
    kinds = set(plan.recompute.values())
    what = "whole" if kinds == {"full"} else "but their matmul and attention outputs" if kinds == {"selective"} \
        else "whole or (selective) but their matmul and attention outputs"
    every = _plan_layers(plan)
    of = f" of {len(every)}" if len(layers) < len(every) else ""
    line = f"recompute ({_recorded_mode(plan, every)}): {len(layers)}{of} layers ({named}) rerun in backward, {what}"
    cost = plan.recompute_cost
    if cost:
        line += (f"; costs {format_seconds(cost['rerun_s'])} of forward a step, keeps "
                 f"{format_bytes(plan.memory.activations_bytes)} of activations instead of "
                 f"{format_bytes(cost['activations_kept_bytes'])}")
    return line


def context_split(plan: Plan) -> dict[int, set[str]]:
    """Mesh dims on which attention splits its sequence (context parallelism) -> how its
    chunks are computed there ("contiguous chunks", "load-balanced causal halves")."""
    split: dict[int, set[str]] = {}
    for node in plan.nodes.values():
        if "scaled_dot_product_attention" in node.op and node.outputs and node.outputs[0]:
            for d, p in enumerate(node.output_spec()):
                if p == Shard(ATTENTION_SEQUENCE_DIM):
                    split.setdefault(d, set()).add("load-balanced causal halves" if node.exchange
                                                   else "contiguous chunks")
    return split


def context_line(plan: Plan) -> str | None:
    """Where attention splits its sequence (context parallelism), over how many devices, and
    whether causal chunks are load-balanced; None when no attention does."""
    split = context_split(plan)
    if not split:
        return None
    dims = "; ".join(f"mesh dim {plan.mesh_dim_names[d] if d < len(plan.mesh_dim_names) else d} "
                     f"({plan.mesh_shape[d]} devices, {' and '.join(sorted(kinds))})" for d, kinds in split.items())
    return f"context parallelism: attention's sequence split on {dims}; keys and values all-gathered"


def precision_line(plan: Plan) -> str:
    """What the plan computes in: the mixed-precision policy, or the model's own dtypes."""
    policy = plan.options.get("mixed_precision")
    if not policy:
        return "precision: the model's own dtypes (no mixed-precision policy)"
    return (f"mixed precision: compute, activations and weight gathers in {policy['param_dtype']}; masters, "
            f"optimizer states, gradient all-reduce in {policy['reduce_dtype']}")


def top_nodes(plan: Plan, k: int = _TOP) -> dict[str, list[dict]]:
    """The ``k`` nodes that cost the most time (compute + resharding) and memory."""
    def row(name: str) -> dict:
        n = plan.nodes[name]
        return {"node": name, "op": n.op, "outputs": ",".join(o or "-" for o in n.outputs),
                "compute_s": n.compute_s, "reshard_s": n.reshard_s, "memory_bytes": n.memory_bytes}
    by_time = sorted(plan.nodes, key=lambda m: (-(plan.nodes[m].compute_s + plan.nodes[m].reshard_s), m))[:k]
    by_memory = sorted(plan.nodes, key=lambda m: (-plan.nodes[m].memory_bytes, m))[:k]
    return {"by_time": [row(m) for m in by_time], "by_memory": [row(m) for m in by_memory]}


def layer_groups(plan: Plan) -> list[dict]:
    """Parameter placements per layer; consecutive layers placed alike form one group
    (``blocks.0–31``), parameters outside indexed layers form one group each module."""
    layers: dict[str, dict[str, str]] = {}
    for fqn, p in plan.parameters.items():
        layer = layer_of_path(fqn) or fqn.rsplit(".", 1)[0]
        layers.setdefault(layer, {})[fqn[len(layer) + 1:]] = p.placement
    groups: list[dict] = []
    for layer, placements in layers.items():
        family, _, index = layer.rpartition(".")
        last = groups[-1] if groups else None
        if (last and index.isdigit() and last["family"] == family and last["placements"] == placements
                and last["last"] == int(index) - 1):
            last["last"] = int(index)
            continue
        groups.append({"family": family, "first": int(index) if index.isdigit() else None,
                       "last": int(index) if index.isdigit() else None, "layer": layer, "placements": placements})
    return [{"layers": g["layer"] if g["first"] is None or g["first"] == g["last"]
             else f"{g['family']}.{g['first']}-{g['last']}", "placements": g["placements"]} for g in groups]


def _layers_table(plan: Plan) -> Table:
    table = Table(title="parameter placements per layer (identical consecutive layers grouped)")
    table.add_column("layers")
    table.add_column("placements")
    for group in layer_groups(plan):
        table.add_row(group["layers"], ", ".join(f"{k} {v}" for k, v in group["placements"].items()))
    return table


def sparse_table(plan: Plan) -> Table:
    """Parallax's view of each embedding table: how sparse its access is and what each way of
    exchanging its gradient would move."""
    table = Table(title="sparse tables: access and bytes per step per device by exchange",
                  caption="row-sharded: ids gathered, lookup results (bags pooled on the owner) reduced and back; "
                  "table-wise: the whole table on one device (owner), pooled bags sent in one all-to-all")
    between = any("between_groups" in t for t in plan.sparse.values())  # replicas: how tables cross groups
    columns = ["table", "rows", "touched/device", "from", "chosen", "allreduce", "sparse rows", "row-sharded",
               "table-wise"]
    if between:
        columns += ["between groups", "between: allreduce", "between: rows"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("table", "from", "chosen", "between groups") else "right")
    for fqn, t in sorted(plan.sparse.items()):
        volumes = t["bytes_per_step"]
        chosen = t["exchange"] + (f" (device {t['owner']})" if "owner" in t else "")
        row = [fqn, f"{t['rows']:,}", f"{t['touched_rows']:,} ({100 * t['density']:.2g}%)", t["density_source"],
               chosen, *(format_bytes(volumes[k]) if k in volumes else "-"
                         for k in ("allreduce", "sparse_allgather", "row_sharded", "table_wise"))]
        if between:
            crossing = t.get("between_groups_bytes", {})
            row += [t.get("between_groups", "-"),
                    *(format_bytes(crossing[k]) if k in crossing else "-" for k in ("allreduce", "sparse_allgather"))]
        table.add_row(*row)
    return table


def experts_table(plan: Plan) -> Table:
    owned = any(owned_dim(p.spec) is not None for p in plan.parameters.values())
    table = Table(title="mixture-of-experts layers: placement and tokens per device",
                  caption="expert weights placed O: each expert's weights whole on one device, its owner; "
                  "expert order (placed): device d holds the d-th block of experts in that order"
                  if owned else None)
    for column in ("layer", "experts", "top-k", "placement", "chosen", "load from", "max/mean in order",
                   "max/mean balanced", "expert order"):
        table.add_column(column)
    for module, layer in sorted(plan.experts.items()):
        order = layer["order"]
        shown = "as is" if order == sorted(order) else " ".join(map(str, order[:16])) + (" …" if len(order) > 16 else "")
        if order != sorted(order):  # placed: the experts live in this order; advice: they keep the model's
            shown += " (placed)" if layer.get("order_applied") else " (advice)"
        name = f"{module} (ModuleList, batched)" if layer.get("form") == "module_list" else module
        table.add_row(name, str(layer["experts"]), str(layer["top_k"] or "?"), layer["placement"], layer["exchange"],
                      layer["load_source"], f"{layer['imbalance_in_order']:.2f}", f"{layer['imbalance']:.2f}", shown)
    return table


def _baselines_table(plan: Plan) -> Table:
    table = Table(title="plan vs baselines (same cost model)")
    for column in ("configuration", "predicted step", "plan is faster by", "memory/device"):
        table.add_column(column)
    table.add_row(f"autopar plan ({plan.family})", format_seconds(plan.predicted_step_s), "",
                  format_bytes(plan.memory.total_bytes))
    others = {f"family {name}": entry for name, entry in plan.families.items() if name != plan.family}
    for name, b in [*others.items(), *sorted(plan.baselines.items())]:
        memory = format_bytes(b["memory_bytes"]) if b.get("memory_bytes") is not None else ""
        if b.get("feasible") and b.get("predicted_step_s"):
            table.add_row(name, format_seconds(b["predicted_step_s"]),
                          f"x{b['predicted_step_s'] / plan.predicted_step_s:.2f}", memory)
        else:
            why = b.get("skipped") or b.get("reason")
            table.add_row(name, "infeasible" + (f": {why}" if why else ""), "", memory)
    return table
