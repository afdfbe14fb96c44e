"""The planning layer (issue 18): families behind one interface, the winner chosen in one
place, the model captured once, hand-written baselines listed whatever family wins."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import autopar
from autopar.planning import FAMILIES, lower_plan
from autopar.planning import graphs as graphs_module
from models import GPT

TWO_REGIONS = os.path.join(os.path.dirname(__file__), "clusters", "two_cpu_regions.yaml")


def _gpt():
    torch.manual_seed(0)
    return GPT(layers=4, d=64), (torch.randint(0, 64, (8, 16)),)


def _one_mesh_needs(model, inputs) -> int:
    with pytest.raises(autopar.AutoparError) as info:
        autopar.plan(model, inputs, cluster="2xcpu", memory_limit=10**5, recompute="none")
    return info.value.needed_bytes


def test_a_pipeline_plan_lists_the_baselines_its_one_mesh_alternative_could_not_fit():
    model, inputs = _gpt()
    plan = autopar.plan(model, inputs, cluster=TWO_REGIONS, memory_limit=int(0.8 * _one_mesh_needs(model, inputs)),
                        recompute="none")  # stages keep their activations: compare like with like
    assert plan.family == "pipeline" and plan.stages
    assert plan.families["one_mesh"] == {"predicted_step_s": None, "feasible": False,
                                         "reason": "does not fit in memory"}
    assert plan.families["pipeline"]["predicted_step_s"] == plan.predicted_step_s
    assert {"ddp", "fsdp", "megatron_tp"} <= set(plan.baselines)
    for name in ("ddp", "fsdp", "megatron_tp"):
        assert plan.baselines[name]["feasible"] is False
        assert plan.baselines[name]["reason"] == "does not fit in memory"


def test_a_forced_family_still_lists_the_hand_written_baselines():
    model, inputs = _gpt()
    plan = autopar.plan(model, inputs, cluster=TWO_REGIONS, replicas=True)
    assert plan.family == "replicas" and set(plan.families) == {"replicas"}
    assert plan.baselines["ddp"]["feasible"] and plan.baselines["ddp"]["predicted_step_s"] > 0


def test_the_model_is_captured_once_per_batch_size(monkeypatch):
    seen = []
    real = graphs_module.capture

    def counting(model, inputs, compute_dtype=None, **options):
        seen.append(inputs[0].shape[0])
        return real(model, inputs, compute_dtype, **options)

    monkeypatch.setattr(graphs_module, "capture", counting)
    model, inputs = _gpt()
    plan = autopar.plan(model, inputs, cluster=TWO_REGIONS)
    assert set(plan.families) == {"one_mesh", "pipeline", "replicas"}
    # whole batch (one mesh), 4 rows (2 micro-batches, and each replica's share), 2 rows (4 micro-batches)…
    assert sorted(seen) == sorted(set(seen)) and 8 in seen and 4 in seen


def test_planning_records_no_source_lines_and_lowering_does():
    """The planner's graphs carry no per-node source lines (their recording is a fifth of
    export's time on a large model, and planning reads none); the graph lowering runs does, so
    ``pmodel.code`` still points at the model's lines."""
    from autopar.passes.capture import capture

    model, inputs = _gpt()
    planned = graphs_module.ModelGraphs(model, inputs).full.graph
    lowered = capture(model, inputs).graph
    ops = [n for n in planned.nodes if n.op == "call_function"]
    assert ops and not any(n.meta.get("stack_trace") for n in ops)
    assert any("models.py" in (n.meta.get("stack_trace") or "") for n in lowered.nodes)


class _Eager:
    """A family that reuses the one-mesh plan but claims to be twice as fast: adding a
    family is implementing the interface and registering it."""

    name = "eager"

    def unavailable(self, cluster, options):
        return None

    def plan(self, graphs, cluster, options):
        base = FAMILIES["one_mesh"].plan(graphs, cluster, options)
        return dataclasses.replace(base, family=self.name, predicted_step_s=base.predicted_step_s / 2)

    def lower(self, plan, model, loss_fn, captured=None):
        raise NotImplementedError


def test_a_registered_family_competes_and_the_fastest_wins(monkeypatch):
    monkeypatch.setitem(FAMILIES, "eager", _Eager())
    model, inputs = _gpt()
    plan = autopar.plan(model, inputs, cluster="2xcpu")
    assert plan.family == "eager"
    assert plan.families["eager"]["predicted_step_s"] == pytest.approx(plan.families["one_mesh"]["predicted_step_s"] / 2)
    assert plan.baselines["ddp"]["feasible"]  # costed on this cluster whichever family won


def test_lowering_dispatches_on_the_family_and_refuses_an_unknown_one():
    model, inputs = _gpt()
    plan = dataclasses.replace(autopar.plan(model, inputs, cluster="2xcpu"), family="zigzag")
    with pytest.raises(autopar.AutoparError, match="plan family 'zigzag' is not one this autopar knows"):
        lower_plan(plan, model, None)


def test_plan_files_accept_every_family_and_only_those():
    """plan_types checks plan.family against its own list (the plan layer sits below the
    planning layer): the two lists are one."""
    from autopar.plan_types import PLAN_FAMILIES

    assert tuple(FAMILIES) == PLAN_FAMILIES


def test_plan_files_accept_every_exchange_the_passes_make():
    from autopar.passes.context_parallel import BALANCED_CAUSAL
    from autopar.passes.expert_dispatch import EXPERT_DISPATCH
    from autopar.passes.sparse import SPARSE_ALLGATHER, TABLE_WISE
    from autopar.plan_types import NODE_EXCHANGES

    assert {SPARSE_ALLGATHER, TABLE_WISE, EXPERT_DISPATCH, BALANCED_CAUSAL} == set(NODE_EXCHANGES) - {""}
