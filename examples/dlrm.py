"""Plan a DLRM-style recommendation model: embedding-bag tables of different sizes, a bottom
MLP for dense features, pairwise dot-product interaction and a top MLP.

    python examples/dlrm.py --cluster 8xA100-80GB --out dlrm-plan.json
    autopar plan examples.dlrm:build --cluster 8xH100 -o dlrm-plan.json   # the same through the CLI

Fixed-size embedding bags become a lookup and a sum (passes.embedding_bag), so every table
is a sparse parameter the planner places with the dense part in one ILP: dense all-reduce,
all-gather of the rows each device touched (Parallax), row-wise or column-wise sharding.
The inputs here are on the meta device, so access is assumed uniform; pass real ids as
example inputs, or ``sparsity={"embeddings.0.weight": 0.01}``, to plan for real skew.
`autopar show` lists each table's choice and bytes per step.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import autopar
from autopar.report import summary

TABLES = (1_000_000, 200_000, 50_000, 5_000)  # rows per table: a few large, some small


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class DLRM(nn.Module):
    def __init__(self, dense_features: int = 13, dim: int = 64, tables: tuple[int, ...] = TABLES) -> None:
        super().__init__()
        self.bottom = mlp([dense_features, 512, 256, dim])
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for rows in tables)
        pairs = (len(tables) + 1) * len(tables) // 2
        self.top = mlp([dim + pairs, 1024, 512, 256, 1])

    def forward(self, dense, sparse):  # dense (B, F) float; sparse (T, B, L) ids, L ids per bag
        x = self.bottom(dense)
        features = torch.stack([x] + [emb(ids) for emb, ids in zip(self.embeddings, sparse)], dim=1)
        scores = torch.bmm(features, features.transpose(1, 2))  # (B, T+1, T+1)
        i, j = torch.triu_indices(features.shape[1], features.shape[1], offset=1, device=x.device)
        return self.top(torch.cat([x, scores[:, i, j]], dim=1))


def build(batch: int = 2048, ids_per_bag: int = 8, device: str = "meta"):
    """Model and example inputs (dense features, ids per table); on the meta device by default."""
    with torch.device(device):
        model = DLRM()
        dense = torch.zeros(batch, 13)
        sparse = torch.zeros(len(TABLES), batch, ids_per_bag, dtype=torch.long)
    return model, (dense, sparse)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="8xH100")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--out", default="dlrm-plan.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model, inputs = build(batch=args.batch)
    plan = autopar.plan(model, inputs, cluster=args.cluster)
    plan.save(args.out)
    print(summary(plan))
    print(f"plan written to {args.out}")


if __name__ == "__main__":
    main()
