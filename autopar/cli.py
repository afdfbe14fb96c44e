"""The ``autopar`` command line: plan saved models, inspect plans, list devices.

Exit codes: 0 ok, 1 planning failed (infeasible, untraceable, bad plan), 2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

from autopar.cli_args import (HintingParser, attach_dash_values, batch_sizes, memory_bytes, mesh_shape,
                              rows_per_region, subparsers, value_options)
from autopar.errors import AutoparError, ErrorKind, first_line
from autopar.model_files import UsageError, load_model
from autopar.plan_types import PIPELINE_SCHEDULES
from autopar.solvers.baselines import CONFIGURATIONS, configurations
from autopar.units import format_bytes


EXAMPLES = {
    "plan": "autopar plan examples.gpt:build --cluster 2x8xH100 -o plan.json\n"
            "autopar plan model.pt2 --cluster 8xH100 --input tokens=8x1024:int64 --json\n"
            "autopar plan examples.gpt:build --cluster 8xH100 --pipeline off --batch-size 8,16,32",
    "show": "autopar show plan.json\nautopar show plan.json --json\nautopar show plan.json --html report.html\n"
            "autopar show plan.json --trace step.json",
    "devices": "autopar devices --json",
    "explain": "autopar explain plan.json addmm_3\nautopar explain plan.json addmm_3 --json",
    "validate": "autopar validate plan.json examples.gpt:build",
    "diff": "autopar diff plan-8xH100.json plan-2x8xH100.json\nautopar diff a.json b.json --json",
    "profile": "autopar profile --out cpu.yaml\nautopar plan examples.gpt:build --cluster cpu.yaml",
    "checkpoint": "autopar checkpoint convert ckpt/step-1000 model.pt\nautopar checkpoint convert model.pt ckpt/start",
    "replan": "autopar replan plan.json examples.gpt:build --cluster slow-wan.yaml -o plan-slow.json\n"
              "autopar replan plan.json examples.gpt:build --cluster 1x8xH100 --json\n"
              "autopar replan plan.json examples.gpt:build --cluster wan.yaml --link us-eu=0.125GBps@40ms",
}

def _writable_output(path: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done."""
    from autopar.files import output_problem

    problem = None if path is None else output_problem(path)
    if problem:
        raise UsageError(problem)


def summary_json(plan) -> dict:
    """The stable machine-readable summary (keys are only ever added, never renamed)."""
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
        "peak_memory_bytes": [sum(st.memory.total_bytes for st in chunks) for chunks in plan.stage_groups()
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


def _cmd_plan(args) -> int:
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


def _cmd_replan(args) -> int:
    import autopar
    from autopar.report import summary

    from autopar.cluster_file import parse_link_change

    _writable_output(args.output)
    old = autopar.load_plan(args.plan)
    cluster = autopar.Cluster.from_spec(args.cluster, args.memory_limit)
    for change in args.link or ():
        cluster = cluster.with_link(*parse_link_change(change))
    with _progress(f"loading {args.model}"):
        model, inputs = load_model(args.model, args.input or [], args.trust_pickle)
        answer = autopar.replan(old, cluster, model, inputs, time_limit_s=args.time_limit, solver=args.solver)
    if args.output is not None:  # last: a command that fails writes nothing
        answer.plan.save(args.output)
    if args.json:
        print(json.dumps({**summary_json(answer.plan), "replan": answer.to_json()}, indent=1))
    else:
        print(summary(answer.plan))
        print(answer.reason)
    return 0


def _cmd_show(args) -> int:
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


def _cmd_diff(args) -> int:
    import autopar
    from autopar.report import diff, diff_text

    result = diff(autopar.load_plan(args.a), autopar.load_plan(args.b))
    print(json.dumps(result, indent=1) if args.json else diff_text(result))
    return 0


def _cmd_explain(args) -> int:
    import autopar
    from autopar.report import explain, explain_text

    plan = autopar.load_plan(args.plan)
    try:
        result = explain(plan, args.node)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from exc
    print(json.dumps(result, indent=1) if args.json else explain_text(result))
    return 0


def _cmd_validate(args) -> int:
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


def _cmd_devices(args) -> int:
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


def _cmd_profile(args) -> int:
    from autopar.profile import write_profile

    if args.world < 1:
        raise UsageError(f"--world must be at least 1, got {args.world}")
    most = 4 * (os.cpu_count() or 1)
    if args.world > most:
        raise UsageError(f"--world {args.world} is more processes than this machine can measure apart ({most}: 4 per "
                         "CPU); profile a few and describe the rest in the cluster file (docs/clusters.md)")
    _writable_output(args.out)
    content = write_profile(args.out, args.world, args.quick)
    name, device = next(iter(content["devices"].items()))
    print(f"wrote {args.out}: {args.world}x{name}: fp32 {device['peak_TFLOPS']['fp32'] * 1e3:.1f} GFLOP/s, "
          f"bf16 {device['peak_TFLOPS']['bf16'] * 1e3:.1f} GFLOP/s, memory {device['memory_bandwidth_GBps']} GB/s, "
          f"link {device['intra_node']['bandwidth_GBps']} GB/s + {device['intra_node']['latency_us']} us")
    return 0


def _cmd_checkpoint(args) -> int:
    from autopar.checkpoint import convert

    print(convert(args.source, args.destination))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(prog="autopar", description="Plan tensor/data parallelism for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, epilog="example:\n  " +
                                    EXAMPLES[name].replace("\n", "\n  "),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        sub_parser.add_argument("-v", "--verbose", action="store_true",
                                help="log the planner's phases (capture, each mesh's solve, timings) to stderr")
        sub_parser.add_argument("--debug", action="store_true",
                                help="show the Python traceback of an internal error (also: AUTOPAR_DEBUG=1)")
        return sub_parser

    p = command("plan", "plan a saved model (.pt2, .pt, or package.module:factory) for a cluster")
    p.add_argument("model")
    p.add_argument("--cluster", required=True, help="e.g. 8xH100 or 2x8xA100-80GB")
    p.add_argument("--input", action="append", help="example input NAME=SHAPE:DTYPE, e.g. tokens=4x1024:int64")
    p.add_argument("--memory-limit", type=memory_bytes, help="bytes per device: 8e9, 80GB or 80GiB")
    p.add_argument("--solver", default="cpsat")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--recompute", choices=("auto", "none", "selective", "full"), default="auto",
                   help="activation checkpointing of every layer (selective: cheap ops only); auto: the first of "
                        "none, selective, full that fits")
    p.add_argument("--no-overlap", action="store_true",
                   help="cost every collective on the critical path (by default a layer's weight gathers and "
                        "gradient reductions hide behind its compute, as far as the device overlaps)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="gradient bucket size in MiB, each all-reduced as soon as it fills in backward (DDP's 25)")
    p.add_argument("--prefetch-layers", type=int, default=1,
                   help="how many layers ahead a sharded weight is gathered (FSDP2's 1; 0: where it is read)")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="fp32",
                   help="compute dtype (FSDP2's MixedPrecisionPolicy: bf16 = bf16 compute and weight gathers, "
                        "fp32 master weights, gradient reduction and optimizer states)")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per mesh candidate")
    p.add_argument("--configuration", choices=CONFIGURATIONS,
                   help="pin a hand-written configuration (its parameter and input placements; the rest is "
                        "searched), costed and lowerable like any plan; 1-D: " + ", ".join(configurations(1)) +
                        "; 2-D: " + ", ".join(configurations(2)))
    p.add_argument("--mesh-shape", type=mesh_shape, metavar="N,N[,N]",
                   help="pin the device mesh, outer dim first, e.g. 2,8 or 2,4,8 (default: searched)")
    p.add_argument("--mesh-dims", type=int, choices=(1, 2, 3), default=2,
                   help="the most dims a searched mesh has (3: also DP x (FSDP x TP) meshes over host groups)")
    p.add_argument("--pipeline", choices=("auto", "on", "off"), default="auto",
                   help="pipeline stages over the cluster's regions: auto keeps the faster of staged and one mesh")
    p.add_argument("--micro-batches", type=int, help="pipeline micro-batches per step (default: searched)")
    p.add_argument("--schedule", choices=("auto", *PIPELINE_SCHEDULES), default="auto",
                   help="pipeline schedule; auto: 1F1B or interleaved zero bubble (2 chunks of layers per stage), "
                        "the faster")
    p.add_argument("--replicas", choices=("auto", "on", "off"), default="auto",
                   help="data-parallel replicas on the cluster's regions, the batch split by their speed")
    p.add_argument("--batch-split", type=rows_per_region, metavar="N,N,...",
                   help="rows of the batch per region for replicas, e.g. 6,2")
    p.add_argument("--batch-size", type=batch_sizes, metavar="B,B,...",
                   help="also store the step time as a formula of the batch size and predict it at these "
                        "sizes, e.g. 8,16,32 (no re-tracing; the JSON gets batch_sweep)")
    p.add_argument("--trust-pickle", action="store_true", help="allow loading a pickled .pt model")
    p.add_argument("-o", "--output", help="write the plan JSON here (atomically)")
    p.add_argument("--json", action="store_true", help="print the machine-readable summary")
    p.set_defaults(run=_cmd_plan)

    r = command("replan", "re-plan a saved plan for a changed cluster (slower links, fewer hosts), warm-started, "
                          "with the cost of switching")
    r.add_argument("plan")
    r.add_argument("model", help="the model the plan was made for (.pt2, .pt, or package.module:factory)")
    r.add_argument("--cluster", required=True, help="the cluster as it is now: a shorthand or a cluster file")
    r.add_argument("--link", action="append", metavar="WHICH=BANDWIDTH[@LATENCY]",
                   help="change one link of --cluster: a WAN link between two regions (a-b=0.125GBps@40ms), "
                        "intra_node or inter_node (=100Gbps); repeatable")
    r.add_argument("--input", action="append", help="example input NAME=SHAPE:DTYPE, as for plan")
    r.add_argument("--memory-limit", type=memory_bytes, help="bytes per device: 8e9, 80GB or 80GiB")
    r.add_argument("--solver", default="cpsat")
    r.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per mesh candidate")
    r.add_argument("--trust-pickle", action="store_true", help="allow loading a pickled .pt model")
    r.add_argument("-o", "--output", help="write the new plan JSON here (atomically)")
    r.add_argument("--json", action="store_true",
                   help="the new plan's summary and a replan object: previous_step_s, migration_bytes, "
                        "migration_s, break_even_steps, switch, reason")
    r.set_defaults(run=_cmd_replan)

    s = command("show", "print a saved plan's statistics")
    s.add_argument("plan")
    s.add_argument("--json", action="store_true")
    s.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report")
    s.add_argument("--trace", metavar="STEP.json", help="also write the predicted step as a Chrome / Perfetto "
                   "trace (open in ui.perfetto.dev or chrome://tracing beside a torch.profiler trace)")
    s.set_defaults(run=_cmd_show)

    f = command("diff", "compare two plans: placements that changed and the predicted effect")
    f.add_argument("a")
    f.add_argument("b")
    f.add_argument("--json", action="store_true")
    f.set_defaults(run=_cmd_diff)

    e = command("explain", "a node's candidate strategies, their costs, and why the plan chose one")
    e.add_argument("plan")
    e.add_argument("node")
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=_cmd_explain)

    v = command("validate", "check that a plan was made for this model's graph")
    v.add_argument("plan")
    v.add_argument("model")
    v.add_argument("--input", action="append", help="example input NAME=SHAPE:DTYPE")
    v.add_argument("--trust-pickle", action="store_true")
    v.add_argument("--json", action="store_true")
    v.set_defaults(run=_cmd_validate)

    d = command("devices", "list the device catalog")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=_cmd_devices)

    r = command("profile", "measure this machine (matmul, memory bandwidth, gloo collectives) into a cluster file")
    r.add_argument("--out", default="cpu.yaml", help="cluster file to write (atomically)")
    r.add_argument("--world", type=int, default=2, help="processes (devices) the file describes")
    r.add_argument("--quick", action="store_true", help="smaller and fewer measurements (a few seconds)")
    r.set_defaults(run=_cmd_profile)

    c = command("checkpoint", "convert a sharded DCP checkpoint folder to one torch.save file, or back")
    c.add_argument("action", choices=("convert",))
    c.add_argument("source", help="a DCP checkpoint folder (dcp.save), or a torch.save file")
    c.add_argument("destination", help="the other format's path; must not exist")
    c.set_defaults(run=_cmd_checkpoint)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = attach_dash_values(sys.argv[1:] if argv is None else list(argv), value_options(parser))
    for sub_parser in (parser, *subparsers(parser)):
        sub_parser.seen_argv = argv
    args = parser.parse_args(argv)  # argparse exits with 2 on usage errors
    if args.verbose:  # the phases as log lines, also where no spinner shows (pipes, CI logs)
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("autopar").setLevel(logging.INFO)
    try:
        return args.run(args)
    except UsageError as exc:
        _traceback_when_debugging(args)
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except AutoparError as exc:
        _traceback_when_debugging(args)
        print(f"autopar {args.command}: {exc}", file=sys.stderr)
        return 2 if exc.kind in (ErrorKind.BAD_INPUT, ErrorKind.BAD_CLUSTER) else 1
    except BrokenPipeError:  # the reader went away (`| head`): the rest of the output has no one to read it
        _silence_stdout()
        return 141  # a shell's status for a process ended by SIGPIPE
    except KeyboardInterrupt:  # files are written atomically at the end: nothing half-written exists
        print(f"autopar {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except ImportError as exc:  # Ctrl-C inside an extension's import (ortools') surfaces as this
        if not isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
            return _internal_error(args, exc)
        print(f"autopar {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours, not the user's input: one line, the traceback on request
        return _internal_error(args, exc)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that Python's own flush at exit does not fail again on the
    closed pipe (and print "Exception ignored … BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _debugging(args) -> bool:
    return args.debug or os.environ.get("AUTOPAR_DEBUG", "") not in ("", "0")


def _traceback_when_debugging(args) -> None:
    """With ``--debug``, a checked error also shows where it came from (the user's own factory's
    traceback, for one), above its one-line message."""
    if _debugging(args):
        import traceback

        traceback.print_exc()


def _internal_error(args, exc: Exception) -> int:
    """Anything unexpected below the checked boundary: one line and exit 1, the traceback only
    with ``--debug`` or ``AUTOPAR_DEBUG=1``."""
    if _debugging(args):
        raise exc
    print(f"autopar {args.command}: internal error: {type(exc).__name__}: {first_line(exc)} (rerun with --debug for the "
          "traceback, and please report it)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
