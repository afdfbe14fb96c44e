"""Planning time and peak RSS for GPT shapes (models on the meta device: no weights allocated).

    python benchmarks/plan_time.py                      # the full grid, one subprocess per config
    python benchmarks/plan_time.py --layers 12 --hidden 768 --cluster 8xH100 --timeout 600

Each configuration runs in its own process (so peak RSS is its own) under a wall-clock limit;
a config that exceeds it is reported as "timeout". Results: a table on stdout and
benchmarks/results/plan_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GRID = [(12, 768), (24, 2048), (48, 4096)]
CLUSTERS = ["8xH100", "2x8xH100"]


def run_one(layers: int, hidden: int, cluster: str) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import autopar
    from gpt import build

    start = time.perf_counter()
    model, inputs = build(layers=layers, d=hidden, heads=max(hidden // 128, 1), vocab=50304, seq=1024, batch=8)
    plan = autopar.plan(model, inputs, cluster=cluster, time_limit_s=120)
    return {"layers": layers, "hidden": hidden, "cluster": cluster, "nodes": len(plan.nodes),
            "mesh": list(plan.mesh_shape), "status": plan.solver["status"],
            "variables": plan.solver["variables"], "solve_s": round(plan.timings["solve_s"], 2),
            "total_s": round(time.perf_counter() - start, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "predicted_step_ms": round(plan.predicted_step_s * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--cluster")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.layers, args.hidden, args.cluster)))
        return
    grid = [(args.layers, args.hidden)] if args.layers else GRID
    clusters = [args.cluster] if args.cluster else CLUSTERS
    rows = []
    for layers, hidden in grid:
        for cluster in clusters:
            cmd = [sys.executable, __file__, "--one", "--layers", str(layers), "--hidden", str(hidden),
                   "--cluster", cluster]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=True)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            except subprocess.TimeoutExpired:
                rows.append({"layers": layers, "hidden": hidden, "cluster": cluster, "status": "timeout",
                             "total_s": args.timeout})
            except subprocess.CalledProcessError as exc:
                rows.append({"layers": layers, "hidden": hidden, "cluster": cluster, "status": "error",
                             "error": exc.stderr.strip().splitlines()[-1][:200]})
            print(json.dumps(rows[-1]), flush=True)
    columns = ["layers", "hidden", "cluster", "nodes", "mesh", "variables", "status", "solve_s", "total_s",
               "peak_rss_mib", "predicted_step_ms"]
    print("\n" + " | ".join(columns))
    for row in rows:
        print(" | ".join(str(row.get(c, "")) for c in columns))
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "plan_time.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
