"""Adapting to a changing link (issue 24): a GPT on two hosts of 8 A100 whose network between
the hosts follows a bandwidth trace (100 → 10 → 1 → 10 Gbit/s, 1,000 steps each). Totals of
predicted time over the trace for

  * static: the plan made at the start, kept (re-costed on each phase's cluster);
  * adaptive: ``autopar.replan`` at every change, switching when it says so, paying the
    migration it reports;
  * oracle: the best plan of each phase, made afresh, switching for free.

Floors (issue 24): adaptive within 10 % of the oracle, ≥ 1.5× faster than static over the
trace; a re-plan takes ≤ 25 % of a fresh plan's time. One-mesh plans only (the family
``replan`` re-costs today); every figure from the same cost model.

    python benchmarks/adapt.py            # writes benchmarks/results/adapt.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples")]

import autopar  # noqa: E402
from autopar.planning import ModelGraphs  # noqa: E402
from autopar.planning.costing import recost  # noqa: E402
from gpt import build  # noqa: E402

GBIT = 0.125  # GB/s per Gbit/s
TRACE = (100, 10, 1, 10)  # Gbit/s between the hosts, one phase each
STEPS = 1000  # per phase


def cluster_file(folder: str, gbits: float) -> str:
    path = os.path.join(folder, f"two-hosts-{gbits}.yaml")
    with open(path, "w") as f:
        f.write(f"device: A100-80GB\nnodes: 2\nper_node: 8\n"
                f"inter_node: {{bandwidth_GBps: {gbits * GBIT}, latency_us: 50}}\n")
    return path


def describe(plan) -> str:
    kinds = sorted({p.placement for p in plan.parameters.values()})
    return f"mesh {list(plan.mesh_shape)} {','.join(kinds)}"


def main() -> None:
    model, inputs = build(layers=4, d=1024, heads=16, seq=512, batch=32, vocab=32000)
    graphs = ModelGraphs(model, inputs)
    options = {"pipeline": False, "replicas": False}
    rows, totals = [], {"static": 0.0, "adaptive": 0.0, "oracle": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        static = autopar.plan(model, inputs, cluster=cluster_file(tmp, TRACE[0]), **options)
        first_s = static.timings["plan_s"]
        current = static
        for k, gbits in enumerate(TRACE):
            path = cluster_file(tmp, gbits)
            cluster = autopar.Cluster.from_spec(path)
            fresh = autopar.plan(model, inputs, cluster=path, **options)
            fresh_s = fresh.timings["plan_s"]  # the search alone, as replan_s (both leave capture out)
            static_step, _ = recost(graphs.full, static, cluster)
            migration_s = 0.0
            replan_s = None
            if k:
                answer = autopar.replan(current, path)  # from the graphs the plan was made from
                replan_s = answer.replan_s
                if answer.switch:
                    migration_s = answer.migration_s
                    current = answer.plan
            adaptive_step, _ = recost(graphs.full, current, cluster)
            totals["static"] += STEPS * static_step
            totals["adaptive"] += STEPS * adaptive_step + migration_s
            totals["oracle"] += STEPS * fresh.predicted_step_s
            row = {"gbit_s": gbits, "static_ms": static_step * 1e3, "adaptive_ms": adaptive_step * 1e3,
                   "oracle_ms": fresh.predicted_step_s * 1e3, "adaptive_plan": describe(current),
                   "oracle_plan": describe(fresh), "migration_s": migration_s,
                   "fresh_plan_s": fresh_s, "replan_s": replan_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {"rows": rows, "totals_s": totals, "first_plan_s": first_s,
               "adaptive_vs_oracle": totals["adaptive"] / totals["oracle"],
               "static_vs_adaptive": totals["static"] / totals["adaptive"],
               "replan_vs_fresh": max(r["replan_s"] / r["fresh_plan_s"] for r in rows if r["replan_s"] is not None)}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "adapt.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n{'Gbit/s':>7} {'static ms':>10} {'adaptive ms':>12} {'oracle ms':>10}  adaptive plan / oracle plan")
    for r in rows:
        print(f"{r['gbit_s']:7} {r['static_ms']:10.1f} {r['adaptive_ms']:12.1f} {r['oracle_ms']:10.1f}  "
              f"{r['adaptive_plan']} / {r['oracle_plan']}")
    print(f"\ntotal over {len(TRACE)} × {STEPS} steps: static {totals['static']:.1f} s, adaptive "
          f"{totals['adaptive']:.1f} s, oracle {totals['oracle']:.1f} s; adaptive/oracle "
          f"{summary['adaptive_vs_oracle']:.3f}, static/adaptive {summary['static_vs_adaptive']:.2f}; "
          f"replan ≤ {100 * summary['replan_vs_fresh']:.0f} % of a fresh plan's time")


if __name__ == "__main__":
    main()
