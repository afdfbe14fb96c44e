"""Sparse tables (issue 7): autopar's plan vs all-DDP, all-row-wise and a TorchRec-style
greedy table-wise placement, in predicted step time and bytes each device sends per step.

    python benchmarks/sparse.py            # ~1-2 min on 2 cores

Models (on the meta device; no weights allocated):
  * DLRM-like with the 8 largest and all 26 Criteo-Kaggle tables (dim 64, batch 2048 per
    device, 8 ids per bag), on "8xA100-80GB" and "4x8xA100-80GB", and the 26 tables on
    "8xL4" (24 GB: the tables' training state does not fit on one device); the 8 tables also
    fed as bags of varying size (1-D ids + offsets, 8 ids per bag on average: the batch split
    by bags, passes.bag_runtime);
  * a language model with an 800k × 1024 vocabulary (Parallax's LM1B shape: 20 tokens × 128
    sequences per device), a dense 2-layer MLP and a 1024-wide head.
Access densities come from a Zipf(1.05) sample of ids per device (what the example inputs
of a real data set give), passed as ``sparsity=``.

MoE: a Mixtral-shaped stack (8 experts, top-2) planned on "8xA100-80GB" — which of expert
parallelism, expert-internal tensor parallelism or replication the ILP picks, and its step
time against the baselines; and expert placement on skewed loads (max/mean tokens per device
with experts in their own order vs placed by ``solvers.balance.balanced_order``), the loads
measured from a real router on Zipf-distributed tokens or drawn log-normal; and the placement
a plan applies (a 64-expert MoE with a skewed router, as a ModuleList and as stacked weights:
the lowering puts each expert on the device of its slot in the balanced order — a ModuleList's
expert on that device, stacked weights' rows stored in that order).

Baselines: "ddp" and "row_wise" are the planner's own baselines (same cost model, the rest of
the graph optimised by the ILP); "torchrec_greedy" places every table whole on one device
(largest first, onto the device with the fewest bytes so far, as TorchRec's greedy
partitioner does for table-wise sharding) and is costed analytically here (the planner
itself chooses table-wise per table, with everything else): its step time is the DDP plan's
minus the tables' all-reduce, plus the all-to-alls of ids (forward) and pooled rows (forward
and backward) on the mesh's bottleneck link; its bytes are DDP's minus the tables' all-reduce
plus those all-to-alls.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..", "tests")]

import autopar  # noqa: E402
from autopar.cluster import Cluster  # noqa: E402
from autopar.comm import all_reduce_s, all_to_all_s  # noqa: E402
from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.sparse import annotate_lookups  # noqa: E402
from autopar.planning.costing import communication_bytes  # noqa: E402
from autopar.solvers.balance import balanced_order, device_loads, imbalance  # noqa: E402
from autopar.passes.experts import annotate_experts  # noqa: E402
from dlrm import DLRM  # noqa: E402
from models import MoEGPT  # noqa: E402

CRITEO_KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


class LanguageModel(nn.Module):
    """Token embedding, a dense MLP block and a projection: one very large sparse table."""

    def __init__(self, vocab: int = 800_000, dim: int = 1024) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, dim)

    def forward(self, tokens):
        x = self.embedding(tokens)
        return self.head(x + self.mlp(x))


def zipf_density(rows: int, draws: int, exponent: float = 1.05, seed: int = 0) -> float:
    """Fraction of ``rows`` one device touches with ``draws`` Zipf-distributed ids."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, min(rows, 2_000_000) + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    ids = torch.multinomial(probs / probs.sum(), draws, replacement=True, generator=g)
    return max(ids.unique().numel() / rows, 1 / rows)


def dlrm_case(tables: tuple[int, ...], devices: int, per_device: int = 2048, bag: int = 8):
    batch = per_device * devices
    with torch.device("meta"):
        model = DLRM(dim=64, tables=tables)
        inputs = (torch.zeros(batch, 13), torch.zeros(len(tables), batch, bag, dtype=torch.long))
    sparsity = {f"embeddings.{i}.weight": zipf_density(rows, per_device * bag, seed=i) for i, rows in enumerate(tables)}
    return model, inputs, sparsity


class JaggedDLRM(nn.Module):
    """The DLRM of examples/dlrm.py fed as TorchRec and DLRM's data loaders feed it: each
    table's ids flat (1-D) with offsets marking bags of varying size, ``bag(ids, offsets)``."""

    def __init__(self, tables: tuple[int, ...], dim: int = 64, dense: int = 13) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 512), nn.ReLU(), nn.Linear(512, dim))
        self.embeddings = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for rows in tables])
        pairs = (len(tables) + 1) * len(tables) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, dense, *ids_and_offsets):
        x = self.bottom(dense)
        pooled = [bag(ids_and_offsets[2 * t], ids_and_offsets[2 * t + 1]) for t, bag in enumerate(self.embeddings)]
        features = torch.stack([x] + pooled, dim=1)
        scores = torch.bmm(features, features.transpose(1, 2))
        i, j = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, scores[:, i, j]], dim=1))


def jagged_dlrm_case(tables: tuple[int, ...], devices: int, per_device: int = 2048, bag: int = 8):
    """Bags of varying size, ``bag`` ids each on average (on the meta device: the plan sees
    the id count per table, the densities come from ``sparsity=`` as for the fixed bags)."""
    batch = per_device * devices
    with torch.device("meta"):
        model = JaggedDLRM(tables)
        inputs = [torch.zeros(batch, 13)]
        for _ in tables:
            inputs += [torch.zeros(batch * bag, dtype=torch.long), torch.zeros(batch, dtype=torch.long)]
    sparsity = {f"embeddings.{i}.weight": zipf_density(rows, per_device * bag, seed=i) for i, rows in enumerate(tables)}
    return model, tuple(inputs), sparsity


def lm_case(devices: int, per_device: int = 128, seq: int = 20):
    with torch.device("meta"):
        model = LanguageModel()
        inputs = (torch.zeros(per_device * devices, seq, dtype=torch.long),)
    return model, inputs, {"embedding.weight": zipf_density(800_000, per_device * seq)}


def greedy_table_wise(plan, cluster: Cluster, ddp_s: float, ddp_bytes: float, bag: int) -> tuple[float, float]:
    """TorchRec-style table-wise placement costed against the DDP plan (module docstring)."""
    n = cluster.num_devices
    link = cluster.group_link(range(n))
    load = [0] * n
    owner = {}
    for fqn, table in sorted(plan.sparse.items(), key=lambda kv: -kv[1]["rows"] * kv[1]["row_bytes"]):
        device = min(range(n), key=load.__getitem__)
        owner[fqn] = device
        load[device] += table["rows"] * table["row_bytes"]
    time_s, sent = ddp_s, ddp_bytes
    for fqn, table in plan.sparse.items():
        w = table["rows"] * table["row_bytes"]
        ids = table["lookups"] * 8  # whole batch's ids of this table
        pooled = table["lookups"] // bag * table["row_bytes"]  # one row per bag after pooling
        time_s -= all_reduce_s(w, n, link)
        sent -= table["bytes_per_step"]["allreduce"]
        # ids to the owner, pooled rows back, their gradients to the owner again
        for volume in (ids, pooled, pooled):
            time_s += all_to_all_s(volume, n, link)
            sent += volume * (n - 1) / n / n
    return time_s, sent


def run_case(name: str, model, inputs, sparsity, bag: int, cluster_spec: str) -> dict:
    cluster = Cluster.from_spec(cluster_spec)
    captured = capture(model, inputs)
    annotate_lookups(captured, inputs, sparsity)
    start = time.perf_counter()
    plan = autopar.plan(model, inputs, cluster=cluster_spec, sparsity=sparsity, pipeline=False, replicas=False)
    plan_s = time.perf_counter() - start
    row = {"case": name, "cluster": cluster_spec, "mesh": list(plan.mesh_shape), "plan_s": round(plan_s, 1),
           "plan_ms": plan.predicted_step_s * 1e3, "plan_bytes": communication_bytes(captured, plan, cluster),
           "plan_memory_gb": plan.memory.total_bytes / 1e9,  # the busiest device's
           "exchanges": _count(plan)}
    for baseline in ("ddp", "row_wise"):
        try:
            other = autopar.plan(model, inputs, cluster=cluster_spec, sparsity=sparsity, configuration=baseline,
                                 mesh_shape=(cluster.num_devices,))
            row[f"{baseline}_ms"] = other.predicted_step_s * 1e3
            row[f"{baseline}_bytes"] = communication_bytes(captured, other, cluster)
            if baseline == "ddp":
                ddp = other
        except autopar.AutoparError as exc:
            row[f"{baseline}_ms"] = row[f"{baseline}_bytes"] = None
            row[f"{baseline}_error"] = str(exc).splitlines()[0][:400]
    if row.get("ddp_ms") is not None:
        greedy_s, greedy_bytes = greedy_table_wise(ddp, cluster, ddp.predicted_step_s, row["ddp_bytes"], bag)
        row["torchrec_greedy_ms"], row["torchrec_greedy_bytes"] = greedy_s * 1e3, greedy_bytes
    return row


def _count(plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fqn in plan.sparse:
        counts[plan.parameters[fqn].exchange] = counts.get(plan.parameters[fqn].exchange, 0) + 1
    return counts


def moe_plan(cluster: str = "8xA100-80GB", module_list: bool = False) -> dict:
    """A Mixtral-shaped MoE stack (hidden 1024, 8 experts of 4096, top-2), 8 x 2048 tokens;
    ``module_list``: the same experts as one module each (batched at capture)."""
    with torch.device("meta"):
        model = MoEGPT(vocab=32000, d=1024, layers=4, experts=8, hidden=4096, groups=8, module_list=module_list)
        tokens = (torch.zeros(8, 2048, dtype=torch.long),)
    start = time.perf_counter()
    plan = autopar.plan(model, tokens, cluster=cluster, pipeline=False, replicas=False)
    layer = plan.experts["blocks.0.moe.expert" if module_list else "blocks.0.moe"]
    feasible = {k: v["predicted_step_s"] * 1e3 for k, v in plan.baselines.items() if v["feasible"]}
    return {"case": "moe-mixtral-shaped" + ("-module-list" if module_list else ""), "cluster": cluster,
            "mesh": list(plan.mesh_shape),
            "plan_s": round(time.perf_counter() - start, 1), "plan_ms": plan.predicted_step_s * 1e3,
            "expert_placement": layer["placement"], "expert_exchange": layer["exchange"],
            "baselines_ms": feasible}


def moe_placed(cluster: str = "8xA100-80GB", skew: float = 1.0, module_list: bool = True) -> list[dict]:
    """The plan's own expert placement on a skewed router: an MoE (64 experts, real weights —
    the relabelling is checked on them) whose router bias falls over the experts,
    Zipf-distributed tokens; per layer, max/mean tokens per device with the experts in the
    model's order and as the plan places them (``order_applied``: lowering uses that order).
    ``module_list``: one module per expert, else stacked (E, ...) weights."""
    torch.manual_seed(0)
    model = MoEGPT(vocab=4096, d=256, layers=2, experts=64, hidden=1024, groups=4, module_list=module_list,
                   skew=skew)
    start = time.perf_counter()
    plan = autopar.plan(model, (_zipf_tokens(),), cluster=cluster, pipeline=False, replicas=False)
    plan_s = round(time.perf_counter() - start, 1)
    form = "module-list" if module_list else "stacked"
    return [{"case": f"moe-{form}-64-experts-skew-{skew}", "cluster": cluster, "layer": module,
             "mesh": list(plan.mesh_shape), "expert_devices": layer["expert_devices"],
             "exchange": layer["exchange"], "hottest_expert_share": max(layer["load"]) / sum(layer["load"]),
             "in_order": layer["imbalance_in_order"], "placed": layer["imbalance"],
             # no order does better than the hottest expert alone on a device
             "bound": max(1.0, layer["expert_devices"] * max(layer["load"]) / sum(layer["load"])),
             "order_applied": layer["order_applied"], "plan_s": plan_s} for module, layer in plan.experts.items()]


def _zipf_tokens(seed: int = 0) -> torch.Tensor:
    """16 sequences of 256 tokens of a 4096-word vocabulary, Zipf(1.05)-distributed."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, 4097, dtype=torch.float64)
    return torch.multinomial(ranks.pow(-1.05), 16 * 256, replacement=True, generator=g).reshape(16, 256)


def router_load(experts: int = 64, seed: int = 0) -> tuple[int, ...]:
    """Tokens per expert from a real (randomly initialised) router on Zipf-distributed tokens."""
    torch.manual_seed(seed)
    model = MoEGPT(vocab=4096, d=64, layers=1, experts=experts, hidden=64, groups=4)
    tokens = _zipf_tokens(seed)
    (group,) = annotate_experts(capture(model, (tokens,)), (tokens,))
    return group.load


def load_balance() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    profiles = [("router on zipf tokens, 64 experts", router_load(64), 8)]
    for sigma, experts, devices in ((0.5, 64, 8), (1.0, 64, 8), (1.0, 256, 32)):
        load = torch.empty(experts).log_normal_(0, sigma, generator=g).mul(1000).round().int().tolist()
        profiles.append((f"log-normal σ={sigma}, {experts} experts", tuple(load), devices))
    rows = []
    for name, load, devices in profiles:
        start = time.perf_counter()
        order = balanced_order(load, devices)
        rows.append({"profile": name, "devices": devices, "hottest_expert_share": max(load) / sum(load),
                     # no placement beats the device that holds the hottest expert
                     "bound": max(1.0, devices * max(load) / sum(load)),
                     "in_order": imbalance(device_loads(load, list(range(len(load))), devices)),
                     "placed": imbalance(device_loads(load, order, devices)),
                     "place_s": round(time.perf_counter() - start, 2)})
    return rows


def main() -> None:
    rows = []
    cases = []
    for cluster in ("8xA100-80GB", "4x8xA100-80GB"):
        devices = Cluster.from_spec(cluster).num_devices
        top8 = tuple(sorted(CRITEO_KAGGLE, reverse=True)[:8])
        cases += [("dlrm-8-tables", *dlrm_case(top8, devices), 8, cluster),
                  ("dlrm-8-tables-jagged", *jagged_dlrm_case(top8, devices), 8, cluster),
                  ("dlrm-26-tables", *dlrm_case(CRITEO_KAGGLE, devices), 8, cluster),
                  ("lm-800k-vocab", *lm_case(devices), 1, cluster)]
    # memory-bound: 26 tables × (weights, gradients, two AdamW states) = 34.6 GB, more than an L4's
    # 24 GB — neither DDP nor every table whole on every device fits; spread over owners they do
    cases.append(("dlrm-26-tables", *dlrm_case(CRITEO_KAGGLE, 8), 8, "8xL4"))
    for name, model, inputs, sparsity, bag, cluster in cases:
        row = run_case(name, model, inputs, sparsity, bag, cluster)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| case | cluster | mesh | tables' exchange | plan ms | ddp ms | row-wise ms | greedy ms "
          "| plan MB | ddp MB | row-wise MB | greedy MB | ddp/plan bytes |")
    print("|" + "---|" * 13)
    for r in rows:
        def ms(k):
            return f"{r[k]:.2f}" if r.get(k) is not None else "infeasible"

        def mb(k):
            return f"{r[k] / 1e6:.1f}" if r.get(k) is not None else "-"
        ratio = f"{r['ddp_bytes'] / r['plan_bytes']:.1f}×" if r.get("ddp_bytes") and r["plan_bytes"] else "-"
        exchanges = ", ".join(f"{k} {v}" for k, v in sorted(r["exchanges"].items()))
        print(f"| {r['case']} | {r['cluster']} | {r['mesh']} | {exchanges} | {ms('plan_ms')} | {ms('ddp_ms')} | "
              f"{ms('row_wise_ms')} | {ms('torchrec_greedy_ms')} | {mb('plan_bytes')} | {mb('ddp_bytes')} | "
              f"{mb('row_wise_bytes')} | {mb('torchrec_greedy_bytes')} | {ratio} |")
    moe = [moe_plan(), moe_plan(module_list=True)]
    print("\n" + "\n".join(json.dumps(m) for m in moe))
    balance = load_balance()
    print("\n| expert load profile | devices | hottest expert's share | max/mean in order | max/mean placed "
          "| lower bound |")
    print("|---|---|---|---|---|---|")
    for r in balance:
        print(f"| {r['profile']} | {r['devices']} | {100 * r['hottest_expert_share']:.1f}% | {r['in_order']:.2f} | "
              f"{r['placed']:.2f} | {r['bound']:.2f} |")
    placed = moe_placed() + moe_placed(module_list=False)
    print("\n| planned MoE (experts placed by the plan) | layer | expert devices | hottest expert's share "
          "| max/mean in order | max/mean as planned | lower bound | order applied |")
    print("|---|---|---|---|---|---|---|---|")
    for r in placed:
        print(f"| {r['case']} on {r['cluster']} | {r['layer']} | {r['expert_devices']} | "
              f"{100 * r['hottest_expert_share']:.1f}% | {r['in_order']:.2f} | {r['placed']:.2f} | "
              f"{r['bound']:.2f} | {r['order_applied']} |")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "sparse.json"), "w") as f:
        json.dump({"sparse": rows, "moe": moe, "load_balance": balance, "moe_placed": placed}, f, indent=1)


if __name__ == "__main__":
    main()
