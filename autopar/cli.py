"""The ``autopar`` command line: plan saved models, inspect plans, list devices. Here: the
arguments and the exit codes; what each subcommand does is autopar.cli_commands.

Exit codes: 0 ok, 1 planning failed (infeasible, untraceable, bad plan), 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from autopar.cli_args import (HintingParser, attach_dash_values, batch_sizes, memory_bytes, mesh_shape,
                              recompute_mode, rows_per_region, subparsers, value_options)
from autopar.cli_commands import (cmd_checkpoint, cmd_devices, cmd_diff, cmd_explain, cmd_plan, cmd_profile,
                                  cmd_replan, cmd_show, cmd_validate)
from autopar.errors import AutoparError, ErrorKind, first_line
from autopar.model_files import UsageError
from autopar.plan_types import PIPELINE_SCHEDULES
from autopar.solvers.baselines import CONFIGURATIONS, configurations


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
    "replan": "autopar replan plan.json --cluster slow-wan.yaml -o plan-slow.json   # from plan.graphs.zip\n"
              "autopar replan plan.json examples.gpt:build --cluster slow-wan.yaml -o plan-slow.json\n"
              "autopar replan plan.json examples.gpt:build --cluster 1x8xH100 --json\n"
              "autopar replan plan.json examples.gpt:build --cluster wan.yaml --link us-eu=0.125GBps@40ms",
}

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
    p.add_argument("--recompute", type=recompute_mode, default="auto",
                   help="activation checkpointing: none, selective (every layer's cheap ops), full (every layer "
                        "whole), full:N (every N-th layer whole), block:K (the first K layers whole); auto: none "
                        "where that fits, else the faster of selective and full cut to the first K layers its "
                        "placements need")
    p.add_argument("--no-overlap", action="store_true",
                   help="cost every collective on the critical path (by default a layer's weight gathers and "
                        "gradient reductions hide behind its compute, as far as the device overlaps)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="gradient bucket size in MiB, each all-reduced as soon as it fills in backward (DDP's 25)")
    p.add_argument("--prefetch-layers", type=int, default=1,
                   help="how many layers ahead a sharded weight is gathered, in forward and in backward (FSDP2's 1; "
                        "0: where it is read)")
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
    p.add_argument("-o", "--output", help="write the plan JSON here (atomically), and beside it the captured graphs "
                                          "(plan.json -> plan.graphs.zip) that replan reads without the model")
    p.add_argument("--no-graphs", action="store_true", help="with -o, do not write the graphs file")
    p.add_argument("--json", action="store_true", help="print the machine-readable summary")
    p.set_defaults(run=cmd_plan)

    r = command("replan", "re-plan a saved plan for a changed cluster (slower links, fewer hosts), warm-started, "
                          "with the cost of switching")
    r.add_argument("plan")
    r.add_argument("model", nargs="?", help="the model the plan was made for (.pt2, .pt, or package.module:factory); "
                                            "without it, the graphs saved beside the plan (plan.graphs.zip)")
    r.add_argument("--cluster", required=True, help="the cluster as it is now: a shorthand or a cluster file")
    r.add_argument("--link", action="append", metavar="WHICH=BANDWIDTH[@LATENCY]",
                   help="change one link of --cluster: a WAN link between two regions (a-b=0.125GBps@40ms), "
                        "intra_node or inter_node (=100Gbps); repeatable")
    r.add_argument("--input", action="append", help="example input NAME=SHAPE:DTYPE, as for plan")
    r.add_argument("--memory-limit", type=memory_bytes, help="bytes per device: 8e9, 80GB or 80GiB")
    r.add_argument("--solver", default="cpsat")
    r.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per mesh candidate")
    r.add_argument("--trust-pickle", action="store_true", help="allow loading a pickled .pt model")
    r.add_argument("-o", "--output", help="write the new plan JSON here (atomically), and its graphs beside it")
    r.add_argument("--no-graphs", action="store_true", help="with -o, do not write the graphs file")
    r.add_argument("--json", action="store_true",
                   help="the new plan's summary and a replan object: previous_step_s, migration_bytes, "
                        "migration_s, break_even_steps, switch, reason")
    r.set_defaults(run=cmd_replan)

    s = command("show", "print a saved plan's statistics")
    s.add_argument("plan")
    s.add_argument("--json", action="store_true")
    s.add_argument("--html", metavar="REPORT.html", help="also write a self-contained HTML report")
    s.add_argument("--trace", metavar="STEP.json", help="also write the predicted step as a Chrome / Perfetto "
                   "trace (open in ui.perfetto.dev or chrome://tracing beside a torch.profiler trace)")
    s.set_defaults(run=cmd_show)

    f = command("diff", "compare two plans: placements that changed and the predicted effect")
    f.add_argument("a")
    f.add_argument("b")
    f.add_argument("--json", action="store_true")
    f.set_defaults(run=cmd_diff)

    e = command("explain", "a node's candidate strategies, their costs, and why the plan chose one")
    e.add_argument("plan")
    e.add_argument("node")
    e.add_argument("--json", action="store_true")
    e.set_defaults(run=cmd_explain)

    v = command("validate", "check that a plan was made for this model's graph")
    v.add_argument("plan")
    v.add_argument("model")
    v.add_argument("--input", action="append", help="example input NAME=SHAPE:DTYPE")
    v.add_argument("--trust-pickle", action="store_true")
    v.add_argument("--json", action="store_true")
    v.set_defaults(run=cmd_validate)

    d = command("devices", "list the device catalog")
    d.add_argument("--json", action="store_true")
    d.set_defaults(run=cmd_devices)

    r = command("profile", "measure this machine (matmul, memory bandwidth, collectives) into a cluster file")
    r.add_argument("--out", default="cpu.yaml", help="cluster file to write (atomically)")
    r.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="what to measure: this host's GPUs (their kernels, NCCL between them) or its CPU "
                        "(processes over gloo); auto: the GPUs where torch sees any")
    r.add_argument("--world", type=int, default=None,
                   help="devices the file describes (CPU: processes, default 2; GPU: default every GPU of the host)")
    r.add_argument("--quick", action="store_true", help="smaller and fewer measurements (a few seconds)")
    r.set_defaults(run=cmd_profile)

    c = command("checkpoint", "convert a sharded DCP checkpoint folder to one torch.save file, or back")
    c.add_argument("action", choices=("convert",))
    c.add_argument("source", help="a DCP checkpoint folder (dcp.save), or a torch.save file")
    c.add_argument("destination", help="the other format's path; must not exist")
    c.set_defaults(run=cmd_checkpoint)
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
