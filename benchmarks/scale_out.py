"""Scale-out planning next to the largest published runs (issue 21).

    python benchmarks/scale_out.py                 # every scenario, a markdown table
    python benchmarks/scale_out.py --only 8b-128k

Llama shapes on the meta device, bf16 mixed precision, AdamW, fused attention, one cost
model for every row. Per scenario: autopar's plan (mesh and what each dim does, pipeline
stages / schedule / micro-batches, recomputation), and the hand-written configuration
torchtitan publishes for it, pinned through ``configuration=`` and costed by the same model
(with full activation checkpointing where torchtitan uses it). Columns: predicted memory per
device, tokens/s per GPU, MFU, planning seconds, and torchtitan's published figure. Results
also go to benchmarks/results/scale_out.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from llm_configs import SHAPES, build, summary  # noqa: E402

import autopar  # noqa: E402
from autopar.report import mesh_dim_roles, recompute_label, throughput  # noqa: E402

SHAPES.setdefault("llama3.1-405b", (16384, 126, 128, 8, 53248, 128256))

# name: shape, cluster, sequences, tokens each, the hand-written configuration torchtitan
# runs (configuration, recompute), published figure
SCENARIOS = {
    "70b-8x8xh100": ("llama3-70b", "8x8xH100", 64, 8192, ("fsdp", "full"),
                     "torchtitan trains 70B on 64 A100 with FSDP and full AC (no H100 figure)"),
    "405b-16x8xh100": ("llama3.1-405b", "16x8xH100", 32, 8192, ("fsdp_tp", "full"),
                       "torchtitan: 128 H100, FSDP 16 × TP 8, local batch 2 × 8192, full AC: 29% MFU (bf16)"),
    "405b-64x8xh100": ("llama3.1-405b", "64x8xH100", 128, 8192, ("fsdp_tp", "full"),
                       "torchtitan scales 405B to 512 GPUs with PP × FSDP × TP × CP (figure not comparable)"),
    "8b-128k": ("llama3-8b", "8x8xH100", 1, 131072, ("context_parallel", "full"),
                "one 128k-token sequence: context parallelism (torchtitan's CP runs are 8B at 128k-1M tokens)"),
}


def _row(plan, start: float) -> dict:
    rates = throughput(plan)
    return {
        "feasible": True, "mesh": list(plan.mesh_shape), "roles": mesh_dim_roles(plan),
        "stages": len(plan.stages), "schedule": plan.schedule, "micro_batches": plan.micro_batches,
        "virtual_stages": plan.virtual_stages,
        "recompute": recompute_label(plan),
        "placements": summary(plan),
        "memory_gib": round(plan.memory.total_bytes / 2 ** 30, 2),
        "tokens_per_s_per_gpu": round(rates["tokens_per_s_per_device"] or 0),
        "mfu": round(100 * rates["predicted_mfu"], 1), "step_s": round(plan.predicted_step_s, 3),
        "plan_s": round(time.perf_counter() - start, 1),
    }


def run(name: str) -> list[dict]:
    shape, cluster, sequences, tokens, (configuration, recompute), published = SCENARIOS[name]
    model = build(shape)
    ids = torch.zeros(sequences, tokens, dtype=torch.long, device="meta")
    rows = []
    for label, extra in (("autopar", {}),
                         (f"{configuration} + {recompute} AC (hand-written)",
                          {"configuration": configuration, "recompute": recompute})):
        start = time.perf_counter()
        row = {"scenario": name, "plan": label, "cluster": cluster, "batch": f"{sequences}×{tokens}",
               "published": published if label == "autopar" else ""}
        try:
            plan = autopar.plan(model, (ids,), cluster=cluster, mixed_precision="bf16", time_limit_s=120, **extra)
            row.update(_row(plan, start))
        except autopar.AutoparError as exc:
            row.update(feasible=False, reason=exc.message[:200], plan_s=round(time.perf_counter() - start, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    mine, theirs = rows
    if mine["feasible"] and theirs["feasible"]:
        mine["vs_hand_written"] = round(mine["step_s"] / theirs["step_s"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SCENARIOS))
    args = parser.parse_args()
    rows = [row for name in ([args.only] if args.only else SCENARIOS) for row in run(name)]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "scale_out.json"), "w") as f:
        json.dump(rows, f, indent=1)
    columns = ["scenario", "plan", "feasible", "mesh", "roles", "stages", "schedule", "micro_batches",
               "recompute", "memory_gib", "tokens_per_s_per_gpu", "mfu", "vs_hand_written", "plan_s", "published"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [str(row.get(c, "-")) for c in columns]
        if not row["feasible"]:
            cells[columns.index("roles")] = row["reason"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
