"""Re-planning for a changed cluster (issue 24): the new plan equals a fresh one, and the
answer says what switching costs — the state each device must receive, its time, and after
how many steps the faster step pays it back."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar import placements as pl
from autopar.errors import AutoparError
from autopar.planning.migration import piece, received_elements
from test_overlap import ResidualMLP


def _model():
    with torch.device("meta"):
        return ResidualMLP(4096, 4), torch.randn(1024, 4096)


def _cluster(tmp_path, gbps: float) -> str:
    """Four H100 in one host whose links run at ``gbps`` GB/s."""
    path = tmp_path / f"h100-{gbps}.yaml"
    path.write_text(f"device: H100\nnodes: 1\nper_node: 4\nintra_node: {{bandwidth_GBps: {gbps}, latency_us: 2}}\n")
    return str(path)


@pytest.mark.parametrize("shape, mesh, spec, rank, box", [
    ((10, 6), (4,), "S(0)", 3, ((9, 10), (0, 6))),  # torch.chunk's sizes: 3, 3, 3, 1
    ((10, 6), (4,), "R", 2, ((0, 10), (0, 6))),
    ((8, 6), (2, 2), "S(0),S(1)", 3, ((4, 8), (3, 6))),  # rank 3 = mesh coordinate (1, 1)
    ((8, 6), (2, 2), "S(0),S(0)", 1, ((2, 4), (0, 6))),  # both mesh dims cut rows, the outer first
    ((4, 6), (8,), "S(0)", 6, ((4, 4), (0, 6))),  # more devices than rows: an empty piece
])
def test_a_device_holds_the_box_dtensor_gives_it(shape, mesh, spec, rank, box):
    assert piece(shape, mesh, pl.parse_spec(spec), rank) == box


def test_a_device_receives_its_new_piece_less_what_it_holds():
    shape = (8, 6)
    sharded, whole = ((4,), pl.parse_spec("S(0)")), ((4,), pl.parse_spec("R"))
    assert received_elements(shape, sharded, whole, rank=1, old_ranks=4) == 6 * 6  # gathers 3 of 4 row blocks
    assert received_elements(shape, whole, sharded, rank=1, old_ranks=4) == 0  # slices what it has
    columns = ((4,), pl.parse_spec("S(1)"))
    assert received_elements((8, 8), sharded, columns, rank=0, old_ranks=4) == 8 * 2 - 2 * 2  # all-to-all
    assert received_elements(shape, whole, whole, rank=5, old_ranks=4) == 8 * 6  # a new host holds nothing


def test_replan_from_fsdp_to_the_optimum_prices_the_gather_of_every_weight(tmp_path):
    """An FSDP plan re-planned on its own cluster becomes the optimum (DDP on compute-bound
    layers, test_overlap's golden case): every device gathers 3/4 of each weight and of its two
    AdamW states, and the faster step pays that back after the number of steps it says."""
    model, x = _model()
    old = autopar.plan(model, (x,), cluster="4xH100", mesh_shape=(4,), configuration="fsdp")
    answer = autopar.replan(old, "4xH100", model, (x,))
    fresh = autopar.plan(model, (x,), cluster="4xH100")
    assert answer.plan.predicted_step_s == pytest.approx(fresh.predicted_step_s, rel=1e-6)
    assert {p.placement for p in answer.plan.parameters.values()} == {"R"}
    assert answer.plan.baselines == {} and fresh.baselines  # a re-plan costs no hand-written baselines
    assert {p.placement for p in old.parameters.values()} == {"S(0)"}
    state = sum(p.bytes for p in old.parameters.values()) * 3  # fp32 master + AdamW's two moments
    assert answer.migration_bytes == state * 3 // 4 and answer.migration_exact
    assert answer.previous_step_s == pytest.approx(old.predicted_step_s, rel=1e-6)
    saved = answer.previous_step_s - answer.plan.predicted_step_s
    assert answer.switch and answer.break_even_steps == -(-answer.migration_s // saved)
    assert f"pays off after {answer.break_even_steps} steps" in answer.reason


def test_a_faster_link_changes_the_plan_and_a_slower_one_keeps_it(tmp_path):
    """Planned on a 0.5 GB/s link, re-planned when it runs at 300 GB/s: another plan, equal to
    a fresh one, and worth switching; re-planned on the same slow link again: keep it."""
    model, x = _model()
    slow, fast = _cluster(tmp_path, 0.5), _cluster(tmp_path, 300)
    old = autopar.plan(model, (x,), cluster=slow, mesh_shape=(4,))
    answer = autopar.replan(old, fast, model, (x,))
    assert answer.plan.predicted_step_s == pytest.approx(autopar.plan(model, (x,), cluster=fast).predicted_step_s,
                                                         rel=1e-6)
    assert answer.switch and answer.previous_step_s > 2 * answer.plan.predicted_step_s
    again = autopar.replan(old, slow, model, (x,))
    assert not again.switch and again.break_even_steps is None and "keep the old plan" in again.reason


def test_a_lost_host_means_switching_now(tmp_path):
    """Two of four devices gone: the old plan cannot run, the new one is for two devices."""
    model, x = _model()
    old = autopar.plan(model, (x,), cluster="4xH100")
    answer = autopar.replan(old, "2xH100", model, (x,))
    assert answer.plan.num_devices == 2 and answer.previous_step_s is None
    assert answer.switch and answer.break_even_steps == 0
    assert "runs on 4 devices, the cluster has 2" in answer.reason


def test_replan_refuses_another_model():
    model, x = _model()
    old = autopar.plan(model, (x,), cluster="4xH100")
    with torch.device("meta"):
        other = ResidualMLP(4096, 3)
    with pytest.raises(AutoparError, match="different graph"):
        autopar.replan(old, "4xH100", other, (x,))


def test_the_cli_replans_a_saved_plan(tmp_path, capsys):
    from autopar.cli import main

    from models import tiny_mlp

    path, out = tmp_path / "plan.json", tmp_path / "new.json"
    autopar.plan(*tiny_mlp(), cluster="4xcpu").save(path)
    assert main(["replan", str(path), "models:tiny_mlp", "--cluster", "2xcpu", "-o", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["replan"]["switch"] and shown["replan"]["break_even_steps"] == 0
    assert autopar.load_plan(out).num_devices == 2
