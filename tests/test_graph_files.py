"""Graphs saved beside a plan (issue 24, autopar.planning.graph_file): a re-plan from the file
needs neither the model nor a trace and gives what a re-plan from the model gives; what cannot
be saved says so and writes nothing; the CLI writes and reads them beside the plan."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

import autopar
from autopar.errors import AutoparError
from autopar.planning.replan import known_bounds
from test_overlap import ResidualMLP
from test_replan import _no_trace


def test_a_plan_s_saved_graphs_replan_it_as_the_model_does_without_the_model(tmp_path, monkeypatch):
    """The graphs saved beside a plan (every batch size the search captured: the whole batch,
    the pipeline's micro-batches, the replica groups' shares) re-plan it for a 1000× slower WAN
    link from the file alone — no model, no trace — to the plan, switch and migration a
    re-plan from the model gives."""
    import autopar.planning.graphs
    from autopar.cluster import Cluster
    from autopar.planning.graph_file import graphs_path

    model, x = ResidualMLP(64, 4), torch.randn(32, 64)
    cluster = Cluster.from_spec(str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml"))
    old = autopar.plan(model, (x,), cluster=cluster)
    assert old.graphs.captured_rows()  # micro-batches and shares were captured too
    path = tmp_path / "plan.json"
    old.save(path)
    assert autopar.save_graphs(old, graphs_path(path)) is None
    slow = cluster.with_link("a-b", 1e6)
    from_model = autopar.replan(old, slow, model, (x,))
    monkeypatch.setattr(autopar.planning.graphs, "capture", _no_trace)
    answer = autopar.replan(autopar.load_plan(path), slow, graphs=tmp_path / "plan.graphs.zip")
    assert answer.plan.to_json() == from_model.plan.to_json()
    assert (answer.switch, answer.migration_bytes, answer.previous_step_s) == \
        (from_model.switch, from_model.migration_bytes, from_model.previous_step_s)
    with pytest.raises(AutoparError, match="needs the graph at 3 rows"):
        answer.plan.graphs.at_rows(3)  # a cut the first search never made: only the model can give it
    with pytest.raises(AutoparError, match="not both"):
        autopar.replan(old, slow, model, (x,), graphs=tmp_path / "plan.graphs.zip")


def test_saved_graphs_keep_the_ids_each_lookup_read():
    """A GPT's token embedding is costed from the ids of the example batch (passes.sparse):
    they are saved with the graph, so the re-plan from the file costs the lookups as the one
    from the model does, and carries the old search's mesh bounds as the re-plan from the
    plan's own graphs does (the densities are the plan's)."""
    import tempfile

    from models import GPT

    torch.manual_seed(0)
    model, x = GPT(vocab=512, d=64, layers=2), torch.randint(0, 16, (16, 16))  # few distinct ids
    old = autopar.plan(model, (x,), cluster="2x2xH100")
    with tempfile.TemporaryDirectory() as folder:
        saved = pathlib.Path(folder) / "gpt.graphs.zip"
        assert autopar.save_graphs(old, saved) is None
        slower = autopar.Cluster.from_spec("2x2xH100").with_link("inter_node", 1e8)
        from_file = autopar.replan(old, slower, graphs=saved)
    from_model = autopar.replan(old, slower, model, (x,))
    in_process = autopar.replan(old, slower)
    from autopar.passes.sparse import LOOKUP_KEY

    ids = [node.meta[LOOKUP_KEY].indices for node in from_file.plan.graphs.full.graph.nodes if LOOKUP_KEY in node.meta]
    assert ids and all(t is not None and int(t.max()) < 16 for t in ids)
    assert from_file.plan.to_json() == in_process.plan.to_json()
    assert from_file.plan.predicted_step_s == pytest.approx(from_model.plan.predicted_step_s, rel=1e-9)
    assert known_bounds(from_file.plan.graphs, old, slower) is not None
    assert known_bounds(from_model.plan.graphs, old, slower) is None  # other ids may have been captured


def test_graphs_of_a_model_with_experts_are_not_saved(tmp_path):
    import models

    model, x = models.GatheredMoE(experts=4), torch.randn(32, 32)
    plan = autopar.plan(model, (x,), cluster="2xcpu")
    why = autopar.save_graphs(plan, tmp_path / "moe.graphs.zip")
    assert "expert layers" in why and not (tmp_path / "moe.graphs.zip").exists()


def test_the_cli_saves_a_plan_s_graphs_and_replans_from_them(tmp_path, capsys):
    """``autopar plan -o plan.json`` writes plan.graphs.zip beside it; ``autopar replan
    plan.json --cluster …`` then needs no model. With ``--no-graphs`` there is none, and a
    re-plan without the model says what to give."""
    from autopar.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "models:tiny_mlp", "--cluster", "4xcpu", "-o", str(path)]) == 0
    assert (tmp_path / "plan.graphs.zip").is_file()
    assert (tmp_path / "plan.graphs.zip").stat().st_mode == path.stat().st_mode  # the user's own, as the plan's
    capsys.readouterr()
    assert main(["replan", str(path), "--cluster", "2xcpu", "--json", "-o", str(tmp_path / "two.json")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["replan"]["switch"] and autopar.load_plan(tmp_path / "two.json").num_devices == 2
    assert (tmp_path / "two.graphs.zip").is_file()
    bare = tmp_path / "bare.json"
    assert main(["plan", "models:tiny_mlp", "--cluster", "4xcpu", "-o", str(bare), "--no-graphs"]) == 0
    assert not (tmp_path / "bare.graphs.zip").exists()
    capsys.readouterr()
    assert main(["replan", str(bare), "--cluster", "2xcpu"]) == 2
    assert "no graphs saved beside" in capsys.readouterr().err
