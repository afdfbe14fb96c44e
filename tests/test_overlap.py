"""Communication overlapped with computation in the cost model (issue 20): a layer's
parameter collectives hide behind its compute, everything else stays on the critical path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import autopar
from autopar.cluster_file import parse_cluster
from autopar.errors import AutoparError
from autopar.problem import Edge, ShardingProblem
from autopar.solvers import get_solver


class ResidualMLP(nn.Module):
    """``layers`` residual two-matmul blocks of width ``d``: every weight sits in a layer."""

    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, d)
        for layer in self.layers:
            x = x + layer(x)
        return x


def _group_problem(efficiency: float, comm_s: float) -> ShardingProblem:
    """A parameter feeding one op of group 0 (compute 10 s, 1 s of it the op's own exchange),
    its edge ``comm_s`` of overlappable communication."""
    edge = Edge(0, 1, [0], [0], [[comm_s]], group=0, parts=[[(0.0, 0.0, comm_s, "all_reduce")]])
    return ShardingProblem(["w", "op"], [[0.0], [10.0]], [[0], [0]], [edge], 1, node_group=[-1, 0],
                           node_comm=[[0.0], [1.0]], overlap_efficiency=efficiency)


@pytest.mark.parametrize("efficiency, comm_s, step_s", [
    (0.0, 4.0, 14.0),  # no overlap: the sum
    (1.0, 4.0, 10.0),  # all of it hidden behind the 9 s of compute
    (0.5, 4.0, 12.0),  # half of it
    (1.0, 12.0, 13.0),  # more communication than compute: max(9, 12) + the 1 s exchange
])
def test_a_group_costs_its_compute_and_communication_overlapped(efficiency, comm_s, step_s):
    problem = _group_problem(efficiency, comm_s)
    assert problem.evaluate([0, 0]) == pytest.approx(step_s)
    solution = get_solver("cpsat").solve(problem)
    assert solution.objective_s == pytest.approx(step_s)
    assert solution.bound_s == pytest.approx(step_s, rel=1e-6)


def _plan(batch: int, overlap: bool, width: int = 4096, **kwargs):
    with torch.device("meta"):
        model, x = ResidualMLP(width, 4), torch.randn(batch, width)
    return autopar.plan(model, (x,), cluster=kwargs.pop("cluster", "4xH100"), mesh_shape=kwargs.pop("mesh_shape", (4,)),
                        overlap=overlap, **kwargs)


def _weights(plan) -> dict[str, str]:
    return {fqn: p.placement for fqn, p in plan.parameters.items() if fqn.endswith("weight")}


def test_compute_bound_layers_flip_to_data_parallel():
    """2048 rows of width 4096 per step on 4 H100s: each layer's backward outlasts its
    weights' gradient all-reduce. Summed, tensor parallelism's small activation all-reduces
    win (the Megatron pattern); with overlap the gradient reductions hide behind compute, DDP
    costs its compute plus, of the 4 layers' all-reduces, the 10% of three an H100 is assumed
    to lose to contention (overlap_efficiency 0.9) and all of the first layer's (the last
    backward reduces, after every compute), and the plan flips to DDP."""
    summed, overlapped = _plan(2048, overlap=False), _plan(2048, overlap=True)
    assert set(_weights(summed).values()) == {"S(0)", "S(1)"}  # column then row parallel
    assert set(_weights(overlapped).values()) == {"R"}  # data parallel
    assert overlapped.nodes["x"].outputs == ("S(0)",)
    ddp = overlapped.baselines["ddp"]["predicted_step_s"]
    assert overlapped.predicted_step_s == pytest.approx(ddp, rel=1e-9)
    compute, comm = overlapped.predicted_compute_s, overlapped.predicted_comm_s
    exposed = (0.1 * 3 / 4 + 1 / 4) * comm
    assert ddp == pytest.approx(compute + exposed, rel=1e-6)
    assert overlapped.predicted_exposed_comm_s == pytest.approx(exposed, rel=1e-6)
    assert overlapped.predicted_step_s < summed.predicted_step_s < summed.baselines["ddp"]["predicted_step_s"]


def test_communication_bound_layers_keep_tensor_parallelism():
    """64 rows: a layer's compute is far below its weights' gradient all-reduce (DDP's best
    here even replicates the work rather than reduce gradients), so there is little to hide:
    the plan stays column/row tensor parallel, at the same step time, with or without overlap."""
    summed, overlapped = _plan(64, overlap=False), _plan(64, overlap=True)
    assert _weights(overlapped) == _weights(summed)
    assert set(_weights(overlapped).values()) == {"S(0)", "S(1)"}
    assert overlapped.predicted_step_s == pytest.approx(summed.predicted_step_s, rel=1e-9)
    assert overlapped.predicted_step_s < min(v["predicted_step_s"] for k, v in overlapped.baselines.items()
                                             if v["feasible"] and k != "megatron_tp")


def test_the_cpu_catalog_device_promises_no_overlap():
    """gloo shares the host's cores: an uncalibrated ``cpu`` plans as if nothing overlapped."""
    on, off = _plan(256, True, cluster="4xcpu", memory_limit=2**34), _plan(256, False, cluster="4xcpu",
                                                                           memory_limit=2**34)
    assert on.predicted_step_s == pytest.approx(off.predicted_step_s)
    assert on.predicted_exposed_comm_s == pytest.approx(on.predicted_comm_s)


def test_overlap_efficiency_comes_from_the_cluster_file():
    def device(efficiency):
        spec = {"peak_TFLOPS": {"fp32": 0.1}, "memory_GB": 16, "memory_bandwidth_GBps": 10}
        if efficiency is not None:
            spec["overlap_efficiency"] = efficiency
        return {"devices": {"host": spec}, "device": "host", "nodes": 1, "per_node": 4}

    assert parse_cluster(device(0.4))["device"].overlap_efficiency == 0.4
    assert parse_cluster(device(None))["device"].overlap_efficiency == 0.9  # as the catalog's GPUs
    with pytest.raises(AutoparError, match="overlap_efficiency.*fraction between 0 and 1"):
        parse_cluster(device(1.5))
    measured = device(0.0)
    measured["devices"]["host"]["collective_overlap"] = {"all_gather": 0.5, "all_reduce": -0.25}
    host = parse_cluster(measured)["device"]
    assert (host.overlap("all_gather"), host.overlap("all_reduce"), host.overlap("reduce_scatter")) == (0.5, -0.25, 0.0)
    measured["devices"]["host"]["collective_overlap"] = {"all_to_all": 0.5}
    with pytest.raises(AutoparError, match="unknown kind 'all_to_all' in `collective_overlap`"):
        parse_cluster(measured)
    measured["devices"]["host"]["collective_overlap"] = {"all_reduce": -1.5}
    with pytest.raises(AutoparError, match="`all_reduce` is an overlap efficiency between -1 and 1"):
        parse_cluster(measured)


def _host_cluster(tmp_path, overlap: dict[str, float], latency_us: float = 0.0) -> str:
    """A 2-device cluster file of slow hosts whose collectives overlap as ``overlap`` says."""
    import yaml

    spec = {"peak_TFLOPS": {"fp32": 0.1}, "memory_GB": 16, "memory_bandwidth_GBps": 10,
            "intra_node": {"bandwidth_GBps": 1.0, "latency_us": latency_us},
            "overlap_efficiency": 0.0, "collective_overlap": overlap}
    path = tmp_path / "host.yaml"
    path.write_text(yaml.safe_dump({"devices": {"host": spec}, "device": "host", "nodes": 1, "per_node": 2}))
    return str(path)


def test_each_collective_kind_overlaps_as_measured(tmp_path):
    """gloo on a small host (``autopar profile``): gathers and reduce-scatters hide about half
    their time behind compute, all-reduces nothing, and issued beside compute they may slow
    it. The model predicts both directions the benchmark measures: FSDP (prefetched gathers,
    reduce-scattered gradients) gets faster with overlap, DDP (all-reduced buckets) slower."""
    cluster = _host_cluster(tmp_path, {"all_gather": 0.5, "reduce_scatter": 0.5, "all_reduce": -0.25})
    steps = {}
    for configuration in ("ddp", "fsdp"):
        for overlap in (False, True):
            plan = _plan(256, overlap, 256, cluster=cluster, mesh_shape=(2,), configuration=configuration)
            steps[configuration, overlap] = plan
    ddp_off, ddp_on = steps["ddp", False], steps["ddp", True]
    # DDP: every gradient all-reduced beside backward, a quarter of it lost to contention
    # (three of the four layers: the first layer's all-reduce runs after backward, beside nothing)
    assert ddp_on.predicted_step_s == pytest.approx(ddp_off.predicted_step_s + 0.25 * 3 / 4 * ddp_off.predicted_comm_s)
    assert steps["fsdp", True].predicted_step_s < steps["fsdp", False].predicted_step_s
    hidden = [entry["forward"] for entry in steps["fsdp", True].overlap["layers"] if entry["forward"][1]]
    assert hidden and all(weighted == pytest.approx(0.5 * comm) for _, comm, weighted in hidden)
    assert steps["fsdp", True].overlap["by_collective"] == {"all_gather": 0.5, "reduce_scatter": 0.5,
                                                            "all_reduce": -0.25}


def test_each_gradient_bucket_pays_a_latency(tmp_path):
    """Replicated gradients are all-reduced in buckets of ``bucket_cap_mb``: each gradient pays
    the share of a bucket's latency its bytes take (2 latencies per all-reduce on 2 ranks), so
    1 MiB buckets cost the DDP step about 2·latency per MiB of gradients more than one bucket."""
    cluster = _host_cluster(tmp_path, {}, latency_us=1000.0)
    one = _plan(1024, False, 256, cluster=cluster, mesh_shape=(2,), configuration="ddp", bucket_cap_mb=1e6)
    small = _plan(1024, False, 256, cluster=cluster, mesh_shape=(2,), configuration="ddp", bucket_cap_mb=1.0)
    gradient_bytes = sum(p.bytes for p in small.parameters.values())
    assert small.predicted_comm_s - one.predicted_comm_s == pytest.approx(
        2 * 1e-3 * gradient_bytes / 2**20 * (1 - 2**20 / (1e6 * 2**20)), rel=1e-6)


def _model_and_reference(layers: int, rows: int):
    """A seeded ResidualMLP of width 256, its input and target, and a copy of it whose
    gradients one process computed (what every test worker compares with)."""
    torch.manual_seed(0)
    model, x, target = ResidualMLP(256, layers), torch.randn(rows, 256), torch.randn(rows, 256)
    reference = ResidualMLP(256, layers)
    reference.load_state_dict(model.state_dict())
    torch.nn.functional.mse_loss(reference(x), target).backward()
    return model, x, target, reference


def _gradient_error(pmodel, reference) -> float:
    """The largest difference between the parallel model's gradients and one process's."""
    grads = dict(pmodel.named_parameters())
    return max((grads[name].grad.full_tensor() - p.grad).abs().max().item() for name, p in reference.named_parameters())


def _overlap_worker(bucket_cap_mb: float):
    """One DDP step of a ResidualMLP on this rank: how many gradient all-reduces were
    launched while autograd still computed (before GradientSync.flush, which autograd's
    engine runs when the backward pass ends), and how far the gradients are from one process's.
    Counting launches, not profiler spans, keeps the check independent of when gloo's worker
    thread happens to run the collective on a loaded machine."""
    from autopar.passes.grad_sync import GradientSync

    model, x, target, reference = _model_and_reference(8, 256)
    pmodel = autopar.parallelize(model, (x,), loss_fn=torch.nn.functional.mse_loss, configuration="ddp",
                                 bucket_cap_mb=bucket_cap_mb)
    pmodel.step(x, target=target)  # warm-up, then the step counted
    pmodel.zero_grad(set_to_none=True)
    events: list[str] = []
    launch, flush = GradientSync._launch, GradientSync.flush

    def counted_launch(self, key):
        events.append("launch")
        return launch(self, key)

    def counted_flush(self):
        events.append("end of backward")
        return flush(self)

    GradientSync._launch, GradientSync.flush = counted_launch, counted_flush
    try:
        pmodel.step(x, target=target)
    finally:
        GradientSync._launch, GradientSync.flush = launch, flush
    inside = events.index("end of backward")  # launches before the pass ended
    return inside, _gradient_error(pmodel, reference)


def test_gradient_all_reduces_run_inside_the_backward_pass():
    """Buckets of 256 KiB (one weight each) are all-reduced asynchronously as they fill:
    they are launched while the backward pass still runs, and every gradient is still the
    one process's. With DDP's 25 MiB the one bucket fills only at the end of backward."""
    from distributed import run_world

    inside, error = run_world(2, _overlap_worker, 0.25)
    assert inside >= 15  # 16 weights of 256 KiB: each fills a bucket (the biases' goes at the end)
    assert error < 1e-5
    inside, error = run_world(2, _overlap_worker, 25.0)
    assert inside == 0
    assert error < 1e-5


def _fsdp_worker(overlap: bool = True, prefetch_layers: int = 1, regathers: bool = False):
    """One FSDP step of a 4-layer ResidualMLP on this rank: the lowered code, which gradients
    arrived while their reduce-scatter was still in flight, and how far the gradients are from
    one process's (with ``regathers``, also how many of backward's weight gathers were issued
    ahead of need and when needed, for a second step)."""
    from autopar.passes.grad_sync import reducing
    from autopar.passes.reshard import WEIGHT_GATHERS_ATTR

    model, x, target, reference = _model_and_reference(4, 1024)
    pmodel = autopar.parallelize(model, (x,), loss_fn=torch.nn.functional.mse_loss, configuration="fsdp",
                                 overlap=overlap, prefetch_layers=prefetch_layers)
    in_flight = {}
    for name, param in pmodel.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: in_flight.update({name: reducing(p)}))
    pmodel.step(x, target=target)
    settled = not any(reducing(p) for p in pmodel.parameters())
    found = pmodel.code, in_flight, _gradient_error(pmodel, reference), settled
    if not regathers:
        return found
    counted = [module for module in pmodel.lowered if hasattr(module, WEIGHT_GATHERS_ATTR)]
    for module in counted:
        getattr(module, WEIGHT_GATHERS_ATTR).regathers.clear()
    pmodel.zero_grad(set_to_none=True)
    pmodel.step(x, target=target)
    return found, dict(sum((getattr(module, WEIGHT_GATHERS_ATTR).regathers for module in counted), Counter()))


def test_backward_gathers_a_layer_s_weights_while_the_layer_after_it_computes():
    """FSDP2's backward prefetch: when backward first needs a weight of layer k, the rest of
    layer k's weights and all of layer k − 1's are gathered again — so of the 7 weights backward
    needs again (layer 0's first is never saved: its input needs no gradient; biases are not
    saved) only the very first is gathered when needed — and the gradients stay one process's.
    ``prefetch_layers=0`` gathers each one when it is needed."""
    from distributed import run_world

    (code, in_flight, error, settled), regathers = run_world(2, _fsdp_worker, True, 1, True)
    assert regathers == {"ahead": 6, "when_needed": 1}, regathers
    assert error < 1e-5 and settled
    (code, in_flight, error, settled), regathers = run_world(2, _fsdp_worker, True, 0, True)
    assert regathers == {"when_needed": 7}, regathers
    assert error < 1e-5 and settled


def test_fsdp_gathers_run_a_layer_ahead_and_reductions_during_backward():
    """FSDP2's overlap in the lowered program: layer k's weights are gathered (async) before
    layer k − 1 computes — the parameter as stored, its transpose taken on the whole weight —
    every gradient reaches its parameter while its reduce-scatter is still in flight (backward
    goes on), all are waited for when backward ends, and each equals one process's."""
    from distributed import run_world

    code, in_flight, error, settled = run_world(2, _fsdp_worker)
    lines = code.splitlines()

    def first(text: str) -> int:
        return next(k for k, line in enumerate(lines) if text in line)

    for k in range(1, 4):
        first_matmul = first(f"addmm_{2 * (k - 1)} = " if k > 1 else "addmm = ")
        assert first(f"gather(layers_{k}_0_weight, ") < first_matmul, code
        assert first(f"gather(layers_{k}_2_weight, ") < first_matmul, code
    assert ".gather(permute" not in code  # the stored shard is gathered, not its transpose
    assert len(in_flight) == 16 and all(in_flight.values()), in_flight
    assert settled
    assert error < 1e-5


def test_a_plan_made_without_overlap_runs_its_collectives_where_it_issues_them():
    """``overlap=False`` plans and lowers alike: each gather where its weight is read, every
    collective waited for where it is issued — and the same gradients."""
    from distributed import run_world

    code, in_flight, error, settled = run_world(2, _fsdp_worker, False)
    lines = code.splitlines()
    first_layer_done = next(k for k, line in enumerate(lines) if "addmm_1 = " in line)
    assert next(k for k, line in enumerate(lines) if "gather(layers_1_0_weight, " in line) > first_layer_done, code
    assert len(in_flight) == 16 and not any(in_flight.values()), in_flight
    assert settled
    assert error < 1e-5


def test_prefetch_depth_is_a_knob_of_the_cost_model_and_the_program():
    """``prefetch_layers`` (FSDP2 prefetches 1 layer ahead): 0 gathers each weight where it is
    read, so the plan's forward gathers are exposed and the step is longer; 2 moves layer k's
    gathers before layer k − 2 in the lowered program, gradients unchanged."""
    from distributed import run_world

    steps = {}
    for depth in (0, 1):
        plan = _plan(4096, True, configuration="fsdp", prefetch_layers=depth)
        steps[depth] = plan.predicted_step_s
        assert plan.options.get("prefetch_layers", 1) == depth
        forward_hidden = sum(min(entry["forward"]) for entry in plan.overlap["layers"])
        assert (forward_hidden > 0) == (depth > 0), plan.overlap
    assert steps[0] > steps[1], steps
    with pytest.raises(AutoparError, match="prefetch_layers must be a whole number"):
        _plan(1024, True, prefetch_layers=-1)

    code, in_flight, error, settled = run_world(2, _fsdp_worker, True, 2)
    lines = code.splitlines()

    def first(text: str) -> int:
        return next(k for k, line in enumerate(lines) if text in line)

    assert first("gather(layers_2_0_weight, ") < first("addmm = "), code
    assert first("addmm = ") < first("gather(layers_3_0_weight, ") < first("addmm_2 = "), code  # two layers, not more
    assert all(in_flight.values()) and settled and error < 1e-5


def test_show_reports_and_traces_the_overlapped_step(tmp_path):
    """`autopar show` gives per layer the compute and the communication beside it; `--trace`
    writes the predicted step as a Chrome trace whose two streams add up to the plan's step,
    each layer's ops inside its span under their names in pmodel.code."""
    import json

    from autopar.cli import main
    from autopar.report import summary
    from autopar.timeline import overlap_rows

    plan = _plan(2048, overlap=True)
    assert overlap_rows(plan) == [["layers.0", "4", *overlap_rows(plan)[0][2:]]]
    text = summary(plan)
    assert "exposed communication" in text and "hidden behind compute" in text and "bwd reductions" in text
    path, trace = tmp_path / "plan.json", tmp_path / "step.json"
    plan.save(path)
    assert main(["show", str(path), "--trace", str(trace)]) == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    ops = [e for e in events if e["tid"] == 0 and "op" in e["args"]]  # nested in their layer's span
    compute = [e for e in events if e["tid"] == 0 and "op" not in e["args"]]
    comm = [e for e in events if e["tid"] == 1]
    for layer in compute:  # each layer's ops fill its compute span, named as in pmodel.code
        inside = [e["name"] for e in ops if layer["ts"] <= e["ts"] < layer["ts"] + layer["dur"]]
        forward = layer["name"].endswith("forward")
        if layer["name"].startswith("layers.0 "):
            assert inside == (["addmm", "relu", "addmm_1"] if forward else ["addmm_1", "relu", "addmm"])
        if layer["name"].startswith("layers.3 "):
            assert inside == (["addmm_6", "relu_3", "addmm_7"] if forward else ["addmm_7", "relu_3", "addmm_6"])
    assert [e["name"] for e in compute[:4]] == [f"layers.{k} forward" for k in range(4)]
    assert [e["name"] for e in compute[-4:]] == [f"layers.{k} backward" for k in (3, 2, 1, 0)]
    assert all(e["name"].endswith("gradient reductions, re-gathers") for e in comm)  # DDP: nothing to gather
    for e in comm:  # each reduction runs beside its layer's backward, started with it, of its parameters
        layer = e["name"].split()[0]
        assert any(c["ts"] == e["ts"] and c["name"].split()[0] == layer for c in compute)
        assert sorted(e["args"]["parameters"]) == [f"{layer}.{m}.{w}" for m in (0, 2) for w in ("bias", "weight")]
    end = max(e["ts"] + e["dur"] for e in events)
    assert end == pytest.approx(plan.predicted_step_s * 1e6, rel=1e-6)
    assert sum(e["dur"] for e in compute) == pytest.approx(  # slowed by 10% of the hidden reductions
        1e6 * (plan.predicted_compute_s + plan.predicted_exposed_comm_s), rel=1e-6)


def test_a_pipeline_plan_traces_its_schedule():
    """A pipeline plan's trace is its simulated schedule: one process per stage, a forward and
    a backward of every micro-batch on each."""
    import pathlib

    from models import GPT

    from autopar.trace import step_trace

    torch.manual_seed(0)
    model, x = GPT(vocab=64, d=32, heads=2, layers=2), torch.randint(0, 64, (8, 16))
    cluster = pathlib.Path(__file__).parent / "clusters" / "two_cpu_regions.yaml"
    plan = autopar.plan(model, (x,), cluster=str(cluster), pipeline=True, micro_batches=4)
    events = [e for e in step_trace(plan)["traceEvents"] if e["ph"] == "X"]
    for stage in range(len(plan.stages)):
        names = sorted(e["name"] for e in events if e["pid"] == stage)
        assert names == sorted(f"{kind} micro-batch {i}" for kind in ("forward", "backward") for i in range(4))
