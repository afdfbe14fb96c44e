"""Plan quality: predicted step time of autopar's plan vs the best feasible hand-written
baseline (DDP, FSDP, Megatron-TP), each costed by the same model. Ratio ≤ 1.00 everywhere is
the floor (the baselines are points of the solver's search space).

    python benchmarks/plan_quality.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..", "tests")]

import autopar  # noqa: E402
from cnn import build as build_cnn  # noqa: E402
from dlrm import build as build_dlrm  # noqa: E402
from gpt import build  # noqa: E402
from models import MLP, Block, ConvNet  # noqa: E402


def models() -> list:
    with torch.device("meta"):  # no weights allocated; the context ends before planning
        return [("gpt-4L-512", *build(layers=4, d=512, batch=16)),
                ("block-4096-tp", Block(4096, 32), (torch.randn(2, 64, 4096),)),
                ("mlp-1024-dp", MLP(1024, 4096, 1024, 2), (torch.randn(4096, 1024),)),
                ("convnet", ConvNet(), (torch.randn(256, 3, 16, 16),)),
                ("resnet-64x224", *build_cnn(batch=64)),
                ("dlrm-2048", *build_dlrm(batch=2048))]


def main() -> None:
    rows = []
    for name, model, inputs in models():
        for cluster in ("8xH100", "2x8xH100"):
            plan = autopar.plan(model, inputs, cluster=cluster)
            feasible = {k: v["predicted_step_s"] for k, v in plan.baselines.items() if v["feasible"]}
            best = min(feasible, key=feasible.get) if feasible else None
            row = {"model": name, "cluster": cluster, "mesh": list(plan.mesh_shape),
                   "plan_ms": plan.predicted_step_s * 1e3,
                   **{f"{k}_ms": (v * 1e3 if v else None) for k, v in
                      ((k, plan.baselines[k]["predicted_step_s"]) for k in ("ddp", "fsdp", "megatron_tp", "tp_dp"))},
                   "best_baseline": best,
                   "ratio_vs_best": plan.predicted_step_s / feasible[best] if best else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| model | cluster | mesh | plan ms | ddp ms | fsdp ms | megatron ms | tp×dp ms | best baseline | plan/best |")
    for r in rows:
        cells = [r["model"], r["cluster"], r["mesh"]] + [
            f"{r[k]:.4g}" if r[k] is not None else "infeasible" for k in ("plan_ms", "ddp_ms", "fsdp_ms", "megatron_tp_ms", "tp_dp_ms")]
        cells += [r["best_baseline"], f"{r['ratio_vs_best']:.3f}" if r["ratio_vs_best"] else "-"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "plan_quality.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
