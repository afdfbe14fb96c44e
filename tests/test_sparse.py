"""Sparse parameters (issue 7): access density, exchange choice and Parallax's closed-form
volumes, and the DLRM equivalence in real gloo processes (embedding bags themselves:
tests/test_embedding_bags.py)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from rich.console import Console
from torch import nn

import autopar
import models
from autopar.cli_commands import summary_json
from autopar.cluster import Cluster
from autopar.comm import all_to_all_s
from autopar.mesh import checked_mesh
from autopar.errors import AutoparError, ErrorKind
from autopar.passes.capture import capture
from autopar.passes.sparse import LOOKUP_KEY, annotate_lookups
from autopar.planning.costing import communication_bytes, recost
from autopar.report import sparse_table
from distributed import run_world
from equivalence import assert_equivalent, run_cases


def _lookups(model, inputs, sparsity=None) -> dict:
    captured = capture(model, inputs)
    annotate_lookups(captured, inputs, sparsity)
    return {n.meta[LOOKUP_KEY].parameter: n.meta[LOOKUP_KEY] for n in captured.graph.nodes if LOOKUP_KEY in n.meta}


def test_touched_rows_come_from_user_inputs_or_uniform_draws():
    model = models.DLRM(tables=(1000, 64))
    dense, ids = models.dlrm_inputs(model, batch=32, bag=4, hot=6)
    measured = _lookups(model, (dense, ids))
    big = measured["embeddings.0.weight"]
    assert big.source == "inputs" and big.rows == 1000 and big.lookups == 32 * 4
    assert big.touched_rows(1) == ids[0].unique().numel() <= 6
    assert big.touched_rows(2) == max(p.unique().numel() for p in ids[0].chunk(2))
    user = _lookups(model, (dense, ids), {"embeddings.0.weight": 0.25})["embeddings.0.weight"]
    assert user.source == "user" and user.touched_rows(4) == 250
    # fake inputs carry no values: uniform random access, R·(1 − (1 − 1/R)^k) rows
    with torch._subclasses.FakeTensorMode() as mode:
        fake = (mode.from_tensor(dense), mode.from_tensor(ids))
    uniform = _lookups(model, fake)["embeddings.0.weight"]
    assert uniform.source == "uniform"
    assert uniform.touched_rows(2) == math.ceil(1000 * (1 - (1 - 1 / 1000) ** 64))


def test_sparsity_errors_name_the_table():
    model = models.DLRM(tables=(100, 10))
    inputs = models.dlrm_inputs(model, batch=4)
    with pytest.raises(AutoparError, match=r"sparsity\['embeddings.0.weight'\] = 1.5") as info:
        autopar.plan(model, inputs, cluster="2xcpu", sparsity={"embeddings.0.weight": 1.5})
    assert info.value.kind is ErrorKind.BAD_INPUT
    with pytest.raises(AutoparError, match="bottom.0.weight, which is not a sparse table.*embeddings.0.weight"):
        autopar.plan(model, inputs, cluster="2xcpu", sparsity={"bottom.0.weight": 0.1})


class LanguageHead(nn.Module):
    """A token embedding and a small dense head: one big sparse table."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 8)

    def forward(self, tokens):
        return self.head(self.emb(tokens)).sum(1)


def test_golden_large_sparse_table_is_not_all_reduced_and_bytes_match_parallax():
    vocab, dim, n, alpha = 1_000_000, 1024, 8, 0.001
    with torch.device("meta"):
        model = LanguageHead(vocab, dim)
    tokens = torch.zeros(64, 128, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (tokens,), cluster="8xA100-80GB", mesh_shape=(8,), sparsity={"emb.weight": alpha})
    exchange = plan.parameters["emb.weight"].exchange
    # any of Parallax's sparse forms or a sharded table; never a dense all-reduce of 4 GB
    assert exchange in ("sparse_allgather", "row_sharded", "column_sharded"), exchange
    table = plan.sparse["emb.weight"]
    w = vocab * dim * 4
    touched = math.ceil(alpha * vocab)
    assert table["touched_rows"] == touched and table["density_source"] == "user"
    volumes = table["bytes_per_step"]
    assert volumes["allreduce"] == pytest.approx(2 * w * (n - 1) / n, rel=0.01)  # Parallax: dense all-reduce
    # Parallax: sparse exchange (n − 1)·α·w (plus the row ids that travel with the rows)
    assert volumes["sparse_allgather"] == pytest.approx((n - 1) * alpha * w, rel=0.01)
    assert volumes["sparse_allgather"] < volumes["allreduce"] / 50
    summary = summary_json(plan)  # the CLI's stable keys
    assert summary["parameters"]["emb.weight"]["exchange"] == exchange


def test_golden_small_dense_like_table_stays_replicated():
    model = LanguageHead(16, 32)
    tokens = torch.arange(16).repeat(64, 1)  # every row touched by every device: α = 1
    plan = autopar.plan(model, (tokens,), cluster="8xA100-80GB", mesh_shape=(8,))
    assert plan.sparse["emb.weight"]["density"] == 1.0
    assert plan.parameters["emb.weight"].placement == "R"
    assert plan.parameters["emb.weight"].exchange in ("allreduce", "none")


def test_dlrm_plan_places_big_tables_table_wise_and_beats_ddp():
    """Bags of 16-wide rows: each big table whole on one device, its pooled bags sent in one
    all-to-all (the latency paid once for all tables) — cheaper than exchanging touched rows
    here; wider rows tip it to the sparse exchange. Tiny tables stay replicated."""
    model = models.DLRM(tables=(50000, 4096, 64, 16), dim=16, hidden=256)
    inputs = models.dlrm_inputs(model, batch=512)
    plan = autopar.plan(model, inputs, cluster="4xcpu", mesh_shape=(4,), pipeline=False, replicas=False)
    big = ["embeddings.0.weight", "embeddings.1.weight"]
    assert [plan.parameters[t].exchange for t in big] == ["table_wise"] * 2
    assert [plan.parameters[t].placement for t in big] == ["O"] * 2
    assert sorted(plan.sparse[t]["owner"] for t in big) == [0, 1]  # one each: the all-to-all waits for the busiest
    assert plan.parameters["embeddings.3.weight"].exchange not in ("table_wise", "sparse_allgather")
    console = Console(width=220, record=True)
    console.print(sparse_table(plan))  # what `autopar show` prints
    assert "table_wise (device 0)" in console.export_text()
    wide = models.DLRM(tables=(50000, 4096, 64, 16), dim=256, hidden=64)  # wide rows: touched rows exchanged
    wide_plan = autopar.plan(wide, models.dlrm_inputs(wide, batch=512), cluster="4xcpu", mesh_shape=(4,),
                             pipeline=False, replicas=False)
    assert wide_plan.parameters["embeddings.0.weight"].exchange == "sparse_allgather"
    assert plan.predicted_step_s < plan.baselines["ddp"]["predicted_step_s"]
    again = autopar.Plan.from_json(plan.to_json())
    assert again.sparse == plan.sparse and again.parameters == plan.parameters
    # bytes a device sends per step: recorded in the plan (folded problem) = recounted unfolded
    captured = capture(model, inputs)
    annotate_lookups(captured, inputs)
    recounted = communication_bytes(captured, plan, Cluster.from_spec("4xcpu"))
    assert plan.comm_bytes == pytest.approx(recounted, rel=1e-9) and plan.comm_bytes > 0
    ddp = autopar.plan(model, inputs, cluster="4xcpu", configuration="ddp")
    assert ddp.comm_bytes > 10 * plan.comm_bytes  # the big tables' dense all-reduce
    # row-wise: 512·4 ids gathered (8 B each), the 512 pooled bags (one 16-float row each)
    # reduce-scattered and gathered back — (n−1)/n of each at n = 4; bags are pooled on the owner
    ids, pooled = 512 * 4 * 8, 512 * 16 * 4
    assert plan.sparse["embeddings.0.weight"]["bytes_per_step"]["row_sharded"] == pytest.approx(
        3 / 4 * (ids + 2 * pooled))
    # table-wise: each device sends 1/n of the owners' (n−1)/n of the pooled bags, forward and back
    assert plan.sparse["embeddings.0.weight"]["bytes_per_step"]["table_wise"] == pytest.approx(2 * 3 / 16 * pooled)


def test_table_wise_memory_is_the_busiest_owners():
    """A table-wise table counts 1/n on each device in the ILP; the plan's memory (and a
    re-costed one) is the busiest owner's, and a table no owner can hold is not placed
    table-wise however little its even share is."""
    model = models.DLRM(tables=(50000, 4096, 64, 16), dim=16, hidden=256)
    inputs = models.dlrm_inputs(model, batch=512)
    options = {"cluster": "4xcpu", "mesh_shape": (4,), "pipeline": False, "replicas": False}
    plan = autopar.plan(model, inputs, **options)
    big = plan.parameters["embeddings.0.weight"]
    assert big.exchange == "table_wise" and plan.sparse["embeddings.0.weight"]["owner"] == 0
    # the busiest device (table 0's owner) holds it whole, not table 1 (on another owner): not
    # a quarter of each, nor both whole
    second = plan.parameters["embeddings.1.weight"]
    assert second.exchange == "table_wise" and plan.sparse["embeddings.1.weight"]["owner"] != 0
    assert big.bytes <= plan.memory.params_bytes < big.bytes + second.bytes
    assert plan.memory.grads_bytes == plan.memory.params_bytes  # and its gradient, and two AdamW states
    assert plan.memory.optimizer_bytes == 2 * plan.memory.params_bytes
    captured = capture(model, inputs)
    annotate_lookups(captured, inputs)
    step, memory = recost(captured, plan, Cluster.from_spec("4xcpu"))
    assert memory == plan.memory.total_bytes and step == pytest.approx(plan.predicted_step_s, rel=1e-12)
    # the fused exchange waits for the busiest owner: owners 0 and 1 send one table's 512 pooled
    # 16-float bags each (32 KiB), 2 and 3 none: 16 KiB above the mean, forward and backward
    link = dataclasses.replace(checked_mesh(Cluster.from_spec("4xcpu"), (4,)).links[0], latency_s=0.0)
    spread = plan.predicted_step_s - plan.solver["objective_s"]
    assert spread == pytest.approx(2 * all_to_all_s(4 * (512 * 16 * 4 - 512 * 16 * 4 / 2), 4, link), rel=1e-9)
    # just enough memory for that owner: both big tables still table-wise (charging every
    # table whole on every device, as before, would not fit them both)
    fitted = autopar.plan(model, inputs, **options, memory_limit=plan.memory.total_bytes)
    assert [fitted.parameters[f"embeddings.{t}.weight"].exchange for t in (0, 1)] == ["table_wise"] * 2
    assert fitted.memory.total_bytes <= plan.memory.total_bytes
    # less than the big table whole: its even share would fit, its owner would not
    short = autopar.plan(model, inputs, **options, memory_limit=int(3.5 * big.bytes))
    assert short.parameters["embeddings.0.weight"].exchange != "table_wise"
    assert short.memory.total_bytes <= int(3.5 * big.bytes)
    # the same over every candidate mesh (a mesh solved again after the others were prepared)
    searched = autopar.plan(model, inputs, cluster="4xcpu", pipeline=False, replicas=False,
                            memory_limit=int(3.5 * big.bytes))
    assert searched.memory.total_bytes <= int(3.5 * big.bytes)


# The big-table cases run in float64: a hot row gathers ~340 gradient contributions, and the
# different summation order of the sparse exchange leaves float32 round-off of ~1e-4 there.
BIG_DLRM = {"tables": (50000, 4096, 64, 16), "dim": 16, "hidden": 256}
SPARSE_WORLD2 = [
    ("DLRM", BIG_DLRM, "dlrm", 512, {"cluster": "2xcpu", "pipeline": False, "replicas": False}, "float64"),  # table-wise
    ("DLRM", {**BIG_DLRM, "dim": 64}, "dlrm", 512, {"cluster": "2xcpu", "pipeline": False, "replicas": False},
     "float64"),  # touched rows all-gathered
    ("DLRM", {}, "dlrm", 8, {"cluster": "2xH100", "memory_fraction": 0.6}),  # column-sharded tables
    ("DLRM", {"dim": 5}, "dlrm", 8, {"cluster": "2xH100", "memory_fraction": 0.6}),  # odd dim: row-sharded
]
SPARSE_WORLD4 = [
    ("DLRM", BIG_DLRM, "dlrm", 512, {"cluster": "4xcpu", "mesh_shape": (4,), "pipeline": False, "replicas": False},
     "float64"),  # two tables table-wise on devices 0 and 1; 2 and 3 own none
    ("DLRM", BIG_DLRM, "dlrm", 512, {"cluster": "4xcpu", "mesh_shape": (2, 2), "pipeline": False,
                                     "replicas": False}, "float64"),  # touched rows all-gathered over both dims
    ("DLRM", {}, "dlrm", 8, {"cluster": "4xH100", "memory_fraction": 0.6}),
    ("DLRM", {"dim": 6}, "dlrm", 8, {"cluster": "4xH100", "memory_fraction": 0.5}),  # rows on one dim, columns on the other
]


@pytest.mark.distributed
def test_dlrm_equivalence_two_processes():
    exchanges = assert_equivalent(SPARSE_WORLD2, run_world(2, run_cases, SPARSE_WORLD2))
    assert {"table_wise", "sparse_allgather", "row_sharded", "column_sharded"} <= exchanges, exchanges


@pytest.mark.distributed
def test_dlrm_equivalence_four_processes_1d_and_2x2_mesh():
    exchanges = assert_equivalent(SPARSE_WORLD4, run_world(4, run_cases, SPARSE_WORLD4))
    assert {"table_wise", "sparse_allgather", "row_sharded", "column_sharded"} <= exchanges, exchanges


_WAN_REGIONS = """# {world} CPU processes in two regions joined by a slow WAN link
regions:
  a: {{device: cpu, nodes: 1, per_node: {per_region}}}
  b: {{device: cpu, nodes: 1, per_node: {per_region}}}
links:
  - {{between: [a, b], bandwidth_GBps: {wan_GBps}, latency_ms: 1}}
"""


def _wan_cluster(tmp_path, world: int, wan_GBps: float = 0.01) -> str:
    path = tmp_path / f"wan{world}.yaml"
    path.write_text(_WAN_REGIONS.format(world=world, per_region=world // 2, wan_GBps=wan_GBps))
    return str(path)


def test_replicas_send_a_sparse_table_between_groups_as_its_touched_rows(tmp_path):
    """Golden: replicas in two regions over a 10 MB/s WAN. The token table (8192 rows, 128 of
    them in the whole batch) crosses as an all-gather of the rows each group touched, at
    Parallax's volumes; the position table (16 rows, every one touched) is all-reduced."""
    torch.manual_seed(0)
    model = models.GPT(vocab=8192, layers=1)
    ids = torch.randint(0, 8192, (8, 16), generator=torch.Generator().manual_seed(1))
    plan = autopar.plan(model, (ids,), cluster=_wan_cluster(tmp_path, 2), replicas=True, batch_split=(6, 2))
    token, position = plan.sparse["tok.weight"], plan.sparse["pos.weight"]
    assert token["between_groups"] == "sparse_allgather" and position["between_groups"] == "allreduce"
    rows = max(ids[:6].unique().numel(), ids[6:].unique().numel())  # the busiest group's rows
    volumes = token["between_groups_bytes"]
    assert volumes["sparse_allgather"] == pytest.approx(rows * (32 * 4 + 8))  # (n−1) · u · (row + id), n = 2
    assert volumes["allreduce"] == pytest.approx(8192 * 32 * 4)  # 2 (n−1)/n · w
    # the same plan on a fast link keeps the table in the dense all-reduce (one latency less)
    fast = autopar.plan(model, (ids,), cluster=_wan_cluster(tmp_path, 2, wan_GBps=1000), replicas=True,
                        batch_split=(6, 2))
    assert fast.sparse["tok.weight"]["between_groups"] == "allreduce"
    assert fast.predicted_step_s < plan.predicted_step_s


@pytest.mark.distributed
def test_replicas_with_sparse_rows_between_groups_train_like_one_process(tmp_path):
    """Replica groups sum the token table's gradient by exchanging touched rows (2 ranks: one
    per region; 4 ranks: two per region, lane by lane): loss, gradients, parameters after 3 SGD
    steps and outputs equal the single process."""
    from pipeline_equivalence import check_pipeline

    for world in (2, 4):
        result = run_world(world, check_pipeline, _wan_cluster(tmp_path, world), None, 3, 2, 8, "1F1B",
                           {"replicas": True, "batch_split": (6, 2)}, 4096)
        assert result["between_groups"]["tok.weight"] == "sparse_allgather", result
        assert result["batch_split"] == [6, 2] and result["all_params_covered"], result
        assert result["loss"] < 2e-6 and result["grad"] < 1e-6 and result["param"] < 1e-6, result
        assert result["output"] < 2e-6, result


H100_REGIONS = os.path.join(os.path.dirname(__file__), "clusters", "four_h100_regions.yaml")


@pytest.mark.distributed
def test_pipeline_stages_plan_their_sparse_tables_and_train_like_one_process():
    """Stage graphs keep the lookups' access figures: the first stage plans its token table as a
    sparse table (replicated lookups with room, split across the stage's devices under a 7 MB
    limit), and the pipeline still trains like one process."""
    from pipeline_equivalence import check_pipeline

    cluster = H100_REGIONS
    torch.manual_seed(0)
    model = models.GPT(vocab=16384, layers=2)
    ids = torch.randint(0, 16384, (8, 16), generator=torch.Generator().manual_seed(1))
    roomy = autopar.plan(model, (ids,), cluster=cluster, pipeline=True, micro_batches=2)
    tight = autopar.plan(model, (ids,), cluster=cluster, pipeline=True, micro_batches=2, memory_limit=7_000_000)
    assert roomy.sparse["tok.weight"]["exchange"] == "none"
    assert tight.sparse["tok.weight"]["exchange"] in ("row_sharded", "column_sharded", "sparse_allgather")
    assert tight.sparse["tok.weight"]["touched_rows"] <= 64  # one micro-batch: 4 rows × 16 ids
    result = run_world(4, check_pipeline, cluster, 2, 3, 2, 8, "1F1B",
                       {"pipeline": True, "micro_batches": 2, "memory_limit": 7_000_000}, 16384)
    assert result["stage_meshes"] == [[2], [2]] and result["all_params_covered"], result
    assert result["loss"] < 2e-6 and result["grad"] < 1e-6 and result["param"] < 1e-6, result
    assert result["output"] < 2e-6, result
