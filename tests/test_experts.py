"""Mixture of experts (issue 7): stacked experts found, their load measured from the router,
experts placed by load, expert parallelism planned, and the MoE transformer equivalent to
the single-process model in real gloo processes."""

from __future__ import annotations

import os

import pytest
import torch
from rich.console import Console

import autopar
import models
from autopar.cluster import Cluster
from autopar.planning.costing import recost
from autopar.passes.capture import capture
from autopar.passes.expert_dispatch import DISPATCH_KEY
from autopar.passes.experts import annotate_experts
from autopar.passes.stack_experts import STACKED_KEY
from autopar.placements import D
from autopar.solvers.balance import balanced_order, device_loads, imbalance
from autopar.report import experts_table
from distributed import run_world
from equivalence import assert_equivalent, run_cases


def test_experts_and_router_load_are_found():
    torch.manual_seed(0)
    model = models.MoEGPT(layers=2, experts=4)
    tokens = torch.randint(0, 64, (8, 8))
    groups = annotate_experts(capture(model, (tokens,)), (tokens,))
    assert [g.module for g in groups] == ["blocks.0.moe", "blocks.1.moe"]
    first = groups[0]
    assert first.parameters == ("blocks.0.moe.w_in", "blocks.0.moe.w_out")
    assert first.experts == 4 and first.top_k == 2 and first.load_source == "inputs"
    assert sum(first.load) == 8 * 8 * 2  # every token's two choices
    # the load is the router's real choices on these inputs
    seen = []
    model.blocks[0].moe.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        model(tokens)
        chosen = model.blocks[0].moe.router(seen[0]).softmax(-1).topk(2, dim=-1).indices
    assert first.load == tuple(torch.bincount(chosen.reshape(-1), minlength=4).tolist())


def test_module_list_experts_are_batched_into_the_grouped_form():
    """A ModuleList of identical experts (one module per expert, outputs stacked) is rewritten
    into stacked weights and batched matmuls: the graph computes what the model does, the
    experts' parameters stay the model's own, and the router's load is found as for stacked
    experts."""
    torch.manual_seed(0)
    model = models.MoEGPT(layers=2, experts=4, module_list=True)
    tokens = torch.randint(0, 64, (8, 8))
    captured = capture(model, (tokens,))
    graph = captured.graph
    stacks = [n for n in graph.nodes if STACKED_KEY in n.meta]
    assert len(stacks) == 2 * 4  # two layers × (fc, out) × (weight, bias)
    assert not any(n.target is torch.ops.aten.select.int and n.args[0].meta["val"].shape[0] == 4
                   and n.args[0].meta["val"].dim() == 4 for n in graph.nodes)  # no per-expert slices left
    assert stacks[0].meta[STACKED_KEY] == tuple(f"blocks.0.moe.expert.{e}" for e in range(4))
    assert set(captured.parameter_of.values()) == {name for name, _ in model.named_parameters()}
    with torch.no_grad():
        torch.testing.assert_close(captured.program.module()(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    groups = annotate_experts(captured, (tokens,))
    assert [(g.module, g.form, g.experts, g.top_k) for g in groups] == [
        (f"blocks.{i}.moe.expert", "module_list", 4, 2) for i in range(2)]
    assert groups[0].parameters[0] == "blocks.0.moe.expert.*.fc.weight"
    torch.manual_seed(0)
    stacked = annotate_experts(capture(models.MoEGPT(layers=2, experts=4), (tokens,)), (tokens,))
    assert groups[0].load == stacked[0].load  # same seed, same router: the same tokens per expert


class _Towers(torch.nn.Module):
    """Identical modules over slices with no router (not experts), and modules that differ."""

    def __init__(self) -> None:
        super().__init__()
        self.same = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.differ = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8),
                                                                                       torch.nn.ReLU())])

    def forward(self, x):  # (3, B, 8)
        a = torch.stack([m(x[i]) for i, m in enumerate(self.same)])
        b = torch.stack([m(x[i]) for i, m in enumerate(self.differ)])
        return a.sum(0) + b.sum(0)


def test_only_identical_copies_are_batched_and_only_routed_ones_are_experts():
    model, x = _Towers(), torch.randn(3, 5, 8)
    captured = capture(model, (x,))
    stacked = {n.meta[STACKED_KEY] for n in captured.graph.nodes if STACKED_KEY in n.meta}
    assert stacked == {("same.0", "same.1", "same.2")}  # batched (the differing pair is left alone)
    with torch.no_grad():
        torch.testing.assert_close(captured.program.module()(x), model(x))
    assert annotate_experts(captured, (x,)) == []  # no router chooses among them


def test_without_values_the_load_is_uniform():
    with torch.device("meta"):
        model = models.MoEGPT(layers=1, experts=4)
    tokens = torch.zeros(8, 8, dtype=torch.long, device="meta")
    (group,) = annotate_experts(capture(model, (tokens,)), (tokens,))
    assert group.load is None and group.load_source == "uniform"


@pytest.mark.parametrize("expose, kind", [("", "scores"), ("prob0", "ids"), ("prob0+gates", None)])
def test_experts_are_relabelled_only_where_the_function_is_kept(expose, kind):
    """The router is made to speak in slots at the first point whose relabelling keeps the
    model's outputs (checked on the example inputs): its logits, else the chosen ids; when
    neither does, the balanced order stays advice and the experts keep the model's order."""
    torch.manual_seed(0)
    model, x = models.DenseRoutedMoE(expose), torch.randn(16, 256)
    (group,) = annotate_experts(capture(model, (x,)), (x,))
    assert group.form == "module_list" and len(set(group.load)) > 1
    assert (group.relabel.kind if group.relabel else None) == kind
    if kind == "scores":
        assert group.relabel.node.startswith("addmm")  # the router's own output, bias included
    plan = autopar.plan(model, (x,), cluster="2xcpu", pipeline=False, replicas=False)
    (layer,) = plan.experts.values()
    assert layer["order"] != sorted(layer["order"]) and layer["exchange"] == "expert_parallel", layer
    assert layer["order_applied"] is (kind is not None)
    assert layer["imbalance"] < layer["imbalance_in_order"]
    console = Console(width=200, record=True)
    console.print(experts_table(plan))  # what `autopar show` prints
    assert ("(placed)" if kind else "(advice)") in console.export_text()


def test_balanced_order_evens_out_a_skewed_load():
    load = (40, 30, 25, 20, 1, 1, 1, 2, 2, 3, 5, 4, 6, 3, 3, 2)  # in order: 115, 5, 14, 14
    order = balanced_order(load, 4)
    assert sorted(order) == list(range(16))
    loads = device_loads(load, order, 4)
    assert sum(loads) == sum(load)
    assert max(loads) == 43  # the optimum: 40 + the three experts of load 1
    assert imbalance(loads) < imbalance(device_loads(load, list(range(16)), 4))
    assert balanced_order((1,) * 8, 2) == list(range(8))  # nothing to balance: keep the order


def test_plan_names_expert_parallelism_and_reports_the_load():
    torch.manual_seed(0)
    model = models.MoEGPT(d=32, hidden=256, experts=8)
    tokens = (torch.randint(0, 64, (8, 8)),)
    ample = autopar.plan(model, tokens, cluster="4xcpu", pipeline=False, replicas=False)
    plan = autopar.plan(model, tokens, cluster="4xcpu", pipeline=False, replicas=False,
                        memory_limit=int(0.6 * ample.memory.total_bytes))
    layer = plan.experts["blocks.0.moe"]
    assert layer["exchange"] == "expert_parallel" and layer["expert_devices"] > 1
    assert plan.parameters["blocks.0.moe.w_in"].exchange == "expert_parallel"
    assert layer["load_source"] == "inputs" and sum(layer["load"]) == 8 * 8 * 2
    assert layer["imbalance"] <= layer["imbalance_in_order"]
    assert sorted(layer["order"]) == list(range(8))
    assert autopar.Plan.from_json(plan.to_json()).experts == plan.experts


def test_stacked_experts_rows_are_placed_in_the_balanced_order():
    """Stacked (E, ...) weights split over the experts, behind a skewed router: the plan places
    the balanced order (their rows stored in it, the router's logits relabelled), not advice."""
    torch.manual_seed(0)
    model = models.MoEGPT(d=32, hidden=256, experts=8, skew=1.0)
    tokens = (torch.randint(0, 64, (8, 8)),)
    ample = autopar.plan(model, tokens, cluster="2xH100", pipeline=False, replicas=False)
    plan = autopar.plan(model, tokens, cluster="2xH100", pipeline=False, replicas=False,
                        memory_limit=int(0.6 * ample.memory.total_bytes))
    for module, layer in plan.experts.items():
        assert layer["exchange"] == "expert_parallel" and layer["order_applied"], layer
        assert layer["relabel"]["permuted"] == [f"{module}.w_in", f"{module}.w_out"] and not layer["relabel"]["stacks"]
        assert layer["relabel"]["kind"] == "scores"
        assert layer["imbalance"] < layer["imbalance_in_order"] and layer["imbalance"] <= 1.1, layer
    assert autopar.Plan.from_json(plan.to_json()).experts == plan.experts
    console = Console(width=200, record=True)
    console.print(experts_table(plan))
    assert "(placed)" in console.export_text() and "(advice)" not in console.export_text()


def test_plan_reports_module_list_experts_with_their_load():
    torch.manual_seed(0)
    model = models.MoEGPT(d=32, hidden=256, experts=8, module_list=True)
    tokens = (torch.randint(0, 64, (8, 8)),)
    plan = autopar.plan(model, tokens, cluster="4xcpu", pipeline=False, replicas=False)
    layer = plan.experts["blocks.0.moe.expert"]
    assert layer["form"] == "module_list" and layer["experts"] == 8 and layer["top_k"] == 2
    assert layer["parameters"][0] == "blocks.0.moe.expert.*.fc.weight"
    assert layer["load_source"] == "inputs" and sum(layer["load"]) == 8 * 8 * 2
    # expert parallel: each expert's weights on one device (4 experts' worth... 2 per device),
    # their stack split over experts, so every device computes only its own experts
    assert layer["exchange"] == "expert_parallel" and layer["expert_devices"] == 4, layer
    for e in range(8):
        weight = plan.parameters[f"blocks.0.moe.expert.{e}.fc.weight"]
        assert weight.placement == "O" and weight.exchange == "expert_parallel"
    assert plan.predicted_step_s < plan.baselines["ddp"]["predicted_step_s"]
    owned = sum(p.bytes for fqn, p in plan.parameters.items() if ".moe.expert." in fqn)
    replicated = autopar.plan(model, tokens, cluster="4xcpu", configuration="ddp", pipeline=False, replicas=False)
    assert replicated.memory.params_bytes - plan.memory.params_bytes >= 0.7 * owned  # 3/4 of the experts gone
    assert autopar.Plan.from_json(plan.to_json()).experts == plan.experts
    step, _ = recost(capture(model, tokens), plan, Cluster.from_spec("4xcpu"))  # the saved plan re-costs as planned
    assert step == pytest.approx(plan.predicted_step_s, rel=1e-9)


MOE_WORLD2 = [  # stacked experts split over the experts, a skewed router: their rows stored in a balanced order
    ("MoEGPT", {"d": 32, "hidden": 256, "experts": 8, "skew": 1.0}, "tokens", 8,
     {"cluster": "2xH100", "memory_fraction": 0.6}, "float64"),
    ("MoEGPT", {"d": 32, "hidden": 256, "experts": 8, "module_list": True, "skew": 1.0}, "tokens", 8,
     {"cluster": "2xcpu"}, "float64"),  # ModuleList experts, each on its owner (expert parallel), a skewed
    # router: the experts go to their owners in a balanced order
    # 3 experts on 2 devices: split inside the experts (expert tensor parallel)
    ("MoEGPT", {"d": 32, "hidden": 256, "experts": 3}, "tokens", 8, {"cluster": "2xH100", "memory_fraction": 0.6},
     "float64"),
    # the router's scores read by the output too: the chosen ids are mapped to slots instead
    ("DenseRoutedMoE", {"expose": "prob0"}, "vec:256", 16, {"cluster": "2xcpu"}, "float64"),
]
MOE_WORLD4 = [  # 2-D meshes (8 experts expert-parallel are checked on 2 ranks above; on 4 ranks the
    # planner splits them over every device)
    ("MoEGPT", {"d": 32, "hidden": 256, "experts": 2}, "tokens", 8,
     {"cluster": "4xH100", "mesh_shape": (2, 2), "memory_fraction": 0.4}, "float64"),
    ("MoEGPT", {"d": 32, "hidden": 256, "experts": 4, "module_list": True}, "tokens", 8,
     {"cluster": "4xH100", "mesh_shape": (2, 2), "memory_fraction": 0.5}, "float64"),
    # gathered experts' rows dispatched over one mesh dim, the experts split over the other too.
    # Costed without overlap: at this size a layer's collectives outlast its compute, and with
    # η 0.9 (H100) expert-internal tensor parallelism hides its gradient reductions behind that
    # compute and wins instead. (At 0.8 the plan split the weights on the other dim along their
    # rows and gathered them for use; counted, the gathered weights need as much memory as
    # this plan, which is faster.)
    ("GatheredMoE", {"d": 128, "hidden": 16, "skew": 1.0}, "vec:128", 128,
     {"cluster": "4xH100", "mesh_shape": (2, 2), "memory_fraction": 0.82, "overlap": False}, "float64"),
]


def _bound(case, key: str) -> float:
    """Routing is discrete: a choice flipped by round-off would show as an O(1) error, so
    float32 passing at all says the routing matched. Its bounds are float32 round-off
    (outputs ~2 in size) and, for parameters, Adam's amplification of small gradients' noise
    (elements with round-off-only gradients, the attention key bias, move up to lr per step:
    see test_equivalence); float64 meets 1e-5 everywhere."""
    if len(case) > 5 and case[5] == "float64":
        return 1e-5
    return {"output": 1e-4, "param": 1e-3, "param_flat": 3 * 1e-2}.get(key, 1e-5)


def _assert_owners_follow_orders(result: dict, devices: int) -> None:
    """Every expert weight of a layer placed in a balanced order lives on its slot's device."""
    assert result["orders_applied"], result["orders_applied"]
    for module, order in result["orders_applied"].items():
        assert order != sorted(order), order
        per = len(order) // devices
        for e in range(len(order)):
            owners = {o for name, o in result["owners"].items() if name.startswith(f"{module}.{e}.")}
            assert owners == {order.index(e) // per}, (module, e, order, owners)


def _assert_rows_follow_orders(result: dict) -> None:
    """Stacked expert weights hold their rows in the balanced order (so ``Shard(0)`` gives each
    device its block of it), and give them back in the model's order."""
    orders = result["orders_applied"]
    assert orders and all(order != sorted(order) for order in orders.values()), orders
    stored = result["row_orders"]

    def module(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else ""
    assert {module(name) for name in stored} == set(orders), (stored, orders)
    for name, (order, error) in stored.items():
        assert order == orders[module(name)] and error < 1e-9, (name, order, error)


@pytest.mark.distributed
def test_moe_equivalence_two_processes():
    results = run_world(2, run_cases, MOE_WORLD2)
    exchanges = assert_equivalent(MOE_WORLD2, results, _bound)
    assert {"expert_parallel", "expert_tensor_parallel"} <= exchanges, exchanges
    assert "expert_tensor_parallel" in results[2]["exchanges"], results[2]
    _assert_rows_follow_orders(results[0])
    _assert_owners_follow_orders(results[1], 2)
    _assert_owners_follow_orders(results[3], 2)
    assert all("'ids')" in line for line in results[3]["relabels"]), results[3]["relabels"]  # not the scores


@pytest.mark.distributed
def test_moe_equivalence_four_processes_1d_and_2x2_mesh():
    results = run_world(4, run_cases, MOE_WORLD4)
    exchanges = assert_equivalent(MOE_WORLD4, results, _bound)
    assert "expert_parallel" in exchanges, exchanges
    _assert_owners_follow_orders(results[1], 2)  # 4 experts over the mesh dim of 2 placed "O"
    assert results[2]["dispatches"] == 1, results[2]
    _assert_rows_follow_orders(results[2])


def test_transformers_mixtral_experts_and_router_load_are_found():
    """transformers' Mixtral stacks its experts and gathers them per token ("batched_mm"); its
    router sits beside the experts module."""
    pytest.importorskip("transformers", reason="needs the [zoo] extra: pip install '.[zoo]'")
    import zoo

    model, inputs = zoo.build("mixtral")
    groups = annotate_experts(capture(model, inputs), inputs)
    assert [g.module for g in groups] == [f"model.model.layers.{i}.mlp.experts" for i in range(len(groups))]
    assert groups and all(g.experts == 4 and g.top_k == 2 for g in groups)
    tokens = inputs[0].numel()
    assert all(g.load_source == "inputs" and sum(g.load) == 2 * tokens for g in groups)
    plan = autopar.plan(model, inputs, cluster="2xH100", pipeline=False, replicas=False)
    assert set(plan.experts) == {g.module for g in groups}


def test_gathered_experts_run_on_their_owners_when_memory_is_short():
    """Experts gathered per token ("batched_mm"): the region from the gathers to the routing
    weights' product runs on the experts' owners; with memory to spare the experts are
    replicated, when it is short the plan dispatches the rows over one mesh dim (expert
    parallel; on tiny layers the all-to-alls' latency makes expert-internal TP the cheaper
    split, so the case is sized where moving rows beats all-reducing them), and the order of
    the experts is placed."""
    torch.manual_seed(0)
    model, x = models.GatheredMoE(d=128, hidden=16, experts=8, skew=1.0), torch.randn(128, 128)
    captured = capture(model, (x,))
    annotate_experts(captured, (x,))
    (dispatch,) = [n.meta[DISPATCH_KEY] for n in captured.graph.nodes if DISPATCH_KEY in n.meta]
    assert len(dispatch.gathers) == 2 and dispatch.rows == 256 and dispatch.experts == 8
    assert any(dispatch.row_inputs) and len(dispatch.outputs) == 1  # the rows in; the weighted rows out
    options = {"cluster": "4xH100", "mesh_shape": (2, 2), "pipeline": False, "replicas": False}
    ample = autopar.plan(model, (x,), **options)
    assert "dispatch" not in ample.experts[""]  # memory to spare: replicated experts need no exchange
    plan = autopar.plan(model, (x,), **options, memory_limit=int(0.82 * ample.memory.total_bytes))
    layer = plan.experts[""]
    assert layer["exchange"] == "expert_parallel" and "dispatch" in layer, layer
    dim = layer["dispatch"]["dim"]
    assert plan.nodes[dispatch.ids].output_spec()[dim] is D
    assert all(plan.nodes[g].exchange == "expert_dispatch" for g in dispatch.gathers)
    assert layer["order_applied"] and layer["imbalance"] < layer["imbalance_in_order"]
    assert autopar.Plan.from_json(plan.to_json()).experts == plan.experts


def test_a_region_that_mixes_rows_is_not_dispatched():
    """Centring the experts' hidden rows over all rows makes each row depend on the others:
    that region cannot run on the owners of the rows' experts."""
    torch.manual_seed(0)
    model, x = models.GatheredMoE(experts=8, mix_rows=True), torch.randn(32, 32)
    captured = capture(model, (x,))
    annotate_experts(captured, (x,))
    assert not [n for n in captured.graph.nodes if DISPATCH_KEY in n.meta]


H100_REGIONS = os.path.join(os.path.dirname(__file__), "clusters", "four_h100_regions.yaml")
# capacity = tokens of a group (factor E/k): nothing is dropped, so micro-batches and replica
# shares route every token as the whole batch does
_NO_DROPS = {"experts": 4, "hidden": 512, "capacity_factor": 2.0}


@pytest.mark.distributed
def test_pipeline_stages_and_replicas_plan_experts_and_stages_train_like_one_process():
    """Stage and replica-group graphs keep the expert groups: their plans report each MoE
    layer with its router load (per micro-batch; per group's rows), under a memory limit the
    stages split their experts (expert parallel; stacked, and a ModuleList's experts on their
    owners), and those pipelines train like one process."""
    from pipeline_equivalence import check_pipelines

    cluster = H100_REGIONS
    torch.manual_seed(0)
    model = models.MoEGPT(layers=2, **_NO_DROPS)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    roomy = autopar.plan(model, (ids,), cluster=cluster, pipeline=True, micro_batches=2)
    replicas = autopar.plan(model, (ids,), cluster=cluster, replicas=True, batch_split=(4, 4))
    layers = {f"blocks.{i}.moe" for i in range(2)}
    assert set(roomy.experts) == layers and set(replicas.experts) == layers
    assert all(sum(layer["load"]) == 2 * 4 * 16 for layer in (*roomy.experts.values(), *replicas.experts.values()))
    module_list = {**_NO_DROPS, "module_list": True}  # each expert a module: its weights live on their owner
    torch.manual_seed(0)
    separate = models.MoEGPT(layers=2, **module_list)
    roomy_separate = autopar.plan(separate, (ids,), cluster=cluster, pipeline=True, micro_batches=2)
    replicas_separate = autopar.plan(separate, (ids,), cluster=cluster, replicas=True, batch_split=(4, 4))

    # without overlap, whose hidden reduce-scatters make ZeRO-2 states as cheap a way to shed
    # the memory: the experts' own placement is what this test lowers
    def squeezed(plan):  # 0.6 of the largest stage's memory: the experts must be split
        return {"pipeline": True, "micro_batches": 2, "overlap": False,
                "memory_limit": int(0.6 * max(stage.memory.total_bytes for stage in plan.stages))}
    replica_options = {"replicas": True, "batch_split": (4, 4), "overlap": False,
                       "memory_limit": int(0.6 * replicas_separate.memory.total_bytes)}
    results = run_world(4, check_pipelines, [(cluster, 2, 3, 2, 8, "1F1B", squeezed(roomy), 64, _NO_DROPS),
                                             (cluster, 2, 3, 2, 8, "1F1B", squeezed(roomy_separate), 64, module_list),
                                             (cluster, None, 3, 2, 8, "1F1B", replica_options, 64, module_list)])
    assert results[2]["batch_split"] == [4, 4], results[2]  # two replica groups of 2, experts split in each
    for k, result in enumerate(results):
        assert set(result["experts"].values()) == {"expert_parallel"}, result
        assert result["stage_meshes"] == ([[2], [2]] if k < 2 else []) and result["all_params_covered"], result
        assert result["loss"] < 2e-6 and result["grad"] < 1e-6 and result["param"] < 1e-6, result
        assert result["output"] < 2e-6, result
        if k > 0:  # a ModuleList's experts: placed in the balanced order of each stage's / group's load
            assert result["orders_applied"], result  # (a layer whose own order is as even keeps it)
