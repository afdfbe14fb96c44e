"""LLM training as practitioners run it, planned by autopar next to torchtitan's published runs.

    python benchmarks/llm_configs.py            # every configuration, a markdown table
    python benchmarks/llm_configs.py --only 8b-8xh100-96gb

Models are Hugging Face Llama shapes on the meta device (no weights), bf16 mixed precision
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), AdamW, fused attention.
For each configuration: autopar's own plan, and the hand-written FSDP configuration costed
by the same model (``configuration="fsdp"``), which is what torchtitan runs. Columns:
feasible, mesh, a placement summary, recomputation (selective or whole layers, chosen when
nothing fits without), predicted
memory per device, tokens/s per GPU and MFU, planning seconds; then torchtitan's published
figure for the same setup where one exists (docs/performance.md of torchtitan; the 8 × H100
96 GB run is FSDP + bf16 + selective activation checkpointing, the others differ as noted).
Results also go to benchmarks/results/llm_configs.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import zoo  # noqa: E402,F401  (declares the torchvision ops transformers' import needs)

import autopar  # noqa: E402
from autopar.report import recompute_label, throughput  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, ffn, vocab
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": (8192, 80, 64, 8, 28672, 128256),
}
# name: shape, cluster, memory limit (bytes per device; None: the catalog's), sequences, tokens
# per sequence, published figure
CONFIGS = {
    "8b-8xh100-96gb": ("llama3-8b", "8xH100", 96e9, 16, 8192,
                       "torchtitan: 5,762 tokens/s/GPU at 82.4 GiB (FSDP, bf16, selective AC, local batch 2)"),
    "8b-8x8xh100": ("llama3-8b", "8x8xH100", None, 64, 4096,
                    "none for H100 (torchtitan: 58.2% MFU on 64 A100-80GB, local batch 1, selective-op AC)"),
    "70b-8x8xh100": ("llama3-70b", "8x8xH100", None, 64, 4096,
                     "none for this setup (torchtitan trains 70B on 64 A100 with full AC)"),
}


class CausalLM(torch.nn.Module):
    """A transformers LlamaForCausalLM returning its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def build(shape: str) -> torch.nn.Module:
    import transformers

    hidden, layers, heads, kv, ffn, vocab = SHAPES[shape]
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                                      max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        return CausalLM(transformers.LlamaForCausalLM(config))


def summary(plan) -> str:
    """The three commonest placements; a ZeRO-2 parameter as ``use / optimizer states``."""
    counts = collections.Counter(f"{p.placement} / {p.optimizer_state}" if p.zero else p.placement
                                 for p in plan.parameters.values())
    return ", ".join(f"{k}×{v}" for k, v in counts.most_common(3))


def run(name: str) -> list[dict]:
    shape, cluster, limit, sequences, tokens, published = CONFIGS[name]
    model = build(shape)
    ids = torch.zeros(sequences, tokens, dtype=torch.long, device="meta")
    rows = []
    for label, extra in (("autopar", {}), ("fsdp (hand-written)", {"configuration": "fsdp"})):
        start = time.perf_counter()
        row = {"config": name, "plan": label, "cluster": cluster, "batch": f"{sequences}×{tokens}",
               "published": published if label == "autopar" else ""}
        try:
            plan = autopar.plan(model, (ids,), cluster=cluster, memory_limit=limit, mixed_precision="bf16",
                                time_limit_s=120, **extra)
            rates = throughput(plan)
            row.update(feasible=True, mesh=list(plan.mesh_shape), placements=summary(plan),
                       recompute=recompute_label(plan),
                       memory_gib=round(plan.memory.total_bytes / 2 ** 30, 2),
                       tokens_per_s_per_gpu=round(rates["tokens_per_s_per_device"] or 0),
                       mfu=round(100 * rates["predicted_mfu"], 1), step_s=round(plan.predicted_step_s, 3))
        except autopar.AutoparError as exc:
            row.update(feasible=False, reason=exc.message[:160])
        row["plan_s"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS))
    args = parser.parse_args()
    rows = [row for name in ([args.only] if args.only else CONFIGS) for row in run(name)]
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "llm_configs.json"), "w") as f:
        json.dump(rows, f, indent=1)
    columns = ["config", "plan", "feasible", "mesh", "placements", "recompute", "memory_gib",
               "tokens_per_s_per_gpu", "mfu", "plan_s", "published"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [str(row.get(c, "-")) for c in columns]
        if not row["feasible"]:
            cells[columns.index("placements")] = row["reason"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
