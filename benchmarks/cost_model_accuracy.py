"""Cost-model accuracy on this machine: predicted vs measured step time of several plans.

1. ``autopar profile`` measures this machine (or ``--cluster FILE`` gives a profile made before);
2. for each model, autopar's plan and the hand-written configurations (DDP, FSDP,
   Megatron-TP) are planned for 2 processes on that profile;
3. each plan is lowered in a 2-process gloo world and one training step (``pmodel.step``:
   forward, backward, gradient sync; no optimizer, which the model does not cost) is timed:
   median of 9 steps after 2 warm-up steps, on rank 0 between barriers.

Prints a table (predicted, measured, ratio), the Spearman rank correlation and the median
absolute relative error, and for each model whether autopar's plan measured fastest (or
within 10 % of the fastest); then DDP and FSDP plans measured with overlap off and on
(:func:`overlap_off_on`) and whether the model predicted the direction of the change.
Writes benchmarks/results/cost_model_accuracy.json, and one step of autopar's plan for the
GPT as a predicted trace (``autopar show --trace``) beside a torch.profiler trace of the same
step (:func:`save_traces`).

    python benchmarks/cost_model_accuracy.py [--cluster cpu.yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests")]

import torch  # noqa: E402
import yaml  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopar  # noqa: E402
from autopar.profile import write_profile  # noqa: E402
from distributed import run_world  # noqa: E402
import models  # noqa: E402

CONFIGURATIONS = (None, "ddp", "fsdp", "megatron_tp")


def build(name: str):
    """Model, inputs and target of one benchmark case (same on every rank)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp-1024":
        return models.MLP(1024, 4096, 1024, 2), (torch.randn(512, 1024, generator=g),), torch.randn(512, 1024, generator=g)
    if name == "gpt-2L-128":
        model = models.GPT(vocab=512, d=128, layers=2, heads=4, max_len=64)
        return model, (torch.randint(0, 512, (16, 64), generator=g),), torch.randint(0, 512, (16, 64), generator=g)
    if name == "block-256":
        return models.Block(256, 8), (torch.randn(16, 64, 256, generator=g),), torch.randn(16, 64, 256, generator=g)
    if name == "convnet":
        return models.ConvNet(), (torch.randn(256, 3, 16, 16, generator=g),), torch.randint(0, 10, (256,), generator=g)
    raise ValueError(name)


def loss_of(name: str):
    if name == "gpt-2L-128":
        return lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))
    if name == "convnet":
        return F.cross_entropy
    return F.mse_loss


def measure(name: str, plan_json: str, warmup: int = 2, steps: int = 9) -> float:
    """Median seconds of one pmodel.step in this world (runs on every rank; rank 0 reports)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # as `autopar profile` assumes
    model, inputs, target = build(name)
    pmodel = autopar.apply(model, autopar.Plan.from_json(plan_json), loss_fn=loss_of(name))
    times = []
    for k in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        pmodel.step(*inputs, target=target)
        dist.barrier()
        if k >= warmup:
            times.append(time.perf_counter() - start)
        for p in pmodel.parameters():
            p.grad = None
    return statistics.median(times)


def overlap_off_on(cluster: str) -> list[dict]:
    """DDP and FSDP plans with overlap off (the cost model sums every collective; the program
    waits for each collective where it issues it, DDP's gradients all-reduced in one bucket
    after backward) and on (the profile's overlap efficiency; 1 MiB DDP buckets all-reduced
    asynchronously as they fill; FSDP's gathers a layer ahead and its reduce-scatters during
    backward, all async): both measured. ``direction``: whether the model predicted the sign
    of the change (a change under 5 % of the step — this machine's step-to-step spread on
    gloo — counts as none, on either side)."""
    rows = []
    for name in ("mlp-1024", "gpt-2L-128", "block-256"):
        model, inputs, _ = build(name)
        for configuration in ("ddp", "fsdp"):
            try:
                off = autopar.plan(model, inputs, cluster=cluster, configuration=configuration, overlap=False,
                                   bucket_cap_mb=1e6)
                on = autopar.plan(model, inputs, cluster=cluster, configuration=configuration, bucket_cap_mb=1.0)
            except autopar.AutoparError as exc:
                print(f"{name} {configuration}: {exc.kind.value}", flush=True)
                continue
            measured = [run_world(2, measure, name, plan.to_json()) for plan in (off, on)]

            def sign(before: float, after: float) -> int:
                return 0 if abs(after - before) < 0.05 * before else (1 if after > before else -1)

            row = {"model": name, "plan": configuration, "predicted_off_ms": off.predicted_step_s * 1e3,
                   "predicted_on_ms": on.predicted_step_s * 1e3, "measured_off_ms": measured[0] * 1e3,
                   "measured_on_ms": measured[1] * 1e3,
                   "direction": "right" if sign(off.predicted_step_s, on.predicted_step_s) == sign(*measured)
                   else "wrong"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def profile_step(name: str, plan_json: str, path: str) -> None:
    """One pmodel.step under torch.profiler (after two warm-up steps); rank 0 writes its
    Chrome trace to ``path``, to open beside the predicted one (``autopar show --trace``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    model, inputs, target = build(name)
    pmodel = autopar.apply(model, autopar.Plan.from_json(plan_json), loss_fn=loss_of(name))
    for _ in range(2):
        pmodel.step(*inputs, target=target)
        pmodel.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pmodel.step(*inputs, target=target)
    if dist.get_rank() == 0:
        prof.export_chrome_trace(path)


def save_traces(cluster: str, name: str = "gpt-2L-128") -> dict:
    """The predicted and the measured trace of autopar's plan for ``name``, side by side in
    benchmarks/results/."""
    from autopar.trace import write_trace

    model, inputs, _ = build(name)
    plan = autopar.plan(model, inputs, cluster=cluster)
    paths = {kind: os.path.join(HERE, "results", f"trace_{name}_{kind}.json") for kind in ("predicted", "measured")}
    write_trace(plan, paths["predicted"])
    run_world(2, profile_step, name, plan.to_json(), paths["measured"])
    return paths


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for position, k in enumerate(order):
            r[k] = float(position)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", help="a profile written by `autopar profile` (default: profile now)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = args.cluster or os.path.join(tmp, "cpu.yaml")
        if not args.cluster:
            start = time.perf_counter()
            write_profile(cluster, world=2)
            print(f"profiled this machine in {time.perf_counter() - start:.1f} s", flush=True)
        with open(cluster) as f:
            profile = yaml.safe_load(f)
        print("profile:", json.dumps(profile["devices"]), flush=True)
        rows = []
        for name in ("mlp-1024", "gpt-2L-128", "block-256", "convnet"):
            model, inputs, _ = build(name)
            seen = {}
            for configuration in CONFIGURATIONS:
                try:
                    plan = autopar.plan(model, inputs, cluster=cluster, configuration=configuration)
                except autopar.AutoparError as exc:
                    print(f"{name} {configuration}: {exc.kind.value}", flush=True)
                    continue
                key = tuple(sorted((n, p.placement) for n, p in plan.parameters.items()))
                label = configuration or "autopar"
                if key in seen:  # same placements as another configuration: measured once
                    print(f"{name} {label}: same placements as {seen[key]}", flush=True)
                    continue
                seen[key] = label
                measured = run_world(2, measure, name, plan.to_json())
                row = {"model": name, "plan": label, "predicted_ms": plan.predicted_step_s * 1e3,
                       "measured_ms": measured * 1e3, "ratio": measured / plan.predicted_step_s}
                rows.append(row)
                print(json.dumps(row), flush=True)
        overlap_rows = overlap_off_on(cluster)
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        traces = save_traces(cluster)
    predicted = [r["predicted_ms"] for r in rows]
    measured = [r["measured_ms"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    verdicts = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        fastest = min(r["measured_ms"] for r in mine)
        ours = next((r["measured_ms"] for r in mine if r["plan"] == "autopar"), None)
        verdicts[name] = ours is not None and ours <= 1.10 * fastest
    summary = {"profile": profile, "rows": rows, "spearman": spearman(predicted, measured), "median_abs_rel_error": statistics.median(errors),
               "autopar_fastest_within_10pct": verdicts, "overlap_off_on": overlap_rows, "traces": traces}
    with open(os.path.join(HERE, "results", "cost_model_accuracy.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n{'model':12} {'plan':12} {'predicted ms':>13} {'measured ms':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['model']:12} {r['plan']:12} {r['predicted_ms']:13.2f} {r['measured_ms']:12.2f} {r['ratio']:7.2f}")
    print(f"\nSpearman {summary['spearman']:.3f}, median |error| {100 * summary['median_abs_rel_error']:.1f} %, "
          f"autopar's plan fastest or within 10 %: {verdicts}")
    print(f"\n{'model':12} {'plan':6} {'pred off':>9} {'pred on':>9} {'meas off':>9} {'meas on':>9}  direction")
    for r in overlap_rows:
        print(f"{r['model']:12} {r['plan']:6} {r['predicted_off_ms']:9.2f} {r['predicted_on_ms']:9.2f} "
              f"{r['measured_off_ms']:9.2f} {r['measured_on_ms']:9.2f}  {r['direction']}")
    print(f"\ntraces of one step, predicted and measured (open both in https://ui.perfetto.dev): {traces}")


if __name__ == "__main__":
    main()
