"""Adapting to a changing link (issue 24): a cluster whose network between two halves follows
a bandwidth trace (100 → 10 → 1 → 10 Gbit/s, 1,000 steps each), in two scenarios:

  * "two hosts": a GPT (4 layers, d=1024) on two hosts of 8 A100 whose network between the
    hosts follows the trace; one-mesh plans (where the best plan changes with the link);
  * "two regions": benchmarks/hetero.py's GPT (8 layers, d=2048, 8 micro-batches) on its two
    regions of 8 A100 whose WAN link (30 ms) follows the trace; every family searched.

Totals of predicted time over the trace for

  * static: the plan made at the start, kept (re-costed on each phase's cluster);
  * adaptive: ``autopar.replan`` at every change, switching when it says so, paying the
    migration it reports;
  * oracle: the best plan of each phase, made afresh, switching for free.

Floors (issue 24): adaptive within 10 % of the oracle, ≥ 1.5× faster than static over the
trace (where the best plan changes at all); a re-plan takes ≤ 25 % of a fresh plan's time.
Every figure from the same cost model.

    python benchmarks/adapt.py            # writes benchmarks/results/adapt.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), HERE]

import autopar  # noqa: E402
from autopar.planning import ModelGraphs, PlanOptions  # noqa: E402
from autopar.planning.costing import recost  # noqa: E402
from autopar.planning.pipeline import recost_pipeline  # noqa: E402
from gpt import build  # noqa: E402
from hetero import GBIT, two_regions  # noqa: E402

TRACE = (100, 10, 1, 10)  # Gbit/s between the hosts, one phase each
STEPS = 1000  # per phase


def cluster_file(folder: str, gbits: float) -> str:
    """Two hosts of 8 A100 whose network runs at ``gbits`` Gbit/s."""
    path = os.path.join(folder, f"two-hosts-{gbits}.yaml")
    with open(path, "w") as f:
        f.write(f"device: A100-80GB\nnodes: 2\nper_node: 8\n"
                f"inter_node: {{bandwidth_GBps: {gbits * GBIT}, latency_us: 50}}\n")
    return path


def regions_file(folder: str, gbits: float) -> str:
    """benchmarks/hetero.py's two regions of 8 A100, the WAN link at ``gbits`` Gbit/s."""
    path = os.path.join(folder, f"two-regions-{gbits}.yaml")
    with open(path, "w") as f:
        f.write(two_regions("A100-80GB", "A100-80GB", gbits * GBIT, 30))
    return path


SCENARIOS = [  # name, model, cluster file maker, plan options
    ("two hosts, one-mesh plans", dict(layers=4, d=1024, heads=16, seq=512, batch=32, vocab=32000), cluster_file,
     {"pipeline": False, "replicas": False}),
    ("two regions (hetero.py), every family", dict(layers=8, d=2048, heads=16, seq=1024, batch=32, vocab=32000),
     regions_file, {"micro_batches": 8}),
]


def describe(plan) -> str:
    if plan.stages:
        return f"pipeline {len(plan.stages)} stages × {plan.micro_batches} micro-batches"
    if plan.replicas:
        return "replicas " + ":".join(str(r.batch) for r in plan.replicas)
    kinds = sorted({p.placement for p in plan.parameters.values()})
    return f"mesh {list(plan.mesh_shape)} {','.join(kinds)}"


def previous_step(graphs, plan, cluster) -> float:
    """``plan`` re-costed on ``cluster`` (what keeping it costs there)."""
    if plan.family == "pipeline":
        return recost_pipeline(graphs, plan, cluster, PlanOptions.of_plan(plan))
    return recost(graphs.full, plan, cluster)[0]


def scenario(name: str, shape: dict, make_file, options: dict, tmp: str) -> dict:
    model, inputs = build(**shape)
    graphs = ModelGraphs(model, inputs)
    rows, totals = [], {"static": 0.0, "adaptive": 0.0, "oracle": 0.0}
    static = autopar.plan(model, inputs, cluster=make_file(tmp, TRACE[0]), **options)
    first_s = static.timings["plan_s"]
    current = static
    for k, gbits in enumerate(TRACE):
        path = make_file(tmp, gbits)
        cluster = autopar.Cluster.from_spec(path)
        fresh = autopar.plan(model, inputs, cluster=path, **options)
        fresh_s = fresh.timings["plan_s"]  # the search alone, as replan_s (both leave capture out)
        static_step = previous_step(graphs, static, cluster)
        migration_s = 0.0
        replan_s = None
        if k:
            answer = autopar.replan(current, path)  # from the graphs the plan was made from
            replan_s = answer.replan_s
            if answer.switch:
                migration_s = answer.migration_s
                current = answer.plan
        adaptive_step = previous_step(graphs, current, cluster)
        totals["static"] += STEPS * static_step
        totals["adaptive"] += STEPS * adaptive_step + migration_s
        totals["oracle"] += STEPS * fresh.predicted_step_s
        row = {"gbit_s": gbits, "static_ms": static_step * 1e3, "adaptive_ms": adaptive_step * 1e3,
               "oracle_ms": fresh.predicted_step_s * 1e3, "adaptive_plan": describe(current),
               "oracle_plan": describe(fresh), "migration_s": migration_s,
               "fresh_plan_s": fresh_s, "replan_s": replan_s}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"scenario": name, "rows": rows, "totals_s": totals, "first_plan_s": first_s,
            "adaptive_vs_oracle": totals["adaptive"] / totals["oracle"],
            "static_vs_adaptive": totals["static"] / totals["adaptive"],
            "replan_vs_fresh": max(r["replan_s"] / r["fresh_plan_s"] for r in rows if r["replan_s"] is not None)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = [scenario(*entry, tmp) for entry in SCENARIOS]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "adapt.json"), "w") as f:
        json.dump({"scenarios": results}, f, indent=1)
    for summary in results:
        print(f"\n{summary['scenario']}")
        print(f"{'Gbit/s':>7} {'static ms':>10} {'adaptive ms':>12} {'oracle ms':>10} {'replan s':>9} {'fresh s':>8}"
              "  adaptive plan / oracle plan")
        for r in summary["rows"]:
            replan = "–" if r["replan_s"] is None else f"{r['replan_s']:.2f}"
            print(f"{r['gbit_s']:7} {r['static_ms']:10.1f} {r['adaptive_ms']:12.1f} {r['oracle_ms']:10.1f} "
                  f"{replan:>9} {r['fresh_plan_s']:8.2f}  {r['adaptive_plan']} / {r['oracle_plan']}")
        totals = summary["totals_s"]
        print(f"total over {len(TRACE)} × {STEPS} steps: static {totals['static']:.1f} s, adaptive "
              f"{totals['adaptive']:.1f} s, oracle {totals['oracle']:.1f} s; adaptive/oracle "
              f"{summary['adaptive_vs_oracle']:.3f}, static/adaptive {summary['static_vs_adaptive']:.2f}; "
              f"replan ≤ {100 * summary['replan_vs_fresh']:.0f} % of a fresh plan's time")


if __name__ == "__main__":
    main()
