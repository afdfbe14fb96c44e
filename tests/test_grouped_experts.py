"""Grouped-GEMM experts (torch._grouped_mm, transformers' default grouped_mm experts) are
rewritten per row at capture (passes.grouped_experts, passes.expert_mm): the rewritten graph
computes what the model does, the rows can be split and dispatched to the experts' owners,
and a layer whose rows depend on each other is left as written. Equivalence of the lowered
programs: tests/test_zoo.py (Mixtral, Qwen3-MoE and OLMoE with their default experts)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

import autopar
import models
from autopar.passes.capture import capture
from autopar.passes.expert_dispatch import DISPATCH_KEY
from autopar.passes.expert_mm import EXPERT_MM
from autopar.passes.experts import annotate_experts


def _targets(captured) -> list:
    return [n.target for n in captured.graph.nodes if n.op == "call_function"]


def _bf16_moe(**kwargs):
    """torch._grouped_mm's fake kernel takes bfloat16 only (the CUDA kernel's rule)."""
    torch.manual_seed(0)
    return models.GroupedMoE(**kwargs).to(torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)


def test_expert_mm_multiplies_each_row_by_its_experts_matrix():
    torch.manual_seed(0)
    x = torch.randn(12, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([2, 0, 0, 1, 2, 2, 0, 1, 1, 0, 2, 0])
    expected = torch.stack([x[r] @ w[ids[r]] for r in range(12)])
    assert torch.equal(EXPERT_MM(x, w, ids), expected)
    assert torch.autograd.gradcheck(lambda a, b: EXPERT_MM(a, b, ids), (x, w))
    with FlopCounterMode(display=False) as flops:
        EXPERT_MM(x, w, ids).sum().backward()
    assert flops.get_total_flops() == 3 * 2 * 12 * 4 * 5  # forward, and the input's and weights' gradients


def test_grouped_gemm_experts_are_rewritten_per_row_and_compute_the_same():
    model, x = _bf16_moe()
    captured = capture(model, (x,))
    targets = _targets(captured)
    assert targets.count(EXPERT_MM) == 2
    assert torch.ops.aten.sort.default not in targets and torch.ops.aten._grouped_mm.default not in targets
    rewritten = captured.program.module()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, out = model(x1), rewritten(x2)
    assert torch.equal(out, expected)
    expected.float().square().sum().backward()
    out.float().square().sum().backward()
    assert torch.allclose(x2.grad.float(), x1.grad.float(), rtol=1e-2, atol=1e-2)
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, p in rewritten.named_parameters():
        assert torch.allclose(p.grad.float(), grads[name].float(), rtol=1e-2, atol=1e-2), name


def test_a_grouped_layer_whose_rows_mix_keeps_its_sort():
    """Centring the hidden rows over all rows makes the sorted order matter: left as captured."""
    model, x = _bf16_moe(mix_rows=True)
    targets = _targets(capture(model, (x,)))
    assert torch.ops.aten.sort.default in targets and targets.count(torch.ops.aten._grouped_mm.default) == 2
    assert EXPERT_MM not in targets


def test_rewritten_experts_are_found_and_their_rows_can_go_to_the_owners():
    model, x = _bf16_moe(experts=4, top_k=2)
    captured = capture(model, (x,))
    (group,) = annotate_experts(captured, (x,))
    assert group.experts == 4 and group.top_k == 2 and sum(group.load) == 2 * x.shape[0]
    (dispatch,) = [n.meta[DISPATCH_KEY] for n in captured.graph.nodes if DISPATCH_KEY in n.meta]
    assert len(dispatch.gathers) == 2 and dispatch.rows == 2 * x.shape[0] and dispatch.experts == 4
    assert set(dispatch.weights) == set(group.nodes)
    plan = autopar.plan(model, (x,), cluster="2xH100", pipeline=False, replicas=False)
    assert set(plan.experts) == {""}
    # the tokens stay split by rows through the layer (the sort would have replicated them)
    assert all(plan.nodes[g].outputs[0] == "S(0)" for g in dispatch.gathers), \
        {g: plan.nodes[g].outputs for g in dispatch.gathers}
