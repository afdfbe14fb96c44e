"""Context parallelism (issue 21): fused attention with its sequence split over devices —
keys and values all-gathered in the op, gradients reduce-scattered — costed honestly
(the gather, the gathered keys kept, the causal imbalance of contiguous chunks) and lowered
so that outputs, loss and gradients equal the single process's. And sequence parallelism in
a tensor-parallel region (Megatron's SP: norms on sequence shards, reduce-scatter and
all-gather in place of all-reduce), which DTensor's own rules give the search."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import html_report
from autopar.mesh import mesh_for_shape
from autopar.cluster import Cluster
from autopar.passes.capture import capture
from autopar.passes.context_parallel import (
    BALANCED_CAUSAL, SEQUENCE_SPLIT, causal_imbalance, gathered_kv_bytes, kv_exchange_s)
from autopar.passes.cost import FUSED_ATTENTION
from autopar.passes.strategies import STRATEGIES_KEY, enumerate_strategies, work_split
from autopar.placements import R
from autopar.report import mesh_dim_roles, summary
from distributed import run_world
from equivalence import run_cases
from models import GQAttention


def _attention(model, inputs, mesh_shape):
    captured = capture(model, inputs)
    enumerate_strategies(captured.graph, mesh_shape)
    (node,) = [n for n in captured.graph.nodes if n.target is FUSED_ATTENTION]
    return node


def _sequence_strategy(node, exchange: str = ""):
    return next(s for s in node.meta[STRATEGIES_KEY] if s.outputs[0] == (SEQUENCE_SPLIT,) and s.exchange == exchange)


def test_self_attention_may_split_its_sequence():
    """With no mask, with a padding mask (B, 1, 1, T) — kept whole —, or with a causal mask
    written out (1, 1, T, T) — split by its query rows with the queries."""
    x = torch.randn(2, 8, 32)
    node = _attention(GQAttention(heads=4, kv_heads=2), (x,), (2,))
    assert _sequence_strategy(node).inputs == ((SEQUENCE_SPLIT,),) * 3
    padded = _attention(GQAttention(heads=4, kv_heads=2, causal=False, mask=True), (x,), (2,))
    assert _sequence_strategy(padded).inputs == ((SEQUENCE_SPLIT,),) * 3 + ((R,),)
    written = _attention(GQAttention(heads=4, kv_heads=2, causal=False, mask="causal"), (x,), (2,))
    assert _sequence_strategy(written).inputs == ((SEQUENCE_SPLIT,),) * 4
    on_2d = _attention(GQAttention(heads=4, kv_heads=2), (x,), (2, 2))  # the sequence split on one dim at most
    assert all(s.outputs[0] != (SEQUENCE_SPLIT, SEQUENCE_SPLIT) for s in on_2d.meta[STRATEGIES_KEY])
    assert any(s.outputs[0] == (R, SEQUENCE_SPLIT) for s in on_2d.meta[STRATEGIES_KEY])


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_causal_chunks_cost_the_busiest_device(devices):
    """Contiguous chunks: under a causal mask the last chunk's queries see every key, so its
    device does 2/n of the causal work; without a mask each does 1/n; balanced about 1/n. The keys and values
    (a quarter of the queries' bytes here: 1 of 4 heads) are gathered forward and their
    gradients reduce-scattered backward, and the gathered copy is kept for backward."""
    x = torch.randn(1, 64, 32)
    causal = _attention(GQAttention(heads=4, kv_heads=1), (x,), (devices,))
    full = _attention(GQAttention(heads=4, kv_heads=1, causal=False), (x,), (devices,))
    assert work_split(_sequence_strategy(causal), (devices,)) * \
        causal_imbalance(causal, _sequence_strategy(causal), (devices,)) == devices / 2
    assert causal_imbalance(full, _sequence_strategy(full), (devices,)) == 1.0
    mesh = mesh_for_shape(Cluster.from_spec(f"{devices}xH100"), (devices,))
    kv_bytes = 2 * 64 * 8 * 4  # keys and values: 64 positions × 8 wide × fp32
    link = mesh.links[0]
    expected = 2 * ((devices - 1) / devices * kv_bytes / link.bandwidth_Bps)
    exchange = kv_exchange_s(causal, _sequence_strategy(causal), mesh)
    assert expected < exchange < expected + 2 * (devices - 1) * link.latency_s / min(
        link.efficiency("all_gather"), link.efficiency("reduce_scatter")) + 1e-12
    assert gathered_kv_bytes(causal, _sequence_strategy(causal), (devices,), copies=1) == kv_bytes * (devices - 1) // devices
    assert kv_exchange_s(causal, causal.meta[STRATEGIES_KEY][0], mesh) == 0.0  # replicated: nothing gathered
    # balanced: halves j and 2n-1-j on device j, (2n+1)/(4n²) of the pairs each; the query
    # halves and their outputs travel both ways, forward and backward
    balanced = _sequence_strategy(causal, BALANCED_CAUSAL)
    assert work_split(balanced, (devices,)) * causal_imbalance(causal, balanced, (devices,)) == \
        pytest.approx(2 * devices ** 2 / (2 * devices + 1))
    query_bytes = 64 * 32 * 4 // devices
    assert kv_exchange_s(causal, balanced, mesh) - exchange == pytest.approx(
        4 * (query_bytes / link.bandwidth_Bps + 2 * link.latency_s) / link.efficiency("all_to_all"))
    assert not any(s.exchange for s in full.meta[STRATEGIES_KEY])  # no mask, not causal: nothing to balance
    rerun = kv_exchange_s(causal, balanced, mesh, forward_only=True)  # what a recomputed layer gathers again
    assert 0 < rerun < kv_exchange_s(causal, balanced, mesh)


def test_long_sequences_plan_with_the_sequence_split():
    """A 32k-token sequence of a multi-query model (one key/value head: heads cannot split)
    on 8 devices: the plan splits attention's sequence and calls that mesh dim "cp", and is
    no slower than the hand-written context-parallel configuration."""
    with torch.device("meta"):
        model, x = GQAttention(d=1024, heads=16, kv_heads=1, causal=False), torch.randn(1, 32768, 1024)
    plan = autopar.plan(model, (x,), cluster="8xH100", mixed_precision="bf16")
    (attention,) = [n for n in plan.nodes.values() if n.op == str(FUSED_ATTENTION)]
    assert attention.outputs == ("S(2)",)
    assert mesh_dim_roles(plan) == ["cp"]
    line = "context parallelism: attention's sequence split on mesh dim dp (8 devices, contiguous chunks)"
    assert line in summary(plan) and line.replace("'", "&#x27;") in html_report.render(plan)
    pinned = autopar.plan(model, (x,), cluster="8xH100", mixed_precision="bf16", configuration="context_parallel")
    assert plan.predicted_step_s <= pinned.predicted_step_s * (1 + 1e-9)


CP = {"cluster": "2xcpu", "configuration": "context_parallel"}
WORLD2 = [
    ("GQAttention", {"heads": 4, "kv_heads": 1}, "seq", 1, CP),  # causal, multi-query, balanced
    ("GQAttention", {"heads": 4, "kv_heads": 1}, "long:6:32", 1, CP),  # chunks of 3 do not halve: contiguous
    ("GQAttention", {"heads": 4, "kv_heads": 2}, "seq", 2, CP),  # causal, grouped, 2 sequences
    ("GQAttention", {"causal": False}, "seq", 1, CP),
    ("GQAttention", {"causal": False, "mask": "causal"}, "seq", 1, CP),  # the mask's rows split
    ("GQAttention", {"causal": False, "mask": True}, "seq", 2, CP),  # a padding mask, whole
    ("GPT", {"layers": 2}, "tokens", 1, CP),  # position embeddings of arange, every op split on the sequence
    ("GPT", {"layers": 2}, "tokens", 1, {**CP, "recompute": "full"}),  # the gathers and all-to-alls rerun in backward
]
WORLD4 = [
    ("GQAttention", {"heads": 4, "kv_heads": 2}, "seq", 1, {"cluster": "4xcpu", "configuration": "context_parallel"}),
]


def _check(cases, results):
    for case, errors in zip(cases, results, strict=True):
        label = f"{case[0]} {case[1]} {case[2]} {case[4]}"
        assert errors["attention_outputs"] == ["S(2)"], (label, errors)  # the sequence is split
        causal = case[1].get("causal", True) and not case[1].get("mask")
        balanced = causal and case[2] != "long:6:32"  # load-balanced wherever the chunks halve
        assert errors["attention_exchanges"] == ["balanced_causal" if balanced else ""], (label, errors)
        assert errors["checkpointed"] == (2 if case[4].get("recompute") == "full" else 0), (label, errors)
        assert errors["fused_attention"] >= 1, (label, errors)
        for key in ("output", "loss", "grad"):
            assert errors[key] <= 1e-5, (label, key, errors)
        assert errors["param"] <= 1e-4 and errors["param_flat"] <= 3e-2, (label, errors)
        assert "missing_grad" not in errors, (label, errors)


@pytest.mark.distributed
def test_context_parallel_equivalence_two_processes():
    _check(WORLD2, run_world(2, run_cases, WORLD2))


@pytest.mark.distributed
def test_context_parallel_equivalence_four_processes():
    _check(WORLD4, run_world(4, run_cases, WORLD4))


SP = [("Block", {}, "long:64:32", 1, {"cluster": "2xcpu", "configuration": "megatron_tp"})]


@pytest.mark.distributed
def test_sequence_parallel_tensor_parallel_region_equivalence():
    """Megatron TP on one 64-token sequence: the first norm runs on sequence shards, the
    block's output leaves reduce-scattered on the sequence (row-parallel partial sums ->
    S(1)), and the column-parallel matmuls read an all-gathered input."""
    (errors,) = run_world(2, run_cases, SP)
    assert "S(1)" in errors["norm_outputs"], errors  # a norm on the sequence shards
    assert errors["outputs_placed"] == ("S(1)",), errors  # partial sums reduce-scattered on the sequence
    for key in ("output", "loss", "grad"):
        assert errors[key] <= 1e-5, (key, errors)
    assert errors["param"] <= 1e-4 and "missing_grad" not in errors, errors
