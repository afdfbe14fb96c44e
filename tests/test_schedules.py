"""Pipeline schedules beyond one stage per group: interleaved 1F1B (virtual stages) costed,
searched, simulated, saved and lowered onto torch's ScheduleInterleaved1F1B."""

from __future__ import annotations

import dataclasses
import itertools
import random
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.solvers.pipeline import (StageTime, interleaved_order, interleaved_step_time, partition_interleaved,
                                      step_time, zero_bubble_step_time)
from autopar.timeline import schedule_spans
from distributed import run_world
from pipeline_equivalence import check_pipeline


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


def test_interleaved_time_shrinks_the_bubble_and_is_1f1b_with_one_chunk():
    chunk = StageTime(3.0, deferrable_s=1.0)  # F = B = W = 1
    for p, v, m in itertools.product((2, 4), (1, 2, 4), (4, 8)):
        assert interleaved_step_time([chunk] * (p * v), p, m) == pytest.approx((m * v + p - 1) * 3.0)
        # zero bubble: the weight gradients fill the bubble, (p − 1)(F + B − W) is left
        assert zero_bubble_step_time([chunk] * (p * v), p, m) == pytest.approx(m * v * 3.0 + (p - 1) * 1.0)
    rng = random.Random(0)
    for _ in range(50):
        p, m = rng.randint(1, 4), rng.randint(1, 9)
        stages = [StageTime(rng.uniform(1, 3), rng.choice([None, rng.uniform(0.1, 3)])) for _ in range(p)]
        assert interleaved_step_time(stages, p, m) == pytest.approx(step_time(stages, m, in_flight=p))


@pytest.mark.parametrize("step", [interleaved_step_time, zero_bubble_step_time])
def test_interleaved_cut_equals_brute_force_on_random_costs(step):
    rng = random.Random(1)
    for _ in range(40):
        ranks, virtual, m = rng.randint(1, 3), rng.randint(2, 3), rng.choice([2, 4, 6])
        layers = rng.randint(ranks * virtual, ranks * virtual + 3)
        chunks = ranks * virtual
        table = {(i, j, g): StageTime(*((float("inf"), None) if rng.random() < 0.1 else
                                        (rng.uniform(1, 3), rng.choice([None, rng.uniform(0.1, 1)]),
                                         rng.uniform(0, 0.3))))
                 for i in range(layers) for j in range(i + 1, layers + 1) for g in range(chunks)}
        found = partition_interleaved(layers, ranks, virtual, m, lambda i, j, g: table[(i, j, g)], step=step)
        best = min((step([table[(b[g], b[g + 1], g)] for g in range(chunks)], ranks, m)
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
    assert {(t["schedule"], t["virtual_stages"]) for t in tried} == {("1F1B", 1), ("InterleavedZeroBubble", 2)}
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
    again = Plan.from_json(interleaved.to_json())
    assert again == interleaved and again.virtual_stages == 2
    with pytest.raises(AutoparError, match="virtual_stages"):
        Plan.from_json(dataclasses.replace(interleaved, virtual_stages=3).to_json())
    with pytest.raises(AutoparError, match="schedule"):
        Plan.from_json(dataclasses.replace(interleaved, schedule="Zigzag").to_json())
    with pytest.raises(AutoparError, match="too few"):
        autopar.plan(models.GPT(vocab=64, layers=2), (tokens,), cluster="2x1xcpu", pipeline=True,
                     schedule="Interleaved1F1B")


@pytest.mark.distributed
def test_interleaved_and_three_stage_pipelines_train_like_one_process():
    """Interleaved zero bubble on 2 ranks (2 chunks each, 4 micro-batches); interleaved 1F1B
    and zero bubble on 4 (2 stages × 2 devices, 2 chunks each, boundaries sliced by lane, the
    stages' weights split over their 2 devices); 1F1B over 3 stages: loss, gradients (every
    step), parameters after SGD steps and evaluation outputs match the single-process model."""
    cases = [(2, "2x1xcpu", 4, 3, 4, 8, "InterleavedZeroBubble"), (4, "2x2xcpu", 2, 2, 4, 8, "Interleaved1F1B"),
             (4, "2x2xcpu", 2, 2, 4, 8, "InterleavedZeroBubble"), (3, "3x1xcpu", 3, 2, 6, 6, "1F1B")]
    for world, *case in cases:
        result = run_world(world, check_pipeline, *case)
        assert result["all_params_covered"], result
        assert result["loss"] < 2e-6 and result["grad"] < 1e-6 and result["param"] < 1e-6, result
        assert result["output"] < 2e-6, result
        if case[-1] != "1F1B":
            assert result["stages"] == [["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"]], result
            assert result["sliced"] == (world == 4), result
        else:
            assert len(result["stages"]) == 3, result


def test_json_names_each_mesh_dims_role_and_the_schedule():
    import autopar
    import torch

    import models
    from autopar.cli import summary_json

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
