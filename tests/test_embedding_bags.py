"""Embedding bags (issue 7, issue 22 item 2): fixed-size and jagged bags rewritten into a lookup
and a pooling that train and shard, the pooling split with its table, no plan splitting a
batch's ids, and the jagged DLRM in real gloo processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
import models
from autopar.passes.capture import capture
from autopar import placements as pl
from autopar.passes.bag_pooling import POOL_ROWS
from autopar.passes.embedding_bag import BagInput, bag_split_inputs, id_indexed
from autopar.passes.memory import SAVED_KEY, annotate_saved
from autopar.passes.bag_strategies import first_dim_split
from autopar.passes.strategy_types import tensor_args
from distributed import run_world
from equivalence import assert_equivalent, run_cases

@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
def test_fixed_bags_rewrite_matches_embedding_bag_forward_and_backward(mode, weighted):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(50, 6, mode=mode)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = bag

        def forward(self, ids, weights):
            return self.bag(ids, per_sample_weights=weights if weighted else None)

    model = Model()
    ids, weights = torch.randint(0, 50, (8, 3)), torch.rand(8, 3)
    captured = capture(model, (ids, weights))
    targets = {n.target for n in captured.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.embedding_bag.default not in targets
    assert torch.ops.aten.embedding.default in targets
    rewritten = captured.program.module()
    out = rewritten(ids, weights)
    expected = model(ids, weights)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # trainable now: the rewritten lookup has a gradient equal to EmbeddingBag's
    out.square().sum().backward()
    expected.square().sum().backward()
    grad = dict(rewritten.named_parameters())["bag.weight"].grad
    torch.testing.assert_close(grad, bag.weight.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode,last,weighted", [("sum", False, False), ("sum", False, True), ("mean", False, False),
                                                ("sum", True, True), ("mean", True, False)])
def test_jagged_bags_rewrite_matches_embedding_bag_forward_and_backward(mode, last, weighted):
    """Bags given by offsets (1-D ids, bags of 3, 0, 4 and 3 ids): every id looked up and
    summed into its bag; an empty bag is zeros, as EmbeddingBag gives."""
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(50, 6, mode=mode, include_last_offset=last)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = bag

        def forward(self, ids, offsets, weights):
            return self.bag(ids, offsets, per_sample_weights=weights if weighted else None)

    model = Model()
    ids, weights = torch.randint(0, 50, (10,)), torch.rand(10)
    offsets = torch.tensor([0, 3, 3, 7] + ([10] if last else []))
    captured = capture(model, (ids, offsets, weights))
    targets = {n.target for n in captured.graph.nodes if n.op == "call_function"}
    assert not targets & {torch.ops.aten.embedding_bag.default, torch.ops.aten._embedding_bag.default,
                          torch.ops.aten._embedding_bag_forward_only.default}, targets
    rewritten = captured.program.module()
    out, expected = rewritten(ids, offsets, weights), model(ids, offsets, weights)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert out[1].abs().max() == 0  # the empty bag
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(dict(rewritten.named_parameters())["bag.weight"].grad, bag.weight.grad, rtol=0,
                               atol=1e-5)


def test_jagged_bags_pool_where_their_table_is_split():
    """Under a memory limit the large tables are split by columns; each device then pools its
    columns of every bag (``autopar::pool_rows``), not the whole rows gathered first; the
    pooling keeps only the rows' bag numbers for backward, not the looked-up rows."""
    torch.manual_seed(0)
    model = models.JaggedDLRM()
    inputs = models.jagged_dlrm_inputs(model, 16)
    full = autopar.plan(model, inputs, cluster="2xcpu")
    plan = autopar.plan(model, inputs, cluster="2xcpu", memory_limit=int(0.6 * full.memory.total_bytes))
    pools = {name: node for name, node in plan.nodes.items() if name.startswith("pool_rows")}
    assert len(pools) == 3
    split = [name for name, node in pools.items() if node.outputs == ("S(1)",)]
    assert split and all(node.inputs[0] == "S(1)" for name, node in pools.items() if name in split), pools
    assert plan.parameters["embeddings.0.weight"].exchange == "column_sharded"
    captured = capture(model, inputs)
    annotate_saved(captured.graph)
    pooled_rows = [n.args[0] for n in captured.graph.nodes if n.name in pools]
    assert len(pooled_rows) == 3 and not any(rows.meta[SAVED_KEY][0] for rows in pooled_rows)


JAGGED = [("JaggedDLRM", {}, "jagged", 16, options) for options in (
    {"configuration": "ddp"}, {"configuration": "row_wise"}, {"memory_fraction": 0.6})] + [
    # 256 bags, float64 (a hot row sums hundreds of gradient contributions, in another order):
    # the largest table whole on one device (4-wide rows; on 4 ranks a 2x2 mesh, "R,O"), or
    # exchanging the rows each device's bags touched (64-wide rows)
    ("JaggedDLRM", {"tables": (16384, 1024, 64), "dim": 4}, "jagged", 256, {}, "float64"),
    ("JaggedDLRM", {"tables": (16384, 1024, 64), "dim": 64}, "jagged", 256, {}, "float64")]


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_jagged_dlrm_trains_like_one_process(world):
    """DLRM fed as TorchRec feeds it (1-D ids + offsets, bags of 0–5 ids, empty ones among
    them, sum with per-sample weights, mean, include_last_offset) trains on gloo like one
    process: DDP with the batch split by bags (each rank its own bags' ids, however many),
    tables row-sharded with lookups routed to the rows' owners, under a memory limit — where
    the largest table is split by columns and its bags pooled by columns — and batches of 256
    bags whose largest table lives whole on one device, which pools every bag of the batch and
    sends each device its share (TorchRec's table-wise), or exchanges its gradient as the rows
    each rank's bags touched (Parallax's sparse all-gather, from uneven pieces)."""
    cases = [(*case[:4], {**case[4], "cluster": f"{world}xcpu"}, *case[5:]) for case in JAGGED]
    exchanges = assert_equivalent(cases, run_world(world, run_cases, cases))
    assert {"row_sharded", "column_sharded", "table_wise", "sparse_allgather", "allreduce"} <= exchanges, exchanges


def test_plans_split_a_batch_s_ids_by_bags_only():
    """A batch's id count changes with every batch, and a device's share of ids is its own
    bags' (of any count): ids, their weights, lookups and bag numbers split on their first dim
    only together, on the mesh dims that split the bags they pool into — never resharded on
    that dim — on 1-D and 2-D meshes, memory squeezed or not; DDP splits them so."""
    torch.manual_seed(0)
    model = models.JaggedDLRM()
    inputs = models.jagged_dlrm_inputs(model, 16)
    captured = capture(model, inputs)
    id_nodes = id_indexed(captured.graph)
    assert {"ids0", "weights0", "ids1", "ids2"} <= id_nodes, id_nodes
    assert sum(name.startswith("repeat_interleave") for name in id_nodes) == 3, id_nodes
    assert not any(name.startswith("offsets") for name in id_nodes)  # they count bags, split as bags are
    by_input, chains = bag_split_inputs(captured.graph)
    assert chains == id_nodes and by_input["ids2"] == BagInput("offsets2", 16, True), by_input
    full = autopar.plan(model, inputs, cluster="4xcpu")
    for options in ({"configuration": "ddp"}, {"memory_limit": int(0.6 * full.memory.total_bytes)},
                    {"cluster": "2x2xH100"}, {"configuration": "ddp", "cluster": "2x2xH100"}):
        plan = autopar.plan(model, inputs, **{"cluster": "4xcpu", **options})
        splits = {}  # chain of each pooling -> the mesh dims splitting the first dim of its tensors
        for node in captured.graph.nodes:
            planned = plan.nodes.get(node.name)
            if planned is None or node.target is not POOL_ROWS:
                continue
            pooled = first_dim_split(pl.parse_spec(planned.outputs[0]))
            found = set()
            for member in _chain_of(node, id_nodes):
                found |= {first_dim_split(pl.parse_spec(spec)) for spec in plan.nodes[member].outputs if spec}
                consumer = plan.nodes[member]
                args = [a.name for a in tensor_args(_node(captured, member))]
                found |= {first_dim_split(pl.parse_spec(spec)) for a, spec in zip(args, consumer.inputs)
                          if a in id_nodes}
            assert found == {pooled}, (options, node.name, found, pooled)
            splits[node.name] = pooled
        assert len(splits) == 3, splits
        if options.get("configuration") == "ddp":  # every pooling splits its bags, and its ids with them
            assert all(splits.values()), (options, splits)


def _chain_of(pool: torch.fx.Node, id_nodes: set[str]) -> set[str]:
    chain, stack = set(), [pool.args[0], pool.args[1]]
    while stack:
        node = stack.pop()
        if node.name in id_nodes and node.name not in chain:
            chain.add(node.name)
            stack.extend(node.all_input_nodes)
    return chain


def _node(captured, name: str) -> torch.fx.Node:
    return next(n for n in captured.graph.nodes if n.name == name)


def _varying_id_counts(world: int) -> dict:
    """JaggedDLRM trained on batches of 16 bags whose id counts differ (odd ones among them),
    under DDP, row-wise tables and the chosen plan: worst errors against one process."""
    import copy

    import torch.nn.functional as F

    found = {}
    for name, options in (("ddp", {"configuration": "ddp"}), ("row_wise", {"configuration": "row_wise"}),
                          ("chosen", {})):
        torch.manual_seed(0)
        model = models.JaggedDLRM()
        reference = copy.deepcopy(model)
        pmodel = autopar.parallelize(model, models.jagged_dlrm_inputs(model, 16, seed=1), cluster=f"{world}xcpu",
                                     loss_fn=F.mse_loss, **options)
        optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        errors = {"loss": 0.0, "param": 0.0, "id_counts": []}
        for seed in (1, 2, 3, 5):
            inputs, target = models.jagged_dlrm_inputs(model, 16, seed=seed), torch.randn(16, 1)
            errors["id_counts"].append(inputs[1].numel())
            loss = pmodel.step(*inputs, target=target)
            ref_loss = F.mse_loss(reference(*inputs), target)
            ref_loss.backward()
            optimizer.step(), ref_optimizer.step()
            optimizer.zero_grad(), ref_optimizer.zero_grad()
            errors["loss"] = max(errors["loss"], abs(loss.item() - ref_loss.item()))
        state, ref = pmodel.full_state_dict(), dict(reference.named_parameters())
        errors["param"] = max((state[n] - p.detach()).abs().max().item() for n, p in ref.items())
        errors["lowered_again"] = len(pmodel.relowering.by_shapes)
        errors["ids_split"] = pmodel.plan.nodes["ids0"].outputs[0]
        for bags in (8, 48):  # evaluation at half and three times as many bags: lowered again, once each
            inputs = models.jagged_dlrm_inputs(model, bags, seed=7)
            with torch.no_grad():
                errors[f"eval_{bags}"] = (pmodel(*inputs) - reference(*inputs)).abs().max().item()
        errors["lowered_for_eval"] = len(pmodel.relowering.by_shapes) - errors["lowered_again"]
        found[name] = errors
    return found


@pytest.mark.distributed
def test_jagged_dlrm_keeps_training_when_a_batch_s_id_count_changes():
    """Batches of 16 bags holding 48, 36, 33 and 36 ids: every one trains like one process
    (the third's 33 ids split by bags, unevenly, under DDP), on the one program lowered for the
    first: the id count is read from the ids as they come (bag_runtime.id_count), not traced.
    Evaluation at 8 and 48 bags (other shapes: lowered again, once each) gives the model's
    outputs."""
    found = run_world(2, _varying_id_counts, 2)
    for name, errors in found.items():
        assert errors["id_counts"] == [48, 36, 33, 36], errors
        assert errors["loss"] < 1e-5 and errors["param"] < 1e-5, (name, errors)
        assert errors["lowered_again"] == 0 and errors["lowered_for_eval"] == 2, (name, errors)
        assert errors["eval_8"] < 1e-5 and errors["eval_48"] < 1e-5, (name, errors)
    assert found["ddp"]["ids_split"] == "S(0)", found


@pytest.mark.parametrize("family", ["pipeline", "replicas"])
def test_pipelines_and_replicas_refuse_bags_of_varying_size_by_name(family):
    """Micro-batches and replica shares cut every input by rows; a jagged table's ids are not
    rows of the batch (their count is the data's), so a cut would split bags: the plan is
    refused up front, naming the inputs (the leading sizes of the inputs also differ, which
    alone would give a vaguer message)."""
    import pathlib

    torch.manual_seed(0)
    model = models.JaggedDLRM()
    inputs = models.jagged_dlrm_inputs(model, 16)
    cluster = str(pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml")
    with pytest.raises(autopar.AutoparError, match="ids0, ids1, ids2, weights0 hold the ids of bags of varying size"):
        autopar.plan(model, inputs, cluster=cluster, **{family: True})
    plan = autopar.plan(model, inputs, cluster=cluster)  # the families over device groups are skipped, saying why
    for name in ("pipeline", "replicas"):
        assert "bags of varying size" in plan.families[name]["skipped"], plan.families[name]


def test_touched_rows_of_bags_of_varying_size_are_counted_by_bags():
    """Parallax's exchange is costed from the example ids as each device will hold them: its
    own bags' ids (a split by bags; a split by position would cut bags and count other rows).
    The saved ``bag_starts`` are each bag's first id, then the id count."""
    from autopar.passes.sparse import LOOKUP_KEY, annotate_lookups

    torch.manual_seed(0)
    model = models.JaggedDLRM()
    inputs = models.jagged_dlrm_inputs(model, 16)
    captured = capture(model, inputs)
    annotate_lookups(captured, inputs)
    lookups = {n.args[1].name: n.meta[LOOKUP_KEY] for n in captured.graph.nodes if LOOKUP_KEY in n.meta}
    ids, offsets = inputs[1], inputs[2]
    lookup = lookups["ids0"]
    assert lookup.bag_starts.tolist() == [*offsets.tolist(), ids.numel()]
    for shards in (2, 4):
        per = 16 // shards
        pieces = [ids[offsets[k * per]:(offsets[(k + 1) * per] if (k + 1) * per < 16 else ids.numel())]
                  for k in range(shards)]
        assert lookup.touched_rows(shards) == max(int(p.unique().numel()) for p in pieces)
    last = lookups["ids2"]  # include_last_offset: the offsets already end with the id count
    assert last.bag_starts.tolist() == inputs[7].tolist()


def test_bags_of_varying_size_on_the_meta_device_plan():
    """The last bag's end, made while rewriting, lives on the offsets' device: a model on the
    meta device (as benchmarks plan the Criteo tables; or on a GPU) captures and plans with its
    ids split by bags (before, the rewrite's constant was made on the CPU and the capture
    failed: "found at least two devices, meta and cpu")."""
    with torch.device("meta"):
        model = nn.EmbeddingBag(1000, 8, mode="sum")
        ids, offsets = torch.zeros(40, dtype=torch.long), torch.zeros(8, dtype=torch.long)

    class Bags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = model

        def forward(self, ids, offsets):
            return self.bag(ids, offsets)

    plan = autopar.plan(Bags(), (ids, offsets), cluster="2xcpu", configuration="ddp")
    assert plan.nodes["ids"].outputs == ("S(0)",)


class _CountingBags(nn.Module):
    """Bags whose pooled rows the model scales by the batch's id count (``ids.numel()``, a
    Python int: the trace holds it as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(64, 4, mode="sum")
        self.head = nn.Linear(4, 1)

    def forward(self, ids, offsets):
        return self.head(self.bag(ids, offsets) * (10.0 / ids.numel()))


def _id_count_in_the_model(world: int) -> dict:
    import copy

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _CountingBags()
    reference = copy.deepcopy(model)

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(0, 5, (8,), generator=g)
        ids = torch.randint(0, 64, (int(lengths.sum()),), generator=g)
        return (ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])), torch.randn(8, 1)

    pmodel = autopar.parallelize(model, batch(1)[0], cluster=f"{world}xcpu", loss_fn=F.mse_loss, configuration="ddp")
    found = {"loss": 0.0, "counts": []}
    for seed in (1, 3, 4):  # 19, 8 and 18 ids
        inputs, target = batch(seed)
        found["counts"].append(inputs[0].numel())
        loss = pmodel.step(*inputs, target=target)
        ref_loss = F.mse_loss(reference(*inputs), target)
        ref_loss.backward()
        for p in reference.parameters():  # plain SGD on the reference; the parallel one by hand
            p.data -= 0.1 * p.grad
            p.grad = None
        for p in pmodel.parameters():
            p.data -= 0.1 * p.grad
            p.grad = None
        found["loss"] = max(found["loss"], abs(loss.item() - ref_loss.item()))
    found["lowered_again"] = len(pmodel.relowering.by_shapes)
    found["count_free"] = pmodel.relowering.count_free
    return found


@pytest.mark.distributed
def test_a_model_holding_the_id_count_itself_is_lowered_again_per_count():
    """A model that reads ``ids.numel()`` in its own code holds the id count where lowering
    cannot read it from the ids: the first other count is traced once, found to differ
    (passes.embedding_bag.literals_but_id_counts), and every count is lowered again, as any
    other shape — the step stays the model's."""
    found = run_world(2, _id_count_in_the_model, 2)
    assert len(set(found["counts"])) == 3, found
    assert found["count_free"] is False and found["lowered_again"] == 2, found
    assert found["loss"] < 1e-5, found
