"""Model compatibility table: third-party models (tests/zoo.py, small random configs) —
aten nodes, planning time on 8xH100 and 2x8xH100, ops that fell back to replicated, and
equivalence of one training step at world size 2 (gloo) against the single-process model.

    pip install ".[zoo]" && python benchmarks/model_zoo.py

Results: a Markdown table on stdout and benchmarks/results/model_zoo.json. tests/test_zoo.py
checks the same small configs.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import autopar  # noqa: E402
import zoo  # noqa: E402
from distributed import run_world  # noqa: E402
from equivalence import run_cases  # noqa: E402


def _equivalent(errors: dict) -> bool:
    return ("missing_grad" not in errors and errors["output"] <= 5e-5 * max(1.0, errors["output_scale"])
            and errors["loss"] <= 1e-5 and errors["grad"] <= 1e-5)


def main() -> None:
    rows = []
    for name in zoo.MODELS:
        row = {"model": name}
        try:
            model, inputs = zoo.build(name)
            for cluster in ("8xH100", "2x8xH100"):
                start = time.perf_counter()
                plan = autopar.plan(model, inputs, cluster=cluster)
                row[f"plan_s_{cluster}"] = round(time.perf_counter() - start, 2)
                row[f"mesh_{cluster}"] = list(plan.mesh_shape)
            row["aten_nodes"] = len(plan.nodes)
            row["fallback_ops"] = sorted({n.op.removeprefix("aten.") for n in plan.nodes.values() if n.fallback})
        except autopar.AutoparError as exc:
            row["error"] = f"{exc.kind.value}: {exc.message.splitlines()[0][:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    planned = [r["model"] for r in rows if "error" not in r]
    cases = [(f"zoo:{name}", {}, "", 0, {"cluster": "2xH100", "memory_fraction": zoo.MEMORY_FRACTION.get(name, 0.6)},
              "float32", 1) for name in planned]
    try:
        results = run_world(2, run_cases, cases)
    except AssertionError as exc:  # a failing model fails the whole world: try them one by one
        print(f"world run failed ({str(exc)[:200]}); retrying one model at a time", flush=True)
        results = []
        for case in cases:
            try:
                results += run_world(2, run_cases, [case])
            except AssertionError as failure:
                results.append(None)
                reason = [line for line in str(failure).splitlines() if "Error:" in line]
                next(r for r in rows if r["model"] == case[0][4:])["failure"] = (reason or ["?"])[-1][:200]
    for name, errors in zip(planned, results):
        row = next(r for r in rows if r["model"] == name)
        row["equivalent"] = bool(errors) and _equivalent(errors)
        row["errors"] = {k: errors[k] for k in ("output", "loss", "grad")} if errors else None
    print("\n| model | aten nodes | plan s (8xH100) | plan s (2x8xH100) | fallback ops | equivalent (2 ranks) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | - | - | - | {r['error']} | ✗ |")
            continue
        verdict = "✓" if r.get("equivalent") else "✗ " + r.get("failure", "")
        print(f"| {r['model']} | {r['aten_nodes']} | {r['plan_s_8xH100']} | {r['plan_s_2x8xH100']} | "
              f"{', '.join(r['fallback_ops']) or 'none'} | {verdict} |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "model_zoo.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
