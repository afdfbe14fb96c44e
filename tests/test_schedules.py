"""Pipeline schedules beyond one stage per group: interleaved 1F1B (virtual stages) costed,
searched, simulated, saved and lowered onto torch's ScheduleInterleaved1F1B."""

from __future__ import annotations

import dataclasses
import itertools
import random
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, _ComputationType

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_types import chunk_group
from autopar.solvers.pipeline import (StageTime, interleaved_order, interleaved_step_time, partition_interleaved,
                                      step_time, zbv_order, zero_bubble_step_time)
from autopar.timeline import schedule_spans
from distributed import run_world
from pipeline_equivalence import check_pipelines


def _torch_order(rank: int, ranks: int, virtual: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """The operations torch's own ScheduleInterleaved1F1B gives ``rank`` (its order builder,
    run on the few fields it reads)."""
    rounds = max(1, micro_batches // ranks)
    fields = SimpleNamespace(n_local_stages=virtual, microbatches_per_round=micro_batches // rounds,
                             pp_group_size=ranks, _n_microbatches=micro_batches)
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(fields, rank)
    return [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index, a.microbatch_index)
            for a in actions if a is not None]


def test_the_simulated_order_is_torchs_interleaved_1f1b():
    for ranks, virtual in itertools.product((2, 3, 4), (2, 3, 4)):
        for m in sorted({ranks, ranks + 1, 2 * ranks, 3 * ranks, 4 * ranks}):
            if m % max(1, m // ranks):
                continue  # torch refuses these counts; the search never makes them
            for rank in range(ranks):
                assert interleaved_order(rank, ranks, virtual, m) == _torch_order(rank, ranks, virtual, m), \
                    (ranks, virtual, m, rank)


def test_the_simulated_order_is_torchs_zbv():
    """Forwards and input gradients in the order torch's ScheduleZBVZeroBubble runs them
    (its weight gradients are the simulator's to place), also with fewer micro-batches than
    its warm-up wants (torch then drops the missing ones)."""
    for ranks, m in itertools.product((2, 3, 4), (1, 2, 3, 4, 6, 8, 9)):
        fields = SimpleNamespace(pp_group_size=ranks, num_stages=2 * ranks, _n_microbatches=m)
        for rank in range(ranks):
            actions = ScheduleZBVZeroBubble._calculate_single_rank_operations(fields, rank)
            torch_order = [("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index,
                            a.microbatch_index) for a in actions
                           if a is not None and a.computation_type != _ComputationType.BACKWARD_WEIGHT]
            assert zbv_order(rank, ranks, m) == torch_order, (ranks, m, rank)
            assert {chunk_group(g, ranks, "ZBVZeroBubble") for _, g, _ in torch_order} == {rank}


def test_interleaved_time_shrinks_the_bubble_and_is_1f1b_with_one_chunk():
    chunk = StageTime(3.0, deferrable_s=1.0)  # F = B = W = 1
    for p, v, m in itertools.product((2, 4), (1, 2, 4), (4, 8)):
        assert interleaved_step_time([chunk] * (p * v), p, m) == pytest.approx((m * v + p - 1) * 3.0)
        # zero bubble: the weight gradients fill the bubble, (p − 1)(F + B − W) is left
        assert zero_bubble_step_time([chunk] * (p * v), p, m) == pytest.approx(m * v * 3.0 + (p - 1) * 1.0)
    for p, m in itertools.product((2, 4), (4, 8)):  # ZBV: the same floor with equal chunks ...
        v_groups = [chunk_group(g, p, "ZBVZeroBubble") for g in range(2 * p)]
        assert zero_bubble_step_time([chunk] * (2 * p), p, m, v_groups, hidden_per_hop=3) == pytest.approx(m * 2 * 3.0 + (p - 1) * 1.0)
    # ... and less where the turn's hand-over is free: the middle chunks on one group send nothing
    uneven = [StageTime(3.5, 3.0, 1.0), StageTime(3.0, 3.0, 1.0), StageTime(3.5, 3.0, 1.0), StageTime(3.0, 3.0, 1.0)]
    assert zero_bubble_step_time(uneven, 2, 4, [0, 1, 1, 0], hidden_per_hop=3) < zero_bubble_step_time(uneven, 2, 4)
    rng = random.Random(0)
    for _ in range(50):
        p, m = rng.randint(1, 4), rng.randint(1, 9)
        stages = [StageTime(rng.uniform(1, 3), rng.choice([None, rng.uniform(0.1, 3)])) for _ in range(p)]
        assert interleaved_step_time(stages, p, m) == pytest.approx(step_time(stages, m, in_flight=p))


@pytest.mark.parametrize("step,schedule", [(interleaved_step_time, "Interleaved1F1B"),
                                           (zero_bubble_step_time, "InterleavedZeroBubble"),
                                           (zero_bubble_step_time, "ZBVZeroBubble")])
def test_interleaved_cut_equals_brute_force_on_random_costs(step, schedule):
    rng = random.Random(1)
    for _ in range(40):
        ranks, virtual, m = rng.randint(1, 3), rng.randint(2, 3), rng.choice([2, 4, 6])
        virtual = 2 if schedule == "ZBVZeroBubble" else virtual
        groups = [chunk_group(g, ranks, schedule) for g in range(ranks * virtual)] if schedule == "ZBVZeroBubble" \
            else None
        timed = step if groups is None else (lambda times, p, mb: step(times, p, mb, groups))
        layers = rng.randint(ranks * virtual, ranks * virtual + 3)
        chunks = ranks * virtual
        table = {(i, j, g): StageTime(*((float("inf"), None) if rng.random() < 0.1 else
                                        (rng.uniform(1, 3), rng.choice([None, rng.uniform(0.1, 1)]),
                                         rng.uniform(0, 0.3))))
                 for i in range(layers) for j in range(i + 1, layers + 1) for g in range(chunks)}
        found = partition_interleaved(layers, ranks, virtual, m, lambda i, j, g: table[(i, j, g)], step=step,
                                      groups=groups)
        best = min((timed([table[(b[g], b[g + 1], g)] for g in range(chunks)], ranks, m)
                    for cuts in itertools.combinations(range(1, layers), chunks - 1)
                    for b in [(0, *cuts, layers)]), default=float("inf"))
        if best == float("inf"):
            assert found is None
        else:
            assert found is not None and found.step_s == pytest.approx(best)


def test_the_search_keeps_the_fastest_schedule_and_the_timeline_runs_each_group_in_turn():
    import autopar
    import torch

    import models

    model = models.GPT(vocab=64, layers=4)
    tokens = torch.randint(0, 64, (8, 16))
    plan = autopar.plan(model, (tokens,), cluster="2x1xcpu", pipeline=True, schedule="auto")
    tried = plan.solver["micro_batch_candidates"]
    assert {(t["schedule"], t["virtual_stages"]) for t in tried} == {("1F1B", 1), ("InterleavedZeroBubble", 2),
                                                                     ("ZBVZeroBubble", 2)}
    assert plan.predicted_step_s == pytest.approx(min(t["predicted_step_s"] for t in tried if t["cuts"]))
    interleaved = autopar.plan(model, (tokens,), cluster="2x1xcpu", pipeline=True, schedule="Interleaved1F1B",
                               micro_batches=4)
    assert interleaved.schedule == "Interleaved1F1B" and interleaved.virtual_stages == 2
    assert [st.group for st in interleaved.stages] == ["host0", "host1", "host0", "host1"]
    assert [len(g) for g in interleaved.stage_groups()] == [2, 2]
    assert interleaved.bubble == pytest.approx(1 / (4 * 2 + 1))
    spans = schedule_spans(interleaved)
    assert len(spans) == 2 and all(len(row) == 2 * 4 * 2 for row in spans)
    for row in spans:  # a group runs one chunk at a time
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(row, row[1:]))
    zero_bubble = autopar.plan(model, (tokens,), cluster="2x1xcpu", pipeline=True, schedule="InterleavedZeroBubble",
                               micro_batches=4)
    assert zero_bubble.bubble == pytest.approx(1 / (3 * 4 * 2 + 1))
    for row in schedule_spans(zero_bubble):  # forward, input gradients, then weight gradients in idle time
        assert [kind for *_, kind, _ in row].count("W") == 4 * 2 and len(row) == 3 * 4 * 2
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(row, row[1:]))
        first_b = min(start for start, _, kind, _ in row if kind == "B")
        assert all(start >= first_b for start, _, kind, _ in row if kind == "W")
    zbv = autopar.plan(model, (tokens,), cluster="2x1xcpu", pipeline=True, schedule="ZBVZeroBubble", micro_batches=4)
    assert (zbv.schedule, zbv.virtual_stages) == ("ZBVZeroBubble", 2)
    assert [st.group for st in zbv.stages] == ["host0", "host1", "host1", "host0"]  # the V
    assert [[st.layers for st in chunks] for chunks in zbv.stage_groups()] == \
        [[("blocks.0",), ("blocks.3",)], [("blocks.1",), ("blocks.2",)]]
    assert zbv.stages[1].send_s == 0 and zbv.stages[0].send_s > 0  # the turn stays on host1
    assert zbv.bubble == pytest.approx(1 / (3 * 4 * 2 + 1))
    assert zbv.predicted_step_s < zero_bubble.predicted_step_s  # one hand-over fewer per micro-batch
    for row in schedule_spans(zbv):
        assert len(row) == 3 * 4 * 2 and all(a[1] <= b[0] + 1e-12 for a, b in zip(row, row[1:]))
    assert Plan.from_json(zbv.to_json()) == zbv
    with pytest.raises(AutoparError, match="virtual_stages"):
        Plan.from_json(dataclasses.replace(zbv, virtual_stages=4).to_json())
    again = Plan.from_json(interleaved.to_json())
    assert again == interleaved and again.virtual_stages == 2
    with pytest.raises(AutoparError, match="virtual_stages"):
        Plan.from_json(dataclasses.replace(interleaved, virtual_stages=3).to_json())
    with pytest.raises(AutoparError, match="schedule"):
        Plan.from_json(dataclasses.replace(interleaved, schedule="Zigzag").to_json())
    with pytest.raises(AutoparError, match="too few"):
        autopar.plan(models.GPT(vocab=64, layers=2), (tokens,), cluster="2x1xcpu", pipeline=True,
                     schedule="Interleaved1F1B")


def test_weight_gradients_are_the_share_of_flops_that_reads_a_weight():
    """A third of a stack of matmuls; less in attention layers, the less the longer the
    sequence (QKᵀ and PV have no weight gradient); recorded per stage, read as a third in
    plans made before."""
    import json

    import autopar
    import torch
    from torch import nn

    import models
    from autopar.passes.capture import capture
    from autopar.passes.cost import annotate_costs
    from autopar.passes.weight_gradients import weight_gradient_flops, weight_gradient_share

    def share(model, inputs, layers):
        captured = capture(model, inputs)
        annotate_costs(captured.graph)
        return weight_gradient_share(weight_gradient_flops(captured), layers)

    mlp = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)))
    assert 0.3 < share(mlp, (torch.randn(8, 64),), ["0", "1", "2"]) <= 1 / 3
    short, long = (share(models.GPT(vocab=64, layers=2), (torch.randint(0, 64, (8, t)),), ["blocks.0"])
                   for t in (16, 256))
    assert long < short < 1 / 3
    plan = autopar.plan(models.GPT(vocab=64, layers=4), (torch.randint(0, 64, (8, 16)),), cluster="2x1xcpu",
                        pipeline=True, schedule="ZBVZeroBubble", micro_batches=4)
    assert all(0 < st.weight_grad_s < st.compute_s / 3 for st in plan.stages)
    old = json.loads(plan.to_json())
    for stage in old["stages"]:
        del stage["weight_grad_s"]
    assert all(st.weight_gradients_s == st.compute_s / 3 for st in Plan.from_json(json.dumps(old)).stages)


@pytest.mark.distributed
def test_interleaved_and_three_stage_pipelines_train_like_one_process():
    """Interleaved zero bubble and ZBV on 2 ranks (2 chunks each, 4 micro-batches; ZBV's
    first rank holds the first and the last chunk); interleaved 1F1B, zero bubble and ZBV on 4
    (2 stages × 2 devices, 2 chunks each, boundaries sliced by lane, the stages' weights split
    over their 2 devices); 1F1B over 3 stages: loss, gradients (every step), parameters after
    SGD steps and evaluation outputs match the single-process model."""
    worlds = {2: [("2x1xcpu", 4, 3, 4, 8, "InterleavedZeroBubble"), ("2x1xcpu", 4, 3, 4, 8, "ZBVZeroBubble")],
              4: [("2x2xcpu", 2, 2, 4, 8, "Interleaved1F1B"), ("2x2xcpu", 2, 2, 4, 8, "InterleavedZeroBubble"),
                  ("2x2xcpu", 2, 2, 4, 8, "ZBVZeroBubble")],
              3: [("3x1xcpu", 3, 2, 6, 6, "1F1B")]}
    results = [(world, case, result) for world, cases in worlds.items()
               for case, result in zip(cases, run_world(world, check_pipelines, cases))]
    for world, case, result in results:
        assert result["all_params_covered"], (case, result)
        assert result["loss"] < 2e-6 and result["grad"] < 1e-6 and result["param"] < 1e-6, (case, result)
        assert result["output"] < 2e-6, (case, result)
        if case[-1] != "1F1B":
            assert result["stages"] == [["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"]], (case, result)
            assert result["sliced"] == (world == 4), (case, result)
        else:
            assert len(result["stages"]) == 3, result


def test_json_names_each_mesh_dims_role_and_the_schedule():
    import autopar
    import torch

    import models
    from autopar.cli_commands import summary_json

    model = models.GPT(vocab=64, layers=2)
    tokens = torch.randint(0, 64, (8, 16))
    expected = {("ddp", "4xcpu"): ["dp_replicate"], ("fsdp", "4xcpu"): ["dp_shard"],
                ("megatron_tp", "4xcpu"): ["tp"], ("tp_dp", "2x2xcpu"): ["dp_replicate", "tp"]}
    for (configuration, cluster), roles in expected.items():
        plan = autopar.plan(model, (tokens,), cluster=cluster, configuration=configuration)
        shown = summary_json(plan)
        assert shown["mesh_dim_roles"] == roles, (configuration, shown["mesh_dim_roles"])
        assert shown["schedule"] is None and shown["virtual_stages"] == 1
    pipeline = autopar.plan(models.GPT(vocab=64, layers=4), (tokens,), cluster="2x1xcpu", pipeline=True,
                            schedule="Interleaved1F1B", micro_batches=2)
    shown = summary_json(pipeline)
    assert shown["mesh_dim_roles"] == ["pp", "lane"]
    assert (shown["schedule"], shown["virtual_stages"], shown["micro_batches"]) == ("Interleaved1F1B", 2, 2)
    # each device holds its group's two chunks at once
    assert shown["peak_memory_bytes"] == [sum(st.memory.total_bytes for st in chunks)
                                          for chunks in pipeline.stage_groups()]
