"""The weights an FSDP step holds gathered (issue 20): a sharded weight gathered for use lives
while its layer runs, and so do the weights prefetched for the next ``prefetch_layers``
layers — in forward and again in backward. The plan counts them (``memory.gathered_bytes``,
in the ILP's memory row) and the lowered program holds what it counts."""

from __future__ import annotations

import torch

import autopar
from distributed import run_world
from live_memory import PeakGathered
from test_overlap import _model_and_reference


def _gathered_worker():
    """Per prefetch depth: the gathered bytes the plan counts, and the most one FSDP step of a
    4-layer ResidualMLP (two 256×256 weights and biases per layer) holds at once on this rank."""
    found = {}
    for depth in (0, 1, 2):
        model, x, target, _ = _model_and_reference(4, 1024)
        pmodel = autopar.parallelize(model, (x,), loss_fn=torch.nn.functional.mse_loss, configuration="fsdp",
                                     prefetch_layers=depth)
        pmodel.step(x, target=target)  # the first step builds the program; the second is measured
        watch = PeakGathered()
        with watch:
            pmodel.step(x, target=target)
        found[depth] = (pmodel.plan.memory.gathered_bytes, watch.peak_bytes)
    return found


def test_an_fsdp_step_holds_the_gathered_weights_its_plan_counts():
    """One layer's weights gathered whole are 2·(256² + 256)·4 bytes on each of 2 ranks. With
    prefetch depth d the plan counts d + 1 layers of them, and the step holds exactly that at its
    peak; with depth 0 each weight is gathered when needed: the plan's one layer bounds what
    the step holds (one weight and its bias)."""
    layer = 2 * (256 * 256 + 256) * 4
    found = run_world(2, _gathered_worker)
    assert found[1] == (2 * layer, 2 * layer), found
    assert found[2] == (3 * layer, 3 * layer), found
    predicted, measured = found[0]
    assert predicted == layer and layer // 2 <= measured <= predicted, found


def test_a_memory_limit_counts_the_gathered_weights():
    """Below the FSDP plan's memory by half its gathered weights, the same parameter placements
    still fit — by computing on sharded weights where gathering them held too much: the
    solver counts the gathered weights against the limit."""
    model, x, _, _ = _model_and_reference(4, 1024)
    fsdp = autopar.plan(model, (x,), cluster="2xcpu", configuration="fsdp")
    assert fsdp.memory.gathered_bytes > 0
    limit = fsdp.memory.total_bytes - fsdp.memory.gathered_bytes // 2
    tight = autopar.plan(model, (x,), cluster="2xcpu", configuration="fsdp", memory_limit=limit)
    assert tight.memory.total_bytes <= limit
    assert tight.memory.gathered_bytes < fsdp.memory.gathered_bytes
    assert tight.predicted_step_s >= fsdp.predicted_step_s * (1 - 1e-12)  # memory is never free
