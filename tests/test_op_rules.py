"""The DTensor rules autopar registers for its own ops — ``autopar::expert_mm`` (grouped-GEMM
experts per row) with its weight gradient, ``autopar::pool_rows`` (jagged bags) with its
backward: each rule, on 2 gloo ranks, gives the single-process result and gradients, and
DTensor takes the rule as written (the output's placement is the rule's, no resharding)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.expert_mm import EXPERT_MM
from distributed import run_world

# (inputs' placements, the output's): rows split, output features split, input features split, replicated
EXPERT_MM_RULES = [(("S(0)", "R", "S(0)"), "S(0)"), (("R", "S(2)", "R"), "S(1)"), (("S(1)", "S(1)", "R"), "P"),
                   (("R", "R", "R"), "R")]
# rows split (partial bags), columns split, replicated
POOL_RULES = [(("S(0)", "S(0)"), "P"), (("S(1)", "R"), "S(1)"), (("R", "R"), "R")]


def _placement(text: str):
    return Replicate() if text == "R" else Shard(int(text[2:-1]))


def _short(placement) -> str:
    return "R" if placement.is_replicate() else "P" if placement.is_partial() else f"S({placement.dim})"


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _run(op, mesh, values: list, rule: tuple, upstream: torch.Tensor) -> tuple[list, str]:
    """``op`` on the values placed by ``rule`` (floating ones requiring grad): the full output,
    the full gradients of the floating inputs, and the output's placement."""
    placed = [distribute_tensor(v, mesh, [_placement(p)]) for v, p in zip(values, rule)]
    for v in placed:
        if v.dtype.is_floating_point:
            v.requires_grad_()
    out = op(*placed)
    full = out.full_tensor()
    (full * upstream).sum().backward()
    return [full] + [v.grad.full_tensor() for v in placed if v.dtype.is_floating_point], _short(out.placements[0])


def _check_rules() -> dict:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # every rank draws the same values
    x, w = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)
    ids = torch.tensor([2, 0, 1, 1, 0, 2, 2, 0])
    rows, bag_of = torch.randn(8, 6, dtype=torch.float64), torch.tensor([0, 0, 1, 3, 3, 3, 4, 4])
    cases = [("expert_mm", lambda a, b, c: EXPERT_MM(a, b, c), [x, w, ids], EXPERT_MM_RULES, torch.randn(8, 6)),
             ("pool_rows", lambda a, b: POOL_ROWS(a, b, 5), [rows, bag_of], POOL_RULES, torch.randn(5, 6))]
    found = {}
    for name, op, values, rules, upstream in cases:
        upstream = upstream.double()
        local = [v.clone().requires_grad_() if v.dtype.is_floating_point else v for v in values]
        expected = op(*local)
        (expected * upstream).sum().backward()
        reference = [expected] + [v.grad for v in local if v.dtype.is_floating_point]
        for rule, _ in rules:
            got, placement = _run(op, mesh, values, rule, upstream)
            found[f"{name} {','.join(rule)}"] = (max(_error(a, b) for a, b in zip(got, reference)), placement)
    return found


@pytest.mark.distributed
def test_registered_rules_compute_what_one_process_does():
    found = run_world(2, _check_rules)
    for name, rules in (("expert_mm", EXPERT_MM_RULES), ("pool_rows", POOL_RULES)):
        for rule, output in rules:
            error, placement = found[f"{name} {','.join(rule)}"]
            assert error < 1e-12, (name, rule, error)
            assert placement == output, (name, rule, placement)


class _Router(torch.nn.Module):
    """DeepSeek-V3's router reads its top-k scores back with ``gather``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 4)

    def forward(self, x):
        scores = self.gate(x).sigmoid()
        _, ids = scores.topk(2, dim=-1)
        return scores.gather(1, ids) * 2


class _Pooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return torch.nn.functional.avg_pool2d(self.conv(x), 2)


def test_an_op_whose_backward_is_composite_keeps_its_rules_and_one_with_a_kernel_does_not():
    """``gather``'s backward (``gather_backward``) decomposes into zeros + scatter_add, which
    DTensor has rules for: gather splits by rows (before, it ran replicated and kept a MoE
    layer's rows replicated, so DeepSeek-V3 got no expert dispatch). ``avg_pool2d_backward``
    is a kernel DTensor has no rule for, so DTensor cannot run it split; but each sample pools
    on its own, so it is planned replicated or with its samples split, and lowering runs it on
    each device's samples (passes.sample_local)."""
    from autopar.passes.capture import capture
    from autopar.passes.strategies import one_dim_strategies
    from autopar.placements import Shard as S

    def rules(model, x, target):
        graph = capture(model, (x,)).graph
        node = next(n for n in graph.nodes if n.target == target)
        return one_dim_strategies(node, 2)

    gathered = rules(_Router(), torch.randn(8, 4), torch.ops.aten.gather.default)
    assert gathered is not None and ((S(0),), (S(0), S(0))) in gathered, gathered
    from autopar.placements import R

    assert rules(_Pooled(), torch.randn(2, 3, 8, 8), torch.ops.aten.avg_pool2d.default) == [((R,), (R,)),
                                                                                          ((S(0),), (S(0),))]
