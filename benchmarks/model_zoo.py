"""Model compatibility table: third-party models (tests/zoo.py, small random configs) —
whether it is built with its default config, aten nodes, planning time on 8xH100 and 2x8xH100, ops that fell back to replicated, and
equivalence of one training step at world sizes 2 and 4 (gloo) against the single-process model.

    pip install ".[zoo]" && python benchmarks/model_zoo.py
    python benchmarks/model_zoo.py deepseek_v3 gpt_oss    # some entries only

Results: a Markdown table on stdout and benchmarks/results/model_zoo.json (model_zoo-<names>.json
for some entries). tests/test_zoo.py
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


WORLDS = (2, 4)  # world sizes of the equivalence runs (memory limits: zoo.equivalence_case)


def _check_equivalence(rows: list[dict], planned: list[str], world: int) -> None:
    """One training step of every planned model on ``world`` gloo ranks against one process;
    records ``equivalent_<world>`` and ``errors_<world>`` (and ``failure_<world>``) in ``rows``."""
    cases = [zoo.equivalence_case(name, world) for name in planned]
    try:
        results = run_world(world, run_cases, cases)
    except AssertionError as exc:  # a failing model fails the whole world: try them one by one
        print(f"world run failed ({str(exc)[:200]}); retrying one model at a time", flush=True)
        results = []
        for case in cases:
            try:
                results += run_world(world, run_cases, [case])
            except AssertionError as failure:
                results.append(None)
                reason = [line for line in str(failure).splitlines() if "Error:" in line]
                next(r for r in rows if r["model"] == case[0][4:])[f"failure_{world}"] = (reason or ["?"])[-1][:200]
    for name, errors in zip(planned, results):
        row = next(r for r in rows if r["model"] == name)
        row[f"equivalent_{world}"] = bool(errors) and _equivalent(errors)
        row[f"errors_{world}"] = {k: errors[k] for k in ("output", "loss", "grad")} if errors else None
        print(json.dumps({"model": name, "world": world, "equivalent": row[f"equivalent_{world}"],
                          "errors": row[f"errors_{world}"]}), flush=True)


def main() -> None:
    names = sys.argv[1:] or list(zoo.MODELS)
    unknown = sorted(set(names) - set(zoo.MODELS))
    if unknown:
        raise SystemExit(f"not in the zoo: {', '.join(unknown)} (entries: {', '.join(zoo.MODELS)})")
    rows = []
    for name in names:
        row = {"model": name, "default_config": name not in zoo.NOT_DEFAULT}
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
    for world in WORLDS:
        _check_equivalence(rows, planned, world)
    columns = " | ".join(f"equivalent ({world} ranks)" for world in WORLDS)
    print(f"\n| model | default config | aten nodes | plan s (8xH100) | plan s (2x8xH100) | fallback ops | {columns} |")
    print("|---|---|---|---|---|---|" + "---|" * len(WORLDS))
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | - | - | - | - | {r['error']} |" + " ✗ |" * len(WORLDS))
            continue
        verdicts = " | ".join("✓" if r.get(f"equivalent_{w}") else "✗ " + r.get(f"failure_{w}", "") for w in WORLDS)
        default = "✓" if r["default_config"] else f"✗ {zoo.NOT_DEFAULT[r['model']]}"
        print(f"| {r['model']} | {default} | {r['aten_nodes']} | {r['plan_s_8xH100']} | {r['plan_s_2x8xH100']} | "
              f"{', '.join(r['fallback_ops']) or 'none'} | {verdicts} |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    suffix = "" if names == list(zoo.MODELS) else "-" + "-".join(names)
    with open(os.path.join(HERE, "results", f"model_zoo{suffix}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
