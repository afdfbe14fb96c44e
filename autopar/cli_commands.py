"""What each ``autopar`` subcommand does, given its parsed arguments (autopar.cli parses
them and maps errors to exit codes), and the stable ``--json`` summary of a plan they print.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

from autopar.errors import AutoparError, ErrorKind
from autopar.model_files import UsageError, load_model
from autopar.units import format_bytes


def _writable_output(path: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done."""
    from autopar.files import output_problem

    problem = None if path is None else output_problem(path)
    if problem:
        raise UsageError(problem)


def summary_json(plan) -> dict:
    """The stable machine-readable summary (keys are only ever added, never renamed)."""
    from autopar.plan import MemoryBreakdown
    from autopar.report import imbalance, layer_groups, mesh_dim_roles, throughput, top_nodes

    limit = plan.cluster["memory_limit_bytes"]
    return {
        "schema_version": plan.schema_version,
        "status": plan.solver["status"].lower(),
        "plan_time_s": plan.timings["plan_s"] if plan.timings else None,
        "predicted_step_s": plan.predicted_step_s,
        "devices": plan.num_devices,
        "mesh": {"default": list(plan.mesh_shape), **{st.group: list(st.mesh_shape) for st in plan.stages}},
        "mesh_dim_roles": mesh_dim_roles(plan),
        "stages": [{"devices": len(st.ranks), "mesh": list(st.mesh_shape), "predicted_step_s": st.compute_s,
                    "group": st.group, "device": st.device, "layers": list(st.layers), "send_s": st.send_s,
                    "in_flight": st.in_flight, "memory_bytes": st.memory.total_bytes} for st in plan.stages]
        or [{"devices": plan.num_devices, "mesh": list(plan.mesh_shape), "predicted_step_s": plan.predicted_step_s}],
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule,
        "virtual_stages": plan.virtual_stages,
        "bubble": plan.bubble,
        "replicas": [{"group": r.group, "device": r.device, "devices": len(r.ranks), "mesh": list(r.mesh_shape),
                      "batch": r.batch, "predicted_step_s": r.step_s, "gradient_sync_s": r.sync_s,
                      "memory_bytes": r.memory.total_bytes} for r in plan.replicas],
        "peak_memory_bytes": [MemoryBreakdown.together([st.memory for st in chunks]).total_bytes
                              for chunks in plan.stage_groups()
                              for _ in chunks[0].ranks] + [r.memory.total_bytes for r in plan.replicas for _ in r.ranks]
        or [plan.memory.total_bytes] * plan.num_devices,
        "memory_limit_bytes": [limit] * plan.num_devices,
        "mixed_precision": plan.options.get("mixed_precision"),  # {"param_dtype", "reduce_dtype"} or None
        **throughput(plan),  # tokens_per_s_per_device (None: not a token model), predicted_mfu
        "recompute": plan.recompute,  # {layer: "full"} for layers recomputed in backward; {} for none
        "family": plan.family,  # which planning family made it: one_mesh, pipeline, replicas
        "families": plan.families,  # what each family tried predicted (or why it did not apply)
        "baselines": plan.baselines,  # hand-written configurations on this cluster
        # optimizer_state: where the master weight, gradient and optimizer states live (ZeRO-2: split
        # while the parameter is used replicated; else its placement)
        "parameters": {fqn: {"placement": p.placement, "exchange": p.exchange,
                             "optimizer_state": p.optimizer_state or p.placement}
                       for fqn, p in plan.parameters.items()},
        "solver": {"status": plan.solver["status"].lower(), "objective": plan.solver["objective_s"],
                   "bound": plan.solver["bound_s"], "solve_s": plan.timings.get("solve_s") if plan.timings else None,
                   "variables": plan.solver.get("variables")},
        "predicted_compute_s": plan.predicted_compute_s,
        "predicted_comm_s": plan.predicted_comm_s,  # every collective, hidden or not
        # what overlap could not hide: predicted_step_s ≈ compute + this on one mesh
        "predicted_exposed_comm_s": plan.predicted_exposed_comm_s
        if plan.predicted_exposed_comm_s is not None else plan.predicted_comm_s,
        "comm_bytes_per_step": plan.comm_bytes if not (plan.stages or plan.replicas) else None,
        "top_nodes": top_nodes(plan),
        "layers": layer_groups(plan),
        "imbalance": imbalance(plan),  # max/mean over devices: {"time": busy time, "memory": memory}
    }


@contextlib.contextmanager
def _progress(first: str):
    """A spinner on stderr (terminals only) showing the planner's current phase: its INFO log
    lines (capture, each mesh's solve, symbolic traces)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    logger = logging.getLogger("autopar")
    with console.status(first) as status:
        handler = _StatusHandler(status)
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)


class _StatusHandler(logging.Handler):
    def __init__(self, status) -> None:
        super().__init__(logging.INFO)
        self.status = status

    def emit(self, record: logging.LogRecord) -> None:
        self.status.update(record.getMessage()[:100])


def cmd_plan(args) -> int:
    import autopar
    from autopar.report import summary

    _writable_output(args.output)
    with _progress(f"loading {args.model}"):
        model, inputs = load_model(args.model, args.input or [], args.trust_pickle)
        plan = _plan_for_cli(autopar, args, model, inputs)
    result = summary_json(plan)
    if args.batch_size:  # the plan re-costed from its formulas: no re-tracing
        limit = plan.cluster["memory_limit_bytes"]
        result["batch_sweep"] = [{"batch_size": b, "predicted_step_s": plan.predict(b),
                                  "samples_per_s": b / plan.predict(b), "memory_bytes": plan.predict_memory(b),
                                  "fits": plan.predict_memory(b) <= limit} for b in args.batch_size]
    if args.output is not None:  # last: a command that fails writes nothing
        plan.save(args.output)
        _save_graphs(plan, args)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(summary(plan))
        for row in result.get("batch_sweep", []):
            fits = "" if row["fits"] else (f" — does not fit: needs {format_bytes(row['memory_bytes'])} per device, "
                                           f"has {format_bytes(plan.cluster['memory_limit_bytes'])}")
            print(f"batch {row['batch_size']}: predicted step {row['predicted_step_s'] * 1e3:.4g} ms, "
                  f"{row['samples_per_s']:.4g} samples/s, {format_bytes(row['memory_bytes'])} per device{fits}")
    return 0


def _plan_for_cli(autopar, args, model, inputs):
    logging.getLogger("autopar").info("capturing and planning %s", type(model).__name__)
    return autopar.plan(model, inputs, cluster=args.cluster, memory_limit=args.memory_limit,
                        time_limit_s=args.time_limit, solver=args.solver, optimizer=args.optimizer,
                        mesh_shape=args.mesh_shape, mesh_dims=args.mesh_dims,
                        pipeline={"auto": None, "on": True, "off": False}[args.pipeline],
                        micro_batches=args.micro_batches, schedule=args.schedule,
                        replicas={"auto": None, "on": True, "off": False}[args.replicas],
                        batch_split=args.batch_split,
                        symbolic=bool(args.batch_size), mixed_precision=args.precision,
                        recompute=args.recompute, overlap=not args.no_overlap, bucket_cap_mb=args.bucket_cap_mb,
                        prefetch_layers=args.prefetch_layers, configuration=args.configuration)


def cmd_replan(args) -> int:
    import autopar
    from autopar.report import summary

    from autopar.cluster_file import parse_link_change

    _writable_output(args.output)
    old = autopar.load_plan(args.plan)
    cluster = autopar.Cluster.from_spec(args.cluster, args.memory_limit)
    for change in args.link or ():
        cluster = cluster.with_link(*parse_link_change(change))
    if args.model is None:
        from autopar.planning.graph_file import graphs_path

        saved = graphs_path(args.plan)
        if not os.path.isfile(saved):
            raise AutoparError(ErrorKind.BAD_INPUT, f"no model given, and no graphs saved beside {args.plan} ({saved} "
                               "does not exist: plans written with --no-graphs, or of models with expert layers, "
                               "have none): give the model, autopar replan PLAN MODEL --cluster ...")
        with _progress(f"re-planning from {saved}"):
            answer = autopar.replan(old, cluster, graphs=saved, time_limit_s=args.time_limit, solver=args.solver)
    else:
        with _progress(f"loading {args.model}"):
            model, inputs = load_model(args.model, args.input or [], args.trust_pickle)
            answer = autopar.replan(old, cluster, model, inputs, time_limit_s=args.time_limit, solver=args.solver)
    if args.output is not None:  # last: a command that fails writes nothing
        answer.plan.save(args.output)
        _save_graphs(answer.plan, args)
    if args.json:
        print(json.dumps({**summary_json(answer.plan), "replan": answer.to_json()}, indent=1))
    else:
        print(summary(answer.plan))
        print(answer.reason)
    return 0


def _save_graphs(plan, args) -> None:
    """The graphs beside the plan just written (-o), unless --no-graphs; a note on stderr when
    they cannot be saved (the plan is written all the same)."""
    from autopar.planning.graph_file import graphs_path, save_graphs

    if args.no_graphs or plan.graphs is None:
        return
    try:
        why_not = save_graphs(plan.graphs, graphs_path(args.output))
    except AutoparError as exc:  # e.g. a folder in its place: the plan is written, say why the graphs are not
        why_not = exc.message
    if why_not:
        print(f"note: no graphs saved beside {args.output} ({why_not}); autopar replan will need the model",
              file=sys.stderr)


def cmd_show(args) -> int:
    import autopar
    from autopar.report import summary

    _writable_output(args.html)
    _writable_output(args.trace)
    plan = autopar.load_plan(args.plan)
    if args.html:
        from autopar.html_report import write

        write(plan, args.html)
    if args.trace:
        from autopar.trace import write_trace

        write_trace(plan, args.trace)
    print(json.dumps(summary_json(plan), indent=1) if args.json else summary(plan))
    return 0


def cmd_diff(args) -> int:
    import autopar
    from autopar.plan_diff import diff, diff_text

    result = diff(autopar.load_plan(args.a), autopar.load_plan(args.b))
    print(json.dumps(result, indent=1) if args.json else diff_text(result))
    return 0


def cmd_explain(args) -> int:
    import autopar
    from autopar.plan_diff import explain, explain_text

    plan = autopar.load_plan(args.plan)
    try:
        result = explain(plan, args.node)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from exc
    print(json.dumps(result, indent=1) if args.json else explain_text(result))
    return 0


def cmd_validate(args) -> int:
    import autopar
    from autopar.passes.capture import capture
    from autopar.plan_types import placement_problems

    plan = autopar.load_plan(args.plan)
    model, inputs = load_model(args.model, args.input or [], args.trust_pickle)
    captured = capture(model, inputs)
    names = {n for n, _ in model.named_parameters()}
    problems = []
    if captured.fingerprint != plan.fingerprint:
        problems.append(f"graph fingerprint {captured.fingerprint} differs from the plan's {plan.fingerprint}")
    if names != set(plan.parameters):
        missing, extra = sorted(set(plan.parameters) - names), sorted(names - set(plan.parameters))
        problems.append(f"parameters differ: plan-only {missing[:5]}, model-only {extra[:5]}")
    problems += placement_problems(plan, {fqn: tuple(p.shape) for fqn, p in model.named_parameters()},
                                   _output_shapes(captured.graph))
    result = {"valid": not problems, "problems": problems}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("plan matches the model" if not problems else "plan does not match the model:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


def _output_shapes(graph) -> dict[str, tuple]:
    """Each op node's output shapes (None for an output that is no tensor), as validate checks
    the plan's node placements against them."""
    def shapes(value) -> tuple:
        values = value if isinstance(value, (tuple, list)) else (value,)
        return tuple(tuple(v.shape) if hasattr(v, "shape") else None for v in values)

    return {n.name: shapes(n.meta.get("val")) for n in graph.nodes if n.op == "call_function"}


def cmd_devices(args) -> int:
    from autopar.devices import CATALOG

    rows = [{"name": d.name, "aliases": list(d.aliases), "peak_flops": d.peak_flops, "memory_bytes": d.memory_bytes,
             "memory_bandwidth_Bps": d.memory_bandwidth_Bps, "source": d.source} for d in CATALOG]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['name']:12s} fp32 {r['peak_flops']['fp32'] / 1e12:7.1f} TFLOP/s  "
                  f"bf16 {r['peak_flops'].get('bf16', 0) / 1e12:7.1f} TFLOP/s  "
                  f"{r['memory_bytes'] / 1e9:6.1f} GB  {r['memory_bandwidth_Bps'] / 1e9:7.0f} GB/s  {r['source']}")
    return 0


def cmd_profile(args) -> int:
    import torch

    gpu = args.device == "gpu" or (args.device == "auto" and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():
        raise UsageError("--device gpu: torch sees no GPU here (torch.cuda.is_available() is False); a CUDA build of "
                         "torch and a visible GPU are needed, or profile the CPU with --device cpu")
    most = torch.cuda.device_count() if gpu else 4 * (os.cpu_count() or 1)
    world = args.world if args.world is not None else (most if gpu else 2)
    if world < 1:
        raise UsageError(f"--world must be at least 1, got {world}")
    if world > most:
        what = (f"GPUs than this host has ({most})" if gpu
                else f"processes than this machine can measure apart ({most}: 4 per CPU)")
        raise UsageError(f"--world {world} is more {what}; profile a few and describe the rest in the cluster file "
                         "(docs/clusters.md)")
    _writable_output(args.out)
    if gpu:
        from autopar.profile_gpu import write_gpu_profile

        content = write_gpu_profile(args.out, world, args.quick)
    else:
        from autopar.profile import write_profile

        content = write_profile(args.out, world, args.quick)
    name, device = next(iter(content["devices"].items()))
    scale, unit = (1, "TFLOP/s") if gpu else (1e3, "GFLOP/s")
    link = device.get("intra_node", {})
    print(f"wrote {args.out}: {world}x{name}: fp32 {device['peak_TFLOPS']['fp32'] * scale:.1f} {unit}, "
          f"bf16 {device['peak_TFLOPS']['bf16'] * scale:.1f} {unit}, memory {device['memory_bandwidth_GBps']} GB/s, "
          f"link {link.get('bandwidth_GBps', '-')} GB/s + {link.get('latency_us', '-')} us")
    return 0


def cmd_checkpoint(args) -> int:
    from autopar.checkpoint import convert

    print(convert(args.source, args.destination))
    return 0
