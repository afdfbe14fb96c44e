"""Fused attention stays fused (issue 19, part 2): F.scaled_dot_product_attention is one op
in the captured graph, costed by its formula, kept for backward as the kernel keeps it (no
B·H·T² scores), split by batch or heads, and run as the fused kernel on each device's shard."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.passes.capture import capture
from autopar.passes.cost import COST_KEY, FUSED_ATTENTION, annotate_costs
from autopar.passes.strategies import STRATEGIES_KEY, enumerate_strategies
from autopar.placements import R, Shard
from distributed import run_world
from equivalence import run_cases
from models import Block, ExplicitAttentionBlock, GQAttention


def _ops(model, inputs):
    captured = capture(model, inputs)
    return captured, [n for n in captured.graph.nodes if n.op == "call_function"]


def test_attention_is_one_op_costed_by_its_formula():
    b, t, d, h = 2, 16, 32, 4
    captured, ops = _ops(Block(d, h), (torch.randn(b, t, d),))
    names = [str(n.target) for n in ops]
    assert names.count(str(FUSED_ATTENTION)) == 1 and not any("softmax" in n or "bmm" in n for n in names)
    annotate_costs(captured.graph)
    (node,) = [n for n in ops if n.target is FUSED_ATTENTION]
    causal_half = 0.5
    assert node.meta[COST_KEY].flops == causal_half * 2 * b * h * t * t * (2 * d // h)  # q·kᵀ and p·v
    assert node.meta[COST_KEY].op_class == "attention"
    _, explicit = _ops(ExplicitAttentionBlock(d, h), (torch.randn(b, t, d),))  # written out: as today
    assert any("_softmax" in str(n.target) for n in explicit) and not any(n.target is FUSED_ATTENTION for n in explicit)


@pytest.mark.parametrize("mesh, heads_split", [((2,), True), ((4,), False)])
def test_splits_by_batch_and_by_whole_query_groups(mesh, heads_split):
    """4 query heads share 2 key/value heads: a head split over 2 devices keeps each group
    whole; over 4 it would cut a key/value head, so only the batch splits (and the sequence:
    context parallelism, tests/test_context_parallel.py)."""
    captured, ops = _ops(GQAttention(heads=4, kv_heads=2), (torch.randn(8, 8, 32),))
    enumerate_strategies(captured.graph, mesh)
    (node,) = [n for n in ops if n.target is FUSED_ATTENTION]
    outputs = {s.outputs[0] for s in node.meta[STRATEGIES_KEY]}
    assert outputs == ({(R,), (Shard(0),), (Shard(1),), (Shard(2),)} if heads_split else {(R,), (Shard(0),), (Shard(2),)})
    assert all(len(set(s.inputs)) == 1 and s.inputs[0] == s.outputs[0] for s in node.meta[STRATEGIES_KEY])


def test_long_sequences_plan_without_score_matrices():
    """T = 4096: the decomposed form kept two (B, H, T, T) fp32 tensors per layer (1 GiB here);
    the fused one keeps its inputs and output only."""
    with torch.device("meta"):
        fused, x = Block(1024, 16), torch.randn(2, 4096, 1024)
        explicit = ExplicitAttentionBlock(1024, 16)
    fused_plan = autopar.plan(fused, (x,), cluster="1xH100")
    explicit_plan = autopar.plan(explicit, (x,), cluster="1xH100")
    scores = 4 * 2 * 16 * 4096 * 4096
    assert explicit_plan.memory.activations_bytes - fused_plan.memory.activations_bytes >= scores
    assert fused_plan.memory.activations_bytes < scores


def test_hugging_face_default_attention_is_planned_fused():
    pytest.importorskip("transformers")
    import zoo

    model, inputs = zoo.build("llama")
    plan = autopar.plan(model, inputs, cluster="2xH100")
    ops = [n.op for n in plan.nodes.values()]
    assert ops.count(str(FUSED_ATTENTION)) == 2 and not any("softmax" in op for op in ops)  # 2 layers


WORLD2 = [
    ("GQAttention", {}, "seq", 4, {"cluster": "2xcpu", "configuration": "megatron_tp"}),  # split by heads
    ("GQAttention", {"causal": False, "mask": True}, "seq", 4, {"cluster": "2xH100", "memory_fraction": 0.7}),
]
WORLD4 = [
    ("GQAttention", {"heads": 8, "kv_heads": 4}, "seq", 4,
     {"cluster": "4xH100", "mesh_shape": (2, 2), "configuration": "tp_dp"}),
]


def _check(cases, results):
    for case, errors in zip(cases, results, strict=True):
        label = f"{case[0]} {case[1]} {case[4]}"
        assert errors["fused_attention"] == 1, (label, errors)  # the lowered program calls the fused kernel
        for key in ("output", "loss", "grad"):
            assert errors[key] <= 1e-5, (label, key, errors)
        assert errors["param"] <= 1e-4 and errors["param_flat"] <= 3e-2, (label, errors)
        assert any("Shard" in p for p in errors["placements"]), (label, errors)
        assert "missing_grad" not in errors, (label, errors)


@pytest.mark.distributed
def test_fused_attention_equivalence_two_processes():
    _check(WORLD2, run_world(2, run_cases, WORLD2))


@pytest.mark.distributed
def test_fused_attention_equivalence_four_processes():
    _check(WORLD4, run_world(4, run_cases, WORLD4))
