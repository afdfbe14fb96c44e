"""The weight gradients' share of a transformer block's training compute, measured on this
CPU against what the planner costs (issue 21: zero-bubble schedules defer the weight
gradients into the bubbles, so the share sets how much bubble they can fill).

For one block of examples/gpt.py at several sequence lengths, timed with autograd on CPU
(fp32, one thread, the median of a few repetitions):

  * F: the forward;
  * B: the input gradients alone (``torch.autograd.grad`` for the block's input only —
    autograd then skips every weight's gradient, as torch's pipelining ``stage_backward_input``
    does);
  * W: the full backward less B (what ``stage_backward_weight`` runs later).

measured share = W / (F + full backward); predicted = passes.weight_gradients on the captured
GPT (the FLOPs of the ops reading a weight over three times the FLOPs of the ops on the
gradient path), beside the flat third the planner used before.

    python benchmarks/weight_gradients.py     # writes benchmarks/results/weight_gradients.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "examples")]

from autopar.passes.capture import capture  # noqa: E402
from autopar.passes.cost import annotate_costs  # noqa: E402
from autopar.passes.weight_gradients import weight_gradient_flops, weight_gradient_share  # noqa: E402
from gpt import build  # noqa: E402

D, HEADS, BATCH = 256, 4, 4
SEQUENCES = (64, 256, 1024, 2048)
REPEATS = 7


def _median_s(run) -> float:
    run()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(seq: int) -> dict:
    model, (tokens,) = build(layers=1, d=D, heads=HEADS, seq=seq, batch=BATCH, vocab=512, device="cpu")
    block = model.blocks[0]
    x = torch.randn(BATCH, seq, D, requires_grad=True)
    grad_out = torch.randn(BATCH, seq, D)
    params = [p for p in block.parameters()]

    forward_s = _median_s(lambda: block(x))
    full_s = _median_s(lambda: torch.autograd.grad(block(x), [x, *params], grad_out)) - forward_s
    input_s = _median_s(lambda: torch.autograd.grad(block(x), [x], grad_out)) - forward_s
    weight_s = full_s - input_s

    captured = capture(model, (tokens,))
    annotate_costs(captured.graph)
    predicted = weight_gradient_share(weight_gradient_flops(captured), ["blocks.0"])
    return {"seq": seq, "forward_ms": forward_s * 1e3, "input_grad_ms": input_s * 1e3,
            "weight_grad_ms": weight_s * 1e3, "measured_share": weight_s / (forward_s + full_s),
            "predicted_share": predicted, "flat_third": 1 / 3}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for seq in SEQUENCES:
        row = measure(seq)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "weight_gradients.json"), "w") as f:
        json.dump({"d": D, "heads": HEADS, "batch": BATCH, "rows": rows}, f, indent=1)
    print(f"\n{'seq':>5} {'F ms':>8} {'B ms':>8} {'W ms':>8} {'measured':>9} {'predicted':>9} {'a third':>8}")
    for r in rows:
        print(f"{r['seq']:5d} {r['forward_ms']:8.2f} {r['input_grad_ms']:8.2f} {r['weight_grad_ms']:8.2f} "
              f"{r['measured_share']:9.3f} {r['predicted_share']:9.3f} {r['flat_third']:8.3f}")


if __name__ == "__main__":
    main()
