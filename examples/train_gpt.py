"""Train a small GPT with an autopar plan under torchrun (gloo on CPU, NCCL on GPUs).

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 300
    torchrun --nproc-per-node 4 examples/train_gpt.py --plan plan.json   # a plan saved earlier
    torchrun --nproc-per-node 4 examples/train_gpt.py --cluster tests/clusters/four_cpu_regions.yaml
                                                          # two regions: pipeline stages if faster

The data is a synthetic language (each sequence counts up from a random start modulo the
vocabulary), so the loss falls fast and visibly. Without --plan, rank 0 plans for the
current world (one `cpu` device per rank, the GPUs the ranks run on, or --cluster) and
broadcasts the plan. The loop is the same for every plan: ``pmodel.step`` runs forward and
backward (over micro-batches when the plan has pipeline stages) and returns the loss on every
rank; the batches are made on the CPU and ``pmodel`` moves them to the rank's device.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import autopar  # noqa: E402
from gpt import build  # noqa: E402


def batch(step: int, size: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same batch on every rank (seeded by step): autopar takes full inputs on each rank."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab  # (B, T+1)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plan", help="plan JSON made by autopar.plan(...).save() for this world size")
    parser.add_argument("--cluster", help="cluster spec or YAML file with one device per rank (default: Nxcpu)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    if torch.cuda.is_available():  # one GPU per rank: torchrun's LOCAL_RANK picks it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model, _ = build(layers=2, d=64, heads=4, vocab=args.vocab, seq=args.seq, batch=args.batch, device="cpu")
    example, _ = batch(0, args.batch, args.seq, args.vocab)
    def loss_fn(logits, target):  # (B, T, V), (B, T)
        return F.cross_entropy(logits.reshape(-1, args.vocab), target.reshape(-1))

    if args.plan:
        pmodel = autopar.apply(model, autopar.load_plan(args.plan), loss_fn=loss_fn)
    else:
        pmodel = autopar.parallelize(model, (example,), cluster=args.cluster, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    rank = dist.get_rank()
    for step in range(args.steps):
        x, y = batch(step, args.batch, args.seq, args.vocab)
        loss = pmodel.step(x, target=y)  # the same on every rank
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
