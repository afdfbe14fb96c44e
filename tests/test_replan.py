"""Re-planning for a changed cluster (issue 24): the new plan equals a fresh one, and the
answer says what switching costs — the state each device must receive, its time, and after
how many steps the faster step pays it back."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

import autopar
from autopar import placements as pl
from autopar.errors import AutoparError
from autopar.planning.migration import piece, received_elements
from autopar.planning.replan import known_bounds, link_speedup
from test_overlap import ResidualMLP


def _model():
    with torch.device("meta"):
        return ResidualMLP(4096, 4), torch.randn(2048, 4096)


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
    """An FSDP plan re-planned on its own cluster becomes the optimum over 1-D meshes (DDP on
    compute-bound layers, test_overlap's golden case; the re-plan searches as many mesh dims as
    the plan did): every device gathers 3/4 of each weight and of its two AdamW states, and the
    faster step pays that back after the number of steps it says."""
    model, x = _model()
    old = autopar.plan(model, (x,), cluster="4xH100", mesh_dims=1, configuration="fsdp")
    answer = autopar.replan(old, "4xH100", model, (x,))
    fresh = autopar.plan(model, (x,), cluster="4xH100", mesh_dims=1)
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


def test_the_old_plan_is_costed_on_the_problem_the_search_built_for_its_mesh(tmp_path, monkeypatch):
    """A re-plan prices the old one-mesh plan on the new cluster from the search's own problem
    of its mesh (built first, as the warm start's) — no second build — and that equals costing
    it afresh (planning.costing.recost); a 4-layer model folds its layers there, which the old
    plan's placements follow."""
    import autopar.planning.replan as replan_module
    from autopar.cluster import Cluster
    from autopar.passes.capture import capture
    from autopar.planning.costing import recost

    model, x = _model()
    old = autopar.plan(model, (x,), cluster=_cluster(tmp_path, 300), mesh_shape=(4,), configuration="fsdp")
    slow = _cluster(tmp_path, 0.5)
    rebuilt = []
    monkeypatch.setattr(replan_module, "recost", lambda *args: rebuilt.append(args) or recost(*args))
    answer = autopar.replan(old, slow, model, (x,))
    assert rebuilt == []  # costed from the search's problem
    step_s, _ = recost(capture(model, (x,)), old, Cluster.from_spec(slow))
    assert answer.previous_step_s == pytest.approx(step_s, rel=1e-9)
    assert answer.previous_step_s > old.predicted_step_s  # the link got slower


def test_a_lost_host_means_switching_now(tmp_path):
    """Two of four devices gone: the old plan cannot run, the new one is for two devices."""
    model, x = _model()
    old = autopar.plan(model, (x,), cluster="4xH100")
    answer = autopar.replan(old, "2xH100", model, (x,))
    assert answer.plan.num_devices == 2 and answer.previous_step_s is None
    assert answer.switch and answer.break_even_steps == 0
    assert "runs on 4 devices, the cluster has 2" in answer.reason


def _two_hosts(tmp_path, gbps: float) -> str:
    """Two hosts of four H100 whose network runs at ``gbps`` GB/s."""
    path = tmp_path / f"2x4-{gbps}.yaml"
    path.write_text(f"device: H100\nnodes: 2\nper_node: 4\ninter_node: {{bandwidth_GBps: {gbps}, latency_us: 20}}\n")
    return str(path)


def test_how_much_faster_any_link_got():
    """link_speedup: 1 when no link got faster; the factor of the one that did, by bandwidth,
    latency or collective efficiency; None where no factor holds (a latency gone to zero,
    other links)."""
    cluster = autopar.Cluster.from_spec("2x8xA100-80GB")
    recorded = cluster.plan_header()["links"]
    inter, intra = cluster.inter_link, cluster.intra_link
    assert link_speedup(recorded, cluster) == 1.0
    assert link_speedup(recorded, cluster.with_link("inter_node", inter.bandwidth_Bps / 10)) == 1.0
    assert link_speedup(recorded, cluster.with_link("inter_node", inter.bandwidth_Bps * 4)) == pytest.approx(4.0)
    assert link_speedup(recorded, cluster.with_link("intra_node", intra.bandwidth_Bps, intra.latency_s / 2)) \
        == pytest.approx(2.0)
    assert link_speedup(recorded, cluster.with_link("intra_node", intra.bandwidth_Bps, 0.0)) is None
    inefficient = dataclasses.replace(cluster, inter_link=dataclasses.replace(
        inter, collective_efficiency=(("all_gather", 0.5),)))
    assert link_speedup(inefficient.plan_header()["links"], cluster) == pytest.approx(2.0)
    assert link_speedup(recorded, inefficient) == 1.0
    assert link_speedup({**recorded, "a-b": recorded["inter_node"]}, cluster) is None
    assert link_speedup(None, cluster) is None  # a plan from before links were recorded


def test_a_slower_link_prunes_meshes_by_the_old_bounds_without_building_them(tmp_path, monkeypatch):
    """The old search's bound on each mesh still bounds it when links only got slower (and,
    over the speed-up, when one got faster): a re-plan for a 10× slower network builds the
    problem of the old plan's mesh alone, prunes the others by the bounds the old plan
    recorded, and gives the plan a fresh search gives. Each reused bound is at most the one
    the fresh search computes on that mesh."""
    import autopar.planning.one_mesh as one_mesh

    model, x = _model()
    old = autopar.plan(model, (x,), cluster=_two_hosts(tmp_path, 5))
    assert [c["status"] for c in old.mesh_candidates].count("PRUNED") == 2
    built = []
    monkeypatch.setattr(one_mesh.MeshSearch, "_problem",
                        lambda self, mesh, _was=one_mesh.MeshSearch._problem, **kw:
                        built.append(tuple(mesh.shape)) or _was(self, mesh, **kw))
    for gbps, only_the_old_mesh in ((0.5, True), (50, False)):
        cluster = _two_hosts(tmp_path, gbps)
        built.clear()
        answer = autopar.replan(old, cluster)
        assert (built == [tuple(old.mesh_shape)]) is only_the_old_mesh
        fresh = autopar.plan(model, (x,), cluster=cluster)
        assert answer.plan.predicted_step_s == pytest.approx(fresh.predicted_step_s, rel=1e-6)
        reused = dict(known_bounds(old.graphs, old, autopar.Cluster.from_spec(cluster)).bounds)
        assert len(reused) == 3
        for candidate in fresh.mesh_candidates:
            assert reused[tuple(candidate["mesh_shape"])] <= candidate["bound_s"] * (1 + 1e-9)


def test_old_bounds_are_not_reused_where_more_than_links_changed(tmp_path):
    """Another memory limit, device count or device kind is another problem: no bound carries
    over; nor from a pinned configuration's plan (its bounds are that configuration's)."""
    model, x = _model()
    old = autopar.plan(model, (x,), cluster=_two_hosts(tmp_path, 5))
    same = autopar.Cluster.from_spec(_two_hosts(tmp_path, 5))
    assert known_bounds(old.graphs, old, same) is not None
    for other in (autopar.Cluster.from_spec(_two_hosts(tmp_path, 5), memory_limit_bytes=40e9),
                  autopar.Cluster.from_spec("2x4xA100-80GB"), autopar.Cluster.from_spec("8xH100")):
        assert known_bounds(old.graphs, old, other) is None
    pinned = autopar.plan(model, (x,), cluster=_two_hosts(tmp_path, 5), configuration="fsdp")
    assert pinned.options["configuration"] == "fsdp"
    assert known_bounds(pinned.graphs, pinned, same) is None


def test_a_plan_of_sparse_tables_carries_its_bounds_only_to_the_graphs_it_was_made_from():
    """Sparse-table costs follow the densities the graphs were annotated with: the same graphs
    carry the bounds over; graphs captured anew (perhaps with other densities) do not."""
    from autopar.planning import ModelGraphs
    from test_sparse import LanguageHead

    with torch.device("meta"):
        model = LanguageHead(100_000, 256)
    tokens = torch.zeros(64, 128, dtype=torch.long, device="meta")
    cluster = autopar.Cluster.from_spec("8xA100-80GB")
    plan = autopar.plan(model, (tokens,), cluster=cluster, sparsity={"emb.weight": 0.01})
    assert plan.sparse
    assert known_bounds(plan.graphs, plan, cluster) is not None
    assert known_bounds(ModelGraphs(model, (tokens,)), plan, cluster) is None


def test_replan_refuses_another_model():
    model, x = _model()
    old = autopar.plan(model, (x,), cluster="4xH100")
    with torch.device("meta"):
        other = ResidualMLP(4096, 3)
    with pytest.raises(AutoparError, match="different graph"):
        autopar.replan(old, "4xH100", other, (x,))


def test_a_plan_made_here_replans_from_its_own_graphs_without_the_model(tmp_path, monkeypatch):
    """``autopar.replan(plan, cluster)``: a plan made in this process keeps the graphs it was
    planned from, so re-planning needs neither the model nor a new trace, and gives the plan a
    re-plan from the model gives; the graphs go neither into the file nor over a pickle (to
    other ranks), and a plan read back asks for the model by name."""
    import pickle

    import autopar.planning.graphs

    model, x = _model()
    slow, fast = _cluster(tmp_path, 0.5), _cluster(tmp_path, 300)
    old = autopar.plan(model, (x,), cluster=slow, mesh_shape=(4,))
    from_model = autopar.replan(old, fast, model, (x,))
    monkeypatch.setattr(autopar.planning.graphs, "capture", _no_trace)
    answer = autopar.replan(old, fast)
    assert answer.plan.graphs is old.graphs  # and the next re-plan reuses them again
    assert answer.plan.to_json() == from_model.plan.to_json() and answer.switch == from_model.switch
    assert answer.migration_bytes == from_model.migration_bytes
    assert pickle.loads(pickle.dumps(old)).graphs is None and pickle.loads(pickle.dumps(old)) == old
    old.save(tmp_path / "old.json")
    with pytest.raises(AutoparError, match="pass the model and its example inputs"):
        autopar.replan(autopar.load_plan(tmp_path / "old.json"), fast)
    with pytest.raises(AutoparError, match="together with its example inputs"):
        autopar.replan(old, fast, model)


def _no_trace(*args, **kwargs):
    raise AssertionError("re-planned from the model: it was traced again")


def test_the_cli_replans_a_saved_plan(tmp_path, capsys):
    from autopar.cli import main

    from models import tiny_mlp

    path, out = tmp_path / "plan.json", tmp_path / "new.json"
    autopar.plan(*tiny_mlp(), cluster="4xcpu").save(path)
    assert main(["replan", str(path), "models:tiny_mlp", "--cluster", "2xcpu", "-o", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["replan"]["switch"] and shown["replan"]["break_even_steps"] == 0
    assert autopar.load_plan(out).num_devices == 2


def test_one_link_of_a_cluster_can_change(tmp_path):
    """``--link``: a WAN link between two regions (names may hold '-'), or the links inside
    hosts or between them, at a new bandwidth and, if given, latency; anything else is refused
    with the links there are."""
    from autopar.cluster import Cluster
    from autopar.cluster_file import parse_link_change

    path = tmp_path / "wan.yaml"
    path.write_text("regions:\n  us-east: {device: H100, nodes: 1, per_node: 8}\n"
                    "  eu-west: {device: H100, nodes: 1, per_node: 8}\n"
                    "links:\n  - {between: [us-east, eu-west], bandwidth_GBps: 1.25, latency_ms: 40}\n")
    cluster = Cluster.from_spec(str(path))
    slow = cluster.with_link(*parse_link_change("eu-west-us-east=1Gbps"))
    assert slow.wan_link("us-east", "eu-west").bandwidth_Bps == 1.25e8
    assert slow.wan_link("us-east", "eu-west").latency_s == pytest.approx(0.04)  # kept
    faster = cluster.with_link(*parse_link_change("intra_node=450GBps@1us"))
    assert faster.intra_link.bandwidth_Bps == 450e9 and faster.intra_link.latency_s == pytest.approx(1e-6)
    assert all(sub.intra_link == faster.intra_link for _, sub in faster.region_clusters)
    with pytest.raises(AutoparError, match="no link 'us-east-asia' to change.*WAN links: us-east-eu-west"):
        cluster.with_link(*parse_link_change("us-east-asia=1GBps"))
    with pytest.raises(AutoparError, match="expected WHICH=BANDWIDTH"):
        parse_link_change("us-east-eu-west=fast")


def test_the_cli_replans_for_a_slower_wan_link(tmp_path, capsys):
    """``autopar replan … --link a-b=…``: the same regions with their WAN link 100x slower; the
    old plan costs more there, and the new plan is no slower than it."""
    from autopar.cli import main

    from models import tiny_mlp

    cluster = str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml")
    path = tmp_path / "plan.json"
    old = autopar.plan(*tiny_mlp(), cluster=cluster, configuration="ddp")  # gradients all-reduced over the WAN
    old.save(path)
    assert main(["replan", str(path), "models:tiny_mlp", "--cluster", cluster, "--link", "a-b=0.01GBps@1ms",
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["replan"]
    assert shown["previous_step_s"] > old.predicted_step_s
    assert shown["predicted_step_s"] <= shown["previous_step_s"] * (1 + 1e-9)
    assert main(["replan", str(path), "models:tiny_mlp", "--cluster", cluster, "--link", "a-c=1GBps"]) == 2
    assert "no link 'a-c' to change" in capsys.readouterr().err


def test_a_pipeline_plan_is_recosted_on_the_changed_links():
    """A pipeline over two regions keeps its cuts and micro-batches on the changed cluster:
    re-costed on the same cluster it costs what it predicted; with its WAN link 1000x slower
    its sends cost more, and the answer compares the re-plan with that."""
    from autopar.cluster import Cluster
    from autopar.planning import ModelGraphs, PlanOptions
    from autopar.planning.pipeline import recost_pipeline

    model, x = ResidualMLP(64, 4), torch.randn(32, 64)
    cluster = Cluster.from_spec(str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml"))
    old = autopar.plan(model, (x,), cluster=cluster, pipeline=True)
    assert old.family == "pipeline"
    graphs = ModelGraphs(model, (x,))
    same = recost_pipeline(graphs, old, cluster, PlanOptions.of_plan(old))
    assert same == pytest.approx(old.predicted_step_s, rel=1e-9)
    slow = cluster.with_link("a-b", 1e6)
    answer = autopar.replan(old, slow, model, (x,))
    assert answer.previous_step_s > old.predicted_step_s
    assert answer.plan.predicted_step_s <= answer.previous_step_s * (1 + 1e-9)
    with pytest.raises(AutoparError, match="its stages run on groups"):
        recost_pipeline(graphs, old, Cluster.from_spec("2xcpu"), PlanOptions.of_plan(old))


def test_a_wan_change_replans_pipeline_and_replicas_from_the_group_plans_already_made(monkeypatch):
    """A device group's own cluster holds no WAN link: a re-plan for a WAN link 1000× slower
    finds the pipeline chunks' and replica groups' intra-operator plans the first search made
    and searches only those it had not needed (far fewer group searches than a fresh search
    on the slow cluster runs); every family predicts what the fresh search's does."""
    from autopar.cluster import Cluster
    import autopar.planning.one_mesh as one_mesh

    model, x = ResidualMLP(64, 4), torch.randn(32, 64)
    cluster = Cluster.from_spec(str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml"))
    old = autopar.plan(model, (x,), cluster=cluster)
    slow = cluster.with_link("a-b", 1e6)
    group_searches = []
    monkeypatch.setattr(one_mesh.MeshSearch, "best", lambda self, _was=one_mesh.MeshSearch.best:
                        group_searches.append(self.cluster.num_devices < cluster.num_devices) or _was(self))
    fresh = autopar.plan(model, (x,), cluster=slow)
    in_fresh = sum(group_searches)
    group_searches.clear()
    answer = autopar.replan(old, slow)
    assert sum(group_searches) <= in_fresh // 4
    assert {"pipeline", "replicas"} <= set(fresh.families)
    for family, entry in fresh.families.items():
        assert answer.plan.families[family]["predicted_step_s"] == pytest.approx(entry["predicted_step_s"],
                                                                                 rel=1e-9), family
    assert answer.plan.predicted_step_s == pytest.approx(fresh.predicted_step_s, rel=1e-9)
    assert fresh.families["pipeline"]["predicted_step_s"] > old.families["pipeline"]["predicted_step_s"]
    # whichever family won, the one-mesh search's bounds travel with the plan
    assert old.families["one_mesh"]["mesh_bounds"]["bounds"]
    assert known_bounds(old.graphs, old, slow) is not None


def test_a_replan_keeps_a_pinned_micro_batch_count_and_schedule():
    """Micro-batches and schedule pinned by the user are part of the training setup: the plan
    records them and a re-plan searches with them, as a fresh plan with the same pins does."""
    from autopar.cluster import Cluster
    from autopar.planning import PlanOptions

    model, x = ResidualMLP(64, 4), torch.randn(32, 64)
    cluster = Cluster.from_spec(str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml"))
    pins = {"micro_batches": 4, "schedule": "GPipe"}
    old = autopar.plan(model, (x,), cluster=cluster, pipeline=True, **pins)
    assert {k: old.options[k] for k in pins} == pins
    assert (PlanOptions.of_plan(old).micro_batches, PlanOptions.of_plan(old).schedule) == (4, "GPipe")
    slow = cluster.with_link("a-b", 1e6)
    answer = autopar.replan(old, slow)
    fresh = autopar.plan(model, (x,), cluster=slow, **pins)
    assert answer.plan.families["pipeline"]["predicted_step_s"] == pytest.approx(
        fresh.families["pipeline"]["predicted_step_s"], rel=1e-9)


def test_a_replica_plan_replans_at_the_rows_its_groups_share():
    """A replica plan's graph is its largest group's share of the batch: replan checks the
    model against that graph, not the whole batch's."""
    from autopar.cluster import Cluster

    model, x = ResidualMLP(64, 4), torch.randn(32, 64)
    cluster = Cluster.from_spec(str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml"))
    old = autopar.plan(model, (x,), cluster=cluster, replicas=True, batch_split=(24, 8))
    assert old.family == "replicas"
    answer = autopar.replan(old, cluster.with_link("a-b", 1e6), model, (x,))
    assert answer.previous_step_s is None and answer.switch  # replica groups are not re-costed yet
    assert answer.plan.predicted_step_s > 0
