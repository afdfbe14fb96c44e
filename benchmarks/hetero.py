"""Heterogeneous and cross-region clusters: autopar's plan (pipeline stages over device
groups, data-parallel replicas with the batch split by group speed, or one WAN-aware mesh,
whichever is fastest) vs

  * the uniform-mesh plan a homogeneous planner picks: planned as if every link between
    hosts were the datacenter network and every device the slowest one, then costed on the
    real cluster (``costing.recost``);
  * DDP / FSDP / Megatron-TP / TP×DP on one mesh over every device, costed on the real cluster.

All figures are predicted step times from the same cost model. Floor (issue 6): ≥ 1.3×
better than the uniform-mesh plan on the 1 Gbit/s two-region case.

    python benchmarks/hetero.py            # writes benchmarks/results/hetero.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples")]

import autopar  # noqa: E402
from autopar.cluster import Cluster  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.planning.costing import recost  # noqa: E402
from autopar.planning import PlanOptions  # noqa: E402
from autopar.planning.one_mesh import make_plan  # noqa: E402
from gpt import build  # noqa: E402

GBIT = 0.125  # GB/s per Gbit/s


def two_regions(a: str, b: str, gbps: float, latency_ms: float) -> str:
    return (f"regions:\n  east: {{device: {a}, nodes: 1, per_node: 8}}\n"
            f"  west: {{device: {b}, nodes: 1, per_node: 8}}\n"
            f"links:\n  - {{between: [east, west], bandwidth_GBps: {gbps}, latency_ms: {latency_ms}}}\n")


SCENARIOS = [  # name, cluster file text
    ("2 regions A100, 1 Gbit/s", two_regions("A100-80GB", "A100-80GB", 1 * GBIT, 30)),
    ("2 regions A100, 10 Gbit/s", two_regions("A100-80GB", "A100-80GB", 10 * GBIT, 30)),
    ("2 regions A100, 100 Gbit/s", two_regions("A100-80GB", "A100-80GB", 100 * GBIT, 30)),
    ("H100 + A100, one site (IB)", two_regions("H100", "A100-80GB", 25, 0.005)),
    ("A100 + V100, one site (IB)", two_regions("A100-80GB", "V100-32GB", 12.5, 0.005)),
]


def homogeneous_view(cluster: Cluster) -> Cluster:
    """What a planner that assumes one uniform mesh sees: no regions, the inter-node network
    between every pair of hosts, every device the slowest one."""
    return dataclasses.replace(cluster, host_regions=(), wan_links=(), region_clusters=())


def main() -> None:
    model, inputs = build(layers=8, d=2048, heads=16, seq=1024, batch=32, vocab=32000)
    captured = capture(model, inputs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in SCENARIOS:
            path = os.path.join(tmp, "cluster.yaml")
            with open(path, "w") as f:
                f.write(text)
            cluster = Cluster.from_spec(path)
            start = time.perf_counter()
            plan = autopar.plan(model, inputs, cluster=path, micro_batches=8)
            plan_s = time.perf_counter() - start
            blind = make_plan(captured, homogeneous_view(cluster), PlanOptions(), baselines=False)
            uniform_s, _memory = recost(captured, blind, cluster)
            feasible = {k: v["predicted_step_s"] for k, v in plan.baselines.items() if v["feasible"]}
            kind = ("pipeline" if plan.stages else "replicas " + ":".join(str(r.batch) for r in plan.replicas)
                    if plan.replicas else f"mesh {list(plan.mesh_shape)}")
            row = {"scenario": name, "plan": kind,
                   "stages": [{"group": st.group, "device": st.device, "layers": len(st.layers),
                               "mesh": list(st.mesh_shape)} for st in plan.stages],
                   "micro_batches": plan.micro_batches if plan.stages else None,
                   "plan_ms": plan.predicted_step_s * 1e3,
                   "uniform_mesh_blind_ms": uniform_s * 1e3,
                   **{f"{k}_ms": (plan.families.get(k) or {}).get("predicted_step_s") and
                      plan.families[k]["predicted_step_s"] * 1e3 for k in ("one_mesh", "pipeline", "replicas")},
                   **{f"{k}_ms": v * 1e3 for k, v in feasible.items()},
                   "speedup_vs_uniform_blind": uniform_s / plan.predicted_step_s,
                   "speedup_vs_best_baseline": min(feasible.values()) / plan.predicted_step_s if feasible else None,
                   "plan_s": plan_s}
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "hetero.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'scenario':30} {'plan':>14} {'ours ms':>10} {'uniform ms':>11} {'×':>6} {'best base ms':>13} {'×':>6}")
    for r in rows:
        base = min((v for k, v in r.items() if k.endswith("_ms") and k.split("_ms")[0] in
                    ("ddp", "fsdp", "megatron_tp", "tp_dp")), default=None)
        print(f"{r['scenario']:30} {r['plan']:>14} {r['plan_ms']:10.1f} {r['uniform_mesh_blind_ms']:11.1f} "
              f"{r['speedup_vs_uniform_blind']:6.2f} {base or float('nan'):13.1f} "
              f"{(base / r['plan_ms']) if base else float('nan'):6.2f}")


if __name__ == "__main__":
    main()
