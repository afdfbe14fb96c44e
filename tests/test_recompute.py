"""Activation checkpointing chosen by the search (issue 19, part 3): whole layers recomputed in
backward when no plan keeping every activation fits, costed (a second forward per layer,
one layer's activations while it reruns) and lowered with torch.utils.checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.errors import AutoparError, ErrorKind
from autopar.passes.capture import capture
from autopar.planning.costing import recost
from distributed import run_world
from equivalence import run_cases
from models import GPT

CLUSTERS = pathlib.Path(__file__).parent / "clusters"


def _gpt(layers: int = 4):
    torch.manual_seed(0)
    return GPT(layers=layers), torch.randint(0, 64, (8, 16))


def test_selective_recompute_sits_between_keeping_and_recomputing_everything():
    """Matmul and attention outputs kept and not rerun; the cheap ops between them rerun."""
    model, x = _gpt()
    plans = {mode: autopar.plan(model, (x,), cluster="2xH100", recompute=mode, configuration="ddp")
             for mode in ("none", "selective", "full")}
    memory = [plans[m].memory.activations_bytes for m in ("none", "selective", "full")]
    compute = [plans[m].predicted_compute_s for m in ("none", "selective", "full")]
    assert memory[0] > memory[1] > memory[2] and compute[0] < compute[1] < compute[2]
    assert set(plans["selective"].recompute.values()) == {"selective"}


def test_full_recompute_trades_a_forward_for_the_layers_activations():
    model, x = _gpt()
    kept = autopar.plan(model, (x,), cluster="2xH100", recompute="none", configuration="ddp")
    redone = autopar.plan(model, (x,), cluster="2xH100", recompute="full", configuration="ddp")
    assert redone.recompute == {f"blocks.{k}": "full" for k in range(4)} and kept.recompute == {}
    assert redone.memory.activations_bytes < 0.5 * kept.memory.activations_bytes
    # every layer op runs forward twice: 4 units of work instead of 3 on the gradient path
    assert kept.predicted_compute_s < redone.predicted_compute_s < 4 / 3 * kept.predicted_compute_s * (1 + 1e-9)
    assert autopar.Plan.from_json(redone.to_json()).recompute == redone.recompute


def test_every_other_layer_recomputed_sits_between_keeping_and_recomputing_every_layer():
    """"full:2" (torchtitan's layer-wise option 2): the 2nd and 4th layers rerun whole, the
    others keep their activations — half the rerun work of "full", for memory between the two.
    "full:3" recomputes one layer below a kept one: no rerun buffer (the kept layer above has
    freed more than the rerun needs by then). The plan's record reads back as the mode."""
    from autopar.passes.layer_recompute import recompute_mode

    model, x = _gpt()
    plans = {mode: autopar.plan(model, (x,), cluster="2xH100", recompute=mode, configuration="ddp")
             for mode in ("none", "full:2", "full:3", "full")}
    assert plans["full:2"].recompute == {"blocks.1": "full", "blocks.3": "full"}
    assert plans["full:3"].recompute == {"blocks.2": "full"}
    memory = {mode: plan.memory.activations_bytes for mode, plan in plans.items()}
    assert memory["full"] < memory["full:2"] < memory["none"] and memory["full"] < memory["full:3"] < memory["none"], memory
    rerun = {mode: plan.recompute_cost.get("rerun_s", 0.0) for mode, plan in plans.items()}
    assert rerun["full:2"] == pytest.approx(rerun["full"] / 2) and rerun["full:3"] == pytest.approx(rerun["full"] / 4)
    assert plans["full:3"].recompute_cost["rerun_buffer_bytes"] == 0 < plans["full:2"].recompute_cost["rerun_buffer_bytes"]
    layers = [f"blocks.{k}" for k in range(4)]
    for mode, plan in plans.items():
        again = autopar.Plan.from_json(plan.to_json())
        assert recompute_mode(layers, again.recompute) == mode
    from autopar.report import recompute_label, recompute_line

    assert recompute_label(plans["full:2"]) == "full:2 (2 of 4 layers)" and recompute_label(plans["full"]) == "full (4 layers)"
    assert "recompute (full:2): 2 of 4 layers (blocks.1, blocks.3) rerun in backward, whole" in recompute_line(plans["full:2"])
    with pytest.raises(AutoparError, match="unknown recompute 'full:1'"):
        autopar.plan(model, (x,), cluster="2xH100", recompute="full:1")


def test_the_cli_takes_every_nth_layer_and_refuses_other_modes(capsys):
    import json

    from autopar import cli

    assert cli.main(["plan", "models:tiny_gpt", "--cluster", "2xH100", "--recompute", "full:2", "--json"]) == 0
    recomputed = json.loads(capsys.readouterr().out)["recompute"]
    assert recomputed and set(recomputed.values()) == {"full"}
    for bad in ("full:1", "full:x", "half"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["plan", "models:tiny_gpt", "--cluster", "2xH100", "--recompute", bad])
        assert exc.value.code == 2 and "full:N (every N-th layer recomputed whole" in capsys.readouterr().err, bad


def test_pipeline_stages_recompute_every_nth_layer_of_their_own():
    """Under "full:2" each stage reruns the 2nd, 4th, … of its own layers; re-costing the plan
    (a re-plan's first step) reads that mode back from the stages."""
    from autopar.passes.layer_recompute import recorded_mode

    model, x = _gpt()
    plan = autopar.plan(model, (x,), cluster=str(CLUSTERS / "four_cpu_regions.yaml"), recompute="full:2",
                        pipeline=True)
    assert plan.family == "pipeline"
    expected = {layer: "full" for st in plan.stages for k, layer in enumerate(st.layers) if k % 2 == 1}
    assert plan.recompute == expected and expected
    assert recorded_mode([st.layers for st in plan.stages], plan.recompute) == "full:2"
    from autopar.report import recompute_label

    assert recompute_label(plan).startswith("full:2 ("), recompute_label(plan)
    assert autopar.replan(plan, str(CLUSTERS / "four_cpu_regions.yaml")).plan.predicted_step_s > 0


def test_whole_layers_rerun_are_cut_to_the_first_ones_the_placements_need():
    """Between the least memory of full:2 and of selective plans, auto reruns whole layers: the
    plan recomputing every layer, kept with only as many of the first layers recomputed as its
    placements need (block:K, Megatron's block method) — no slower than rerunning every layer
    or every other one (whose tighter memory costs the placements more here), within the limit;
    one layer fewer does not fit those placements."""
    from autopar.passes.layer_recompute import recompute_mode

    model, x = _gpt(layers=8)
    least = {}
    for mode in ("selective", "full:2"):
        with pytest.raises(AutoparError) as error:
            autopar.plan(model, (x,), cluster="2xH100", recompute=mode, memory_limit=1)
        least[mode] = error.value.needed_bytes
    assert least["full:2"] < least["selective"], least
    limit = (least["full:2"] + least["selective"]) // 2
    steps = {mode: autopar.plan(model, (x,), cluster="2xH100", recompute=mode, memory_limit=limit).predicted_step_s
             for mode in ("full:2", "full")}
    plan = autopar.plan(model, (x,), cluster="2xH100", memory_limit=limit)
    layers = [f"blocks.{k}" for k in range(8)]
    assert recompute_mode(layers, plan.recompute) == f"block:{len(plan.recompute)}", plan.recompute
    assert 1 <= len(plan.recompute) < 8
    assert plan.predicted_step_s <= min(steps.values()), (plan.predicted_step_s, steps)
    assert plan.memory.total_bytes <= limit
    if len(plan.recompute) > 1:  # the same placements with one layer fewer rerun are over the limit
        fewer = dataclasses.replace(plan, recompute=dict.fromkeys(layers[:len(plan.recompute) - 1], "full"))
        _, memory = recost(capture(model, (x,)), fewer, Cluster.from_spec("2xH100"))
        assert memory > limit


def test_the_search_recomputes_only_when_memory_requires_it():
    """Ample memory: nothing recomputed. Below what the leanest plan keeping every activation
    needs: every layer recomputed, within the limit. Below even that: a clear error."""
    model, x = _gpt()
    assert autopar.plan(model, (x,), cluster="2xH100").recompute == {}
    with pytest.raises(AutoparError) as keeping:
        autopar.plan(model, (x,), cluster="2xH100", recompute="none", memory_limit=1)
    with pytest.raises(AutoparError) as redoing:
        autopar.plan(model, (x,), cluster="2xH100", recompute="full", memory_limit=1)
    assert redoing.value.needed_bytes < keeping.value.needed_bytes
    between = (redoing.value.needed_bytes + keeping.value.needed_bytes) // 2
    plan = autopar.plan(model, (x,), cluster="2xH100", memory_limit=between)
    assert plan.recompute and plan.memory.total_bytes <= between
    with pytest.raises(AutoparError) as neither:
        autopar.plan(model, (x,), cluster="2xH100", memory_limit=redoing.value.needed_bytes // 2)
    assert neither.value.kind is ErrorKind.INFEASIBLE_MEMORY


def test_a_lower_limit_recomputes_first_where_that_beats_sharding_more():
    """Activations outweigh weights. With ample memory nothing is recomputed; at 80% of that
    plan's memory, keeping every activation forces more resharding than rerunning each layer's
    cheap ops costs, and the search takes selective recomputation. Without overlap: with it,
    sharding weights is nearly free in time here (their gathers hide behind compute)."""
    torch.manual_seed(0)
    model, x = GPT(vocab=64, d=256, heads=4, layers=4), torch.randint(0, 64, (32, 128))
    options = {"cluster": "4xH100", "mesh_shape": (4,), "overlap": False}
    ample = autopar.plan(model, (x,), **options)
    assert ample.recompute == {}
    limit = int(0.8 * ample.memory.total_bytes)
    kept = autopar.plan(model, (x,), recompute="none", memory_limit=limit, **options)
    selective = autopar.plan(model, (x,), recompute="selective", memory_limit=limit, **options)
    assert kept.comm_bytes > selective.comm_bytes  # keeping everything, it splits (and moves) more
    assert selective.predicted_step_s < kept.predicted_step_s
    chosen = autopar.plan(model, (x,), memory_limit=limit, **options)
    assert set(chosen.recompute.values()) == {"selective"}
    assert chosen.predicted_step_s == selective.predicted_step_s


def test_options_and_reports_say_what_is_recomputed():
    from autopar.cli_commands import summary_json
    from autopar.report import summary

    model, x = _gpt(layers=2)
    plan = autopar.plan(model, (x,), cluster="2xH100", recompute="full")
    assert summary_json(plan)["recompute"] == {"blocks.0": "full", "blocks.1": "full"}
    assert "recompute (full): 2 layers (blocks.0, blocks.1) rerun in backward, whole" in summary(plan)
    with pytest.raises(AutoparError, match="unknown recompute 'some'"):
        autopar.plan(model, (x,), cluster="2xH100", recompute="some")


def _held_bytes(mode: str) -> dict:
    """Bytes rank 0 holds when backward starts in a training step of the lowered model
    (tests/live_memory.py: every storage the step made and still alive; parameters and their
    bf16 working copies left out), next to the plan's prediction of them: its activations less
    what is live only later in backward — the recomputed layer's activations while it reruns
    (``recompute_cost["rerun_buffer_bytes"]``) and the gradient of the outputs backward starts
    from. ``mode``: the recompute mode, with "-bf16" for bf16 mixed precision."""
    import models
    import torch.nn.functional as F
    from live_memory import held_for_backward

    recompute, _, precision = mode.partition("-")
    torch.manual_seed(0)
    model, x = models.GPT(layers=4, d=64), torch.randint(0, 64, (8, 16))
    target = torch.randint(0, 64, (8, 16))
    pmodel = autopar.parallelize(model, (x,), recompute=recompute, configuration="ddp", mixed_precision=precision or None,
                                 loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
    pmodel.step(x, target=target)  # the first step settles what every step reuses
    held = held_for_backward(pmodel, x, target=target)
    plan = pmodel.plan
    logits = x.numel() * model.head.out_features  # the outputs: (batch, positions, vocabulary)
    output_gradient = logits * (2 if precision else 4) // (2 if plan.outputs else 1)
    return {"measured": held, "checkpointed": pmodel.code.count("checkpointed("),
            "predicted": plan.memory.activations_bytes - plan.recompute_cost.get("rerun_buffer_bytes", 0)
            - output_gradient}


def _held_bytes_by_mode(modes: list[str]) -> dict:
    return {mode: _held_bytes(mode) for mode in modes}


MODES = ["none", "selective", "full", "full:2", "full:3", "block:3", "none-bf16", "selective-bf16", "full-bf16"]
CHECKPOINTED = {"none": 0, "full:2": 2, "full:3": 1, "block:3": 3}  # layers wrapped in checkpoint; 4 otherwise


@pytest.mark.distributed
def test_what_a_step_holds_for_backward_is_what_the_plan_predicts():
    """The memory model against a lowered rank, each recompute mode in fp32 and bf16 (and every
    2nd or 3rd layer recomputed, in fp32) — within 10 % (docs/benchmarks.md). Selective checkpointing caches every matmul
    and attention output (whether or not autograd would keep it); full keeps the layers'
    boundaries only."""
    found = run_world(2, _held_bytes_by_mode, MODES)
    for mode, entry in found.items():
        assert entry["checkpointed"] == CHECKPOINTED.get(mode.removesuffix("-bf16"), 4), (mode, entry)
        assert abs(entry["measured"] - entry["predicted"]) <= 0.1 * entry["predicted"], (mode, found)
    for precision in ("", "-bf16"):
        none, selective, full = (found[m + precision]["measured"] for m in ("none", "selective", "full"))
        assert full < selective < none and full < 0.2 * none, found
    assert found["full"]["measured"] < min(found["full:2"]["measured"], found["full:3"]["measured"])
    assert max(found["full:2"]["measured"], found["full:3"]["measured"]) < found["none"]["measured"], found
    assert found["full"]["measured"] < found["block:3"]["measured"] < found["full:3"]["measured"], found
    assert found["none-bf16"]["measured"] < 0.6 * found["none"]["measured"], found


WORLD2 = [
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "2xcpu", "recompute": "full"}),
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "2xH100", "recompute": "full", "configuration": "megatron_tp"}),
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "2xH100", "recompute": "selective", "configuration": "megatron_tp"}),
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "2xcpu", "recompute": "selective", "configuration": "fsdp"}),
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "2xcpu", "recompute": "full:2", "configuration": "fsdp"}),
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "2xcpu", "recompute": "block:1", "configuration": "ddp"}),
]


# four ranks: a 2x2 mesh under a memory limit (sharded both ways), and FSDP regathering its
# weights inside the rerun layers
WORLD4 = [
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "4xH100", "mesh_shape": (2, 2), "recompute": "full",
                                         "memory_fraction": 0.5}),
    ("GPT", {"layers": 2}, "tokens", 4, {"cluster": "4xcpu", "recompute": "selective", "configuration": "fsdp"}),
]


def _check_fp32(cases, results):
    """Recomputation changes no number: fp32 round-off bounds as in test_equivalence."""
    for case, errors in zip(cases, results, strict=True):
        for key in ("output", "loss", "grad"):
            assert errors[key] <= 1e-5, (case, key, errors)
        assert errors["param"] <= 2e-4 and errors["param_flat"] <= 3e-2, (case, errors)
        assert "missing_grad" not in errors, (case, errors)
        assert errors["checkpointed"] > 0, (case, errors)


@pytest.mark.distributed
def test_recomputed_layers_train_like_one_process():
    _check_fp32(WORLD2, run_world(2, run_cases, WORLD2))


@pytest.mark.distributed
def test_recomputed_layers_train_like_one_process_on_four_ranks():
    results = run_world(4, run_cases, WORLD4)
    _check_fp32(WORLD4, results)
    assert any("Shard" in p for p in results[0]["placements"]), results[0]


@pytest.mark.distributed
def test_transformers_llama_recomputes_and_shards_its_optimizer_like_one_process():
    """Hugging Face Llama with its default (fused sdpa) attention: selective recomputation under
    ZeRO-2 (weights used whole, gradients and AdamW states split) and full recomputation under
    FSDP, on 2 ranks — every number as the single-process model's."""
    pytest.importorskip("transformers")
    import zoo

    name, kwargs, kind, batch, _limited, dtype, steps = zoo.equivalence_case("llama", 2)
    cases = [(name, kwargs, kind, batch, {"cluster": "2xH100", "recompute": mode, "configuration": configuration},
              dtype, steps) for mode, configuration in (("selective", "zero2"), ("full", "fsdp"))]
    results = run_world(2, run_cases, cases)
    _check_fp32(cases, results)
    assert results[0]["fused_attention"] == results[1]["fused_attention"] == 2, results
    assert results[0]["zero"] > 0 and any("Shard" in p for p in results[1]["placements"]), results


def test_plan_reports_what_recomputation_costs_and_saves():
    """show: the forward time rerun and the activations kept with and without; HTML: a memory
    bar for the same placements keeping everything."""
    from autopar.html_report import render
    from autopar.report import recompute_line

    model, x = _gpt()
    kept = autopar.plan(model, (x,), cluster="2xH100", recompute="none", configuration="ddp")
    redone = autopar.plan(model, (x,), cluster="2xH100", recompute="full", configuration="ddp")
    assert kept.recompute_cost == {}
    cost = redone.recompute_cost
    # the rerun is the extra forward: what the step's compute grew by
    assert cost["rerun_s"] == pytest.approx(redone.predicted_compute_s - kept.predicted_compute_s, rel=1e-6)
    # the same DDP placements keeping every activation: what the plan without recomputation keeps
    assert cost["activations_kept_bytes"] == pytest.approx(kept.memory.activations_bytes, rel=0.02)
    assert cost["activations_kept_bytes"] > 2 * redone.memory.activations_bytes
    assert "of forward a step, keeps" in recompute_line(redone)
    assert "without recomputation" in render(redone) and "without recomputation" not in render(kept)
    assert autopar.Plan.from_json(redone.to_json()).recompute_cost == cost
