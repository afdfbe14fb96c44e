"""Planning time and peak RSS for GPT shapes (models on the meta device: no weights allocated).

    python benchmarks/plan_time.py                      # the full grid, one subprocess per config
    python benchmarks/plan_time.py --layers 32 --hidden 4096 --cluster 8x8xH100 --seq 4096

Each configuration runs in its own process (so peak RSS is its own) under a wall-clock limit;
a config that exceeds it is reported as "timeout". Columns: aten nodes; ILP variables of the
unclustered problem and of the one solved (repeated layers folded); capture, prepare
(strategies, costs and LP bound of every candidate mesh), solve (all solver calls, baselines
included) and total seconds from ``autopar.plan``; peak RSS; solver status, what proved it
and the gap. Results: a table on stdout and benchmarks/results/plan_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

# (layers, hidden, heads, seq, vocab): GPT-2 small, a Llama-3-8B shape, GPT-3 13B / 175B shapes
GRID = [(12, 768, 12, 1024, 50304), (32, 4096, 32, 4096, 128256), (48, 5120, 40, 2048, 50304),
        (96, 12288, 96, 2048, 50304)]
CLUSTERS = ["8xH100", "8x8xH100", "128x8xH100"]


def run_one(layers: int, hidden: int, heads: int, seq: int, vocab: int, cluster: str, batch: int) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import autopar
    from gpt import build

    model, inputs = build(layers=layers, d=hidden, heads=heads, vocab=vocab, seq=seq, batch=batch)
    start = time.perf_counter()
    try:
        plan = autopar.plan(model, inputs, cluster=cluster, time_limit_s=120)
    except autopar.AutoparError as exc:  # e.g. no plan fits in memory: a result, not a crash
        return {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "cluster": cluster,
                "status": exc.kind.value.lower(), "total_s": round(time.perf_counter() - start, 2),
                "error": str(exc)[:160]}
    total = time.perf_counter() - start
    return {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "cluster": cluster,
            "nodes": len(plan.nodes), "mesh": list(plan.mesh_shape),
            "vars_unclustered": plan.solver["variables_unclustered"], "variables": plan.solver["variables"],
            "capture_s": round(plan.timings["capture_s"], 2), "prepare_s": round(plan.timings["prepare_s"], 2),
            "solve_s": round(plan.timings["solve_total_s"], 2), "total_s": round(total, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "status": plan.solver["status"], "method": plan.solver["method"],
            "gap": round(plan.solver["gap"], 6), "pruned_meshes": sum(c["status"] == "PRUNED" for c in plan.mesh_candidates),
            "predicted_step_ms": round(plan.predicted_step_s * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--cluster")
    parser.add_argument("--batch", type=int, default=8,
                        help="sequences per step (default 8: the decomposed attention keeps (T, T) "
                             "tensors, so larger batches of long sequences do not fit the memory model)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.layers, args.hidden, args.heads, args.seq, args.vocab, args.cluster,
                                 args.batch)))
        return
    grid = [(args.layers, args.hidden, args.heads or max(args.hidden // 128, 1), args.seq, args.vocab)] \
        if args.layers else GRID
    clusters = [args.cluster] if args.cluster else CLUSTERS
    rows = []
    for layers, hidden, heads, seq, vocab in grid:
        for cluster in clusters:
            batch = args.batch
            cmd = [sys.executable, __file__, "--one", "--layers", str(layers), "--hidden", str(hidden),
                   "--heads", str(heads), "--seq", str(seq), "--vocab", str(vocab), "--cluster", cluster,
                   "--batch", str(batch)]
            key = {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "cluster": cluster}
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            except subprocess.TimeoutExpired:
                rows.append({**key, "status": "timeout", "total_s": args.timeout})
            except subprocess.CalledProcessError as exc:
                rows.append({**key, "status": "error", "error": exc.stderr.strip().splitlines()[-1][:200]})
            print(json.dumps(rows[-1]), flush=True)
    columns = ["layers", "hidden", "seq", "batch", "cluster", "nodes", "mesh", "vars_unclustered", "variables",
               "capture_s", "prepare_s", "solve_s", "total_s", "peak_rss_mib", "status", "method", "gap"]
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_time.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
