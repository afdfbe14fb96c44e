"""Plan a GPT for a built-in cluster profile and print the plan (no GPU, no weights allocated).

    python examples/gpt.py --cluster 2x8xH100 --layers 12 --out gpt-plan.json
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.report import summary


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(layers: int = 4, d: int = 512, heads: int = 8, vocab: int = 8192, seq: int = 256, batch: int = 16,
          device: str = "meta"):
    """Model and example token ids; on the meta device by default (planning allocates nothing)."""
    with torch.device(device):
        model = GPT(vocab, d, layers, heads, seq)
        tokens = torch.zeros(batch, seq, dtype=torch.long)
    return model, (tokens,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="2x4xH100", help="e.g. 8xH100, 2x8xA100-80GB, 4xcpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="gpt-plan.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model, inputs = build(layers=args.layers, d=args.hidden, batch=args.batch)
    plan = autopar.plan(model, inputs, cluster=args.cluster)
    plan.save(args.out)
    print(summary(plan))
    print(f"plan written to {args.out}")


if __name__ == "__main__":
    main()
