"""The bad-input suite: every case gets a typed AutoparError whose message names the problem
(and, where one exists, a fix), never a raw traceback. One table, so gaps are easy to see;
CLI usage errors (exit code 2) are in test_cli_errors.py, cluster-file line numbers in
test_cluster_files.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import autopar
from autopar import AutoparError, ErrorKind
from autopar.cluster_file import parse_link_change
from models import MLP


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else x  # Python control flow on a tensor value


class DynamicShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x[x[:, 0] > 0])  # output size depends on the data


class Item(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * float(x.max().item())


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.emb(ids)


def _plan(model, inputs, **options):
    return lambda: autopar.plan(model, inputs, **options)


def _mlp_plan(**options):
    return _plan(MLP(), (torch.randn(8, 16),), **options)


def _load(tmp_path, text: str | bytes):
    def run():
        path = tmp_path / "plan.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return autopar.load_plan(path)
    return run


def _valid_plan_text() -> str:
    return autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100").to_json()


def _edit(change):
    def text():
        d = json.loads(_valid_plan_text())
        change(d)
        return json.dumps(d)
    return text


def _cluster_file(tmp_path, text: str):
    def run():
        path = tmp_path / "cluster.yaml"
        path.write_text(text)
        return autopar.plan(MLP(), (torch.randn(8, 16),), cluster=str(path))
    return run


TWO_REGIONS = os.path.join(os.path.dirname(__file__), "clusters", "two_cpu_regions.yaml")
_REGIONS = ("regions:\n  a: {device: cpu, nodes: 1, per_node: 1}\n  b: {device: cpu, nodes: 1, per_node: 1}\n"
            "links:\n  - {between: [a, b], bandwidth_GBps: 1, latency_ms: 1}\n")
X = torch.randn(8, 4)
CASES = [
    # (id, kind, message fragments, make the call: tmp_path -> callable)
    ("data-dependent control flow", ErrorKind.UNTRACEABLE, ["test_bad_input_suite.py", "torch.where"],
     lambda t: _plan(Branchy(), (X,))),
    ("dynamic output shape", ErrorKind.UNTRACEABLE, ["cannot plan DynamicShape", "depends on the data",
                                                     "test_bad_input_suite.py", "torch.where"],
     lambda t: _plan(DynamicShape(), (X,))),
    (".item() in forward", ErrorKind.UNTRACEABLE, ["cannot trace Item", ".item()"], lambda t: _plan(Item(), (X,))),
    ("not a module", ErrorKind.BAD_INPUT, ["must be a torch.nn.Module", "function"],
     lambda t: _plan(lambda x: x, (X,))),
    ("module without parameters", ErrorKind.BAD_INPUT, ["has no parameters"], lambda t: _plan(nn.ReLU(), (X,))),
    ("parameters never used", ErrorKind.BAD_INPUT, ["performs no tensor operations"], lambda t: _plan(Unused(), (X,))),
    ("inputs as a dict", ErrorKind.BAD_INPUT, ["tuple of tensors", "dict"], lambda t: _plan(MLP(), {"x": X})),
    ("non-tensor input", ErrorKind.BAD_INPUT, ["example input #1 is a int"], lambda t: _plan(MLP(), (X, 3))),
    ("wrong input width", ErrorKind.BAD_INPUT, ["MLP's forward fails on the example inputs (#0 (8, 15) float32)",
                                                "same reduction dim", "models.py", "layer(x)"],
     lambda t: _plan(MLP(), (torch.randn(8, 15),))),
    ("wrong input dtype", ErrorKind.BAD_INPUT, ["Lookup's forward fails", "#0 (2, 3) float32", "Long, Int"],
     lambda t: _plan(Lookup(), (torch.zeros(2, 3),))),
    ("float64 input to a float32 model", ErrorKind.BAD_INPUT, ["multiplies float32 and float64", "#0 float64",
                                                              "models.py"],
     lambda t: _plan(MLP(), (torch.randn(8, 16, dtype=torch.float64),))),
    ("int64 input to a float32 model", ErrorKind.BAD_INPUT, ["multiplies float32 and int64", "#0 int64"],
     lambda t: _plan(MLP(), (torch.ones(8, 16, dtype=torch.int64),))),
    ("too many inputs", ErrorKind.BAD_INPUT, ["MLP's forward fails", "#1 (8, 4) float32", "positional argument"],
     lambda t: _plan(MLP(), (torch.randn(8, 16), X))),
    ("empty cluster string", ErrorKind.BAD_CLUSTER, ["cannot parse cluster ''"], lambda t: _mlp_plan(cluster="")),
    ("zero devices", ErrorKind.BAD_CLUSTER, ["0 devices"], lambda t: _mlp_plan(cluster="0xH100")),
    ("unknown device", ErrorKind.BAD_CLUSTER, ["unknown device", "H1000"], lambda t: _mlp_plan(cluster="4xH1000")),
    ("cluster of the wrong type", ErrorKind.BAD_CLUSTER, ["int"], lambda t: _mlp_plan(cluster=8)),
    ("missing cluster file", ErrorKind.BAD_CLUSTER, ["nowhere.yaml"], lambda t: _mlp_plan(cluster="nowhere.yaml")),
    ("memory limit 0", ErrorKind.BAD_CLUSTER, ["memory limit must be positive", "memory_limit="], lambda t: _mlp_plan(cluster="2xH100", memory_limit=0)),
    ("negative memory limit", ErrorKind.BAD_CLUSTER, ["memory limit must be positive"], lambda t: _mlp_plan(cluster="2xH100", memory_limit=-1)),
    ("memory limit too small", ErrorKind.INFEASIBLE_MEMORY, ["bytes over", "Fixes"],
     lambda t: _mlp_plan(cluster="2xH100", memory_limit=1000)),
    ("mesh not matching the devices", ErrorKind.BAD_INPUT, ["mesh_shape (3,)", "cluster has 4"],
     lambda t: _mlp_plan(cluster="4xH100", mesh_shape=(3,))),
    ("mesh with a zero dim", ErrorKind.BAD_INPUT, ["mesh_shape must be", "got (0, 4)"],
     lambda t: _mlp_plan(cluster="4xH100", mesh_shape=(0, 4))),
    ("unknown solver", ErrorKind.BAD_INPUT, ["unknown solver 'gurobi'", "cpsat"],
     lambda t: _mlp_plan(cluster="2xH100", solver="gurobi")),
    ("unknown optimizer", ErrorKind.BAD_INPUT, ["unknown optimizer 'lamb'", "adamw"],
     lambda t: _mlp_plan(cluster="2xH100", optimizer="lamb")),
    ("time limit not positive", ErrorKind.BAD_INPUT, ["time_limit_s"],
     lambda t: _mlp_plan(cluster="2xH100", time_limit_s=0)),
    ("apply without a process group", ErrorKind.WORLD_MISMATCH, ["process group"],
     lambda t: lambda: autopar.apply(MLP(), autopar.Plan.from_json(_valid_plan_text()))),
    ("apply with a non-plan", ErrorKind.BAD_INPUT, ["needs an autopar.Plan", "dict"],
     lambda t: lambda: autopar.apply(MLP(), {"mesh_shape": [2]})),
    ("missing plan file", ErrorKind.BAD_PLAN, ["cannot read plan file"],
     lambda t: lambda: autopar.load_plan(os.path.join(t, "absent.json"))),
    ("truncated plan", ErrorKind.BAD_PLAN, ["not valid JSON", "byte"], lambda t: _load(t, _valid_plan_text()[:200])),
    ("binary garbage", ErrorKind.BAD_PLAN, ["undecodable byte"], lambda t: _load(t, b"\xff\xfe\x00garbage")),
    ("JSON that is not an object", ErrorKind.BAD_PLAN, ["holds a JSON list"], lambda t: _load(t, "[1, 2]")),
    ("plan from a newer autopar", ErrorKind.BAD_PLAN, ["schema version 99", "upgrade autopar"],
     lambda t: _load(t, _edit(lambda d: d.update(schema_version=99))())),
    ("plan with a key twice", ErrorKind.BAD_PLAN, ["'family' appears twice"],
     lambda t: _load(t, _valid_plan_text().replace('"family":', '"family": "one_mesh", "family":', 1))),
    ("plan with a field of the wrong type", ErrorKind.BAD_PLAN, ["field predicted_step_s", "a finite number", "'fast'"],
     lambda t: _load(t, _edit(lambda d: d.update(predicted_step_s="fast"))())),
    ("plan with a mesh of 10^13 devices", ErrorKind.BAD_PLAN, ["mesh_shape", "16,777,216"],
     lambda t: _load(t, _edit(lambda d: d.update(mesh_shape=[10 ** 13]))())),
    ("plan missing a field", ErrorKind.BAD_PLAN, ["'nodes'"], lambda t: _load(t, _edit(lambda d: d.pop("nodes"))())),
    ("plan with a malformed node", ErrorKind.BAD_PLAN, ["field nodes.bad", "outputs, inputs", "(missing)"],
     lambda t: _load(t, _edit(lambda d: d["nodes"].update(bad={"op": "x"}))())),
    ("cluster YAML with a wrong type", ErrorKind.BAD_CLUSTER, ["cluster.yaml:2", "`nodes`"],
     lambda t: _cluster_file(t, "device: H100\nnodes: two\nper_node: 8\n")),
    ("cluster YAML with negative bandwidth", ErrorKind.BAD_CLUSTER, ["bandwidth_GBps", "-1"],
     lambda t: _cluster_file(t, "device: H100\nnodes: 2\nper_node: 8\ninter_node: {bandwidth_GBps: -1}\n")),
    ("cluster YAML regions without a link", ErrorKind.BAD_CLUSTER, ["eu", "us", "link"],
     lambda t: _cluster_file(t, "regions:\n  us: {device: H100, nodes: 1, per_node: 2}\n"
                                "  eu: {device: H100, nodes: 1, per_node: 2}\n")),
    ("cluster YAML that is a list", ErrorKind.BAD_CLUSTER, ["cluster.yaml"], lambda t: _cluster_file(t, "- 1\n- 2\n")),
    # resource exhaustion: refused before anything is built (issue 25)
    ("cluster YAML alias bomb", ErrorKind.BAD_CLUSTER, ["cluster.yaml:1", "anchors and aliases"],
     lambda t: _cluster_file(t, 'a: &a ["x", "x"]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n'
                                "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n")),
    ("cluster YAML region given twice", ErrorKind.BAD_CLUSTER, ["cluster.yaml:3", "'us' appears twice", "line 2"],
     lambda t: _cluster_file(t, "regions:\n  us: {device: H100, nodes: 1, per_node: 8}\n"
                                "  us: {device: H100, nodes: 2, per_node: 8}\n")),
    ("cluster YAML of a billion devices", ErrorKind.BAD_CLUSTER, ["1,000,000,000 devices", "at most 16,777,216"],
     lambda t: _cluster_file(t, "device: H100\nnodes: 1000000\nper_node: 1000\n")),
    ("cluster YAML too large", ErrorKind.BAD_CLUSTER, ["larger than 1,048,576 bytes"],
     lambda t: _cluster_file(t, "# " + "x" * (1 << 20) + "\ndevice: H100\nnodes: 1\nper_node: 8\n")),
    ("memory limit nan", ErrorKind.BAD_CLUSTER, ["finite number of bytes", "nan"],
     lambda t: _mlp_plan(cluster="2xH100", memory_limit=float("nan"))),
    ("memory limit 1e300", ErrorKind.BAD_CLUSTER, ["1e+300 bytes is beyond any device"],
     lambda t: _mlp_plan(cluster="2xH100", memory_limit=1e300)),
    ("memory limit as text", ErrorKind.BAD_CLUSTER, ["must be a number of bytes", "str"],
     lambda t: _mlp_plan(cluster="2xH100", memory_limit="8GB")),
    ("a trillion devices", ErrorKind.BAD_CLUSTER, ["16,777,216"], lambda t: _mlp_plan(cluster="1000000000000xH100")),
    ("a device count of 5000 digits", ErrorKind.BAD_CLUSTER, ["more than 16,777,216 devices"],
     lambda t: _mlp_plan(cluster="9" * 5000 + "xH100")),
    # numbers OR-Tools cannot hold, counts that are no counts: refused where they enter
    ("time limit 1e300", ErrorKind.BAD_INPUT, ["time_limit_s must be", "604,800", "1e+300"],
     lambda t: _mlp_plan(cluster="2xH100", time_limit_s=1e300)),
    ("time limit infinite", ErrorKind.BAD_INPUT, ["time_limit_s must be", "inf"],
     lambda t: _mlp_plan(cluster="2xH100", time_limit_s=float("inf"))),
    ("mesh shape as a string", ErrorKind.BAD_INPUT, ["mesh_shape must be a tuple", "'22'"],
     lambda t: _mlp_plan(cluster="4xH100", mesh_shape="22")),
    ("zero micro-batches", ErrorKind.BAD_INPUT, ["micro_batches must be a whole number of 1 or more", "0"],
     lambda t: _mlp_plan(cluster="4xH100", micro_batches=0)),
    ("micro-batches without a pipeline", ErrorKind.BAD_INPUT, ["micro_batches=4 pins a pipeline's micro-batch count",
                                                               "no pipeline plan is made here"],
     lambda t: _mlp_plan(cluster="4xH100", micro_batches=4)),
    ("micro-batches not dividing the batch", ErrorKind.BAD_INPUT, ["micro_batches=3 must divide the batch size 8"],
     lambda t: _mlp_plan(cluster=TWO_REGIONS, micro_batches=3)),
    ("batch split without replicas", ErrorKind.BAD_INPUT, ["batch_split=(4, 4) pins the rows", "one device group"],
     lambda t: _mlp_plan(cluster="4xH100", batch_split=(4, 4))),
    ("batch split with a zero", ErrorKind.BAD_INPUT, ["batch_split must be a tuple of whole numbers of 1 or more"],
     lambda t: _mlp_plan(cluster=TWO_REGIONS, batch_split=(0, 8))),
    ("batch split of the wrong sum", ErrorKind.BAD_INPUT, ["batch_split=(1, 1) must give each of the 2 groups",
                                                           "batch size 8"],
     lambda t: _mlp_plan(cluster=TWO_REGIONS, batch_split=(1, 1))),
    ("a batch of zero rows", ErrorKind.BAD_INPUT, ["example input #0 has shape (0, 16): no elements"],
     lambda t: _plan(MLP(), (torch.randn(0, 16),))),
    ("cluster YAML with one link twice", ErrorKind.BAD_CLUSTER, ["cluster.yaml:6", "a second link between 'b' and 'a'",
                                                                 "links[0]"],
     lambda t: _cluster_file(t, _REGIONS + "  - {between: [b, a], bandwidth_GBps: 100}\n")),
    ("cluster YAML link from a region to itself", ErrorKind.BAD_CLUSTER, ["[a, a] names one"],
     lambda t: _cluster_file(t, _REGIONS + "  - {between: [a, a], bandwidth_GBps: 100}\n")),
    ("cluster YAML link of 1e300 GB/s", ErrorKind.BAD_CLUSTER, ["beyond any link", "check the unit"],
     lambda t: _cluster_file(t, _REGIONS.replace("bandwidth_GBps: 1", "bandwidth_GBps: 1.0e+300"))),
    ("cluster YAML bandwidth nan", ErrorKind.BAD_CLUSTER, ["bandwidth_GBps", "positive number", "nan"],
     lambda t: _cluster_file(t, _REGIONS.replace("bandwidth_GBps: 1", "bandwidth_GBps: .nan"))),
    ("a link change of 1e300 GB/s", ErrorKind.BAD_INPUT, ["--link 'a-b=1e300GBps'", "beyond any link"],
     lambda t: lambda: parse_link_change("a-b=1e300GBps")),
    # plan files and paths
    ("load_plan(None)", ErrorKind.BAD_INPUT, ["takes the path of a plan file", "NoneType"],
     lambda t: lambda: autopar.load_plan(None)),
    ("saving into a missing folder", ErrorKind.BAD_INPUT, ["cannot write", "nowhere", "does not exist"],
     lambda t: lambda: autopar.Plan.from_json(_valid_plan_text()).save(os.path.join(t, "nowhere", "plan.json"))),
    ("saving to an empty path", ErrorKind.BAD_INPUT, ["names no file"],
     lambda t: lambda: autopar.Plan.from_json(_valid_plan_text()).save("")),
    ("plan with negative bytes", ErrorKind.BAD_PLAN, ["parameters.layers.0.weight.bytes", "0 or more", "-5"],
     lambda t: _load(t, _edit(lambda d: d["parameters"]["layers.0.weight"].update(bytes=-5))())),
    ("plan with a negative step time", ErrorKind.BAD_PLAN, ["predicted_step_s", "0 or more", "-1.0"],
     lambda t: _load(t, _edit(lambda d: d.update(predicted_step_s=-1.0))())),
    ("plan with an unknown family", ErrorKind.BAD_PLAN, ["field family", "one_mesh, pipeline, replicas", "'quantum'"],
     lambda t: _load(t, _edit(lambda d: d.update(family="quantum"))())),
    ("plan with an unknown exchange", ErrorKind.BAD_PLAN, ["parameters.layers.0.weight.exchange", "'teleport'"],
     lambda t: _load(t, _edit(lambda d: d["parameters"]["layers.0.weight"].update(exchange="teleport"))())),
    ("plan with zero micro-batches", ErrorKind.BAD_PLAN, ["micro_batches", "1 or more micro-batches"],
     lambda t: _load(t, _edit(lambda d: d.update(micro_batches=0))())),
    ("plan with negative hosts", ErrorKind.BAD_PLAN, ["cluster.hosts", "a positive integer"],
     lambda t: _load(t, _edit(lambda d: d["cluster"].update(hosts=-1))())),
    ("plan whose nodes are a list", ErrorKind.BAD_PLAN, ["field nodes should be an object", "[]"],
     lambda t: _load(t, _edit(lambda d: d.update(nodes=[]))())),
    ("plan without a schema version", ErrorKind.BAD_PLAN, ["has no schema_version: it is not an autopar plan file"],
     lambda t: _load(t, _edit(lambda d: d.pop("schema_version"))())),
    ("plan with a schema version as text", ErrorKind.BAD_PLAN, ["schema_version should be an integer", "'2'"],
     lambda t: _load(t, _edit(lambda d: d.update(schema_version="2"))())),
    ("plan parameter without a placement", ErrorKind.BAD_PLAN, ["parameters.layers.0.weight", "placement (missing)"],
     lambda t: _load(t, _edit(lambda d: d["parameters"]["layers.0.weight"].pop("placement"))())),
    ("a JSON file given as the cluster", ErrorKind.BAD_CLUSTER, ["cluster files are YAML"],
     lambda t: (t / "c.json").write_text("{}") and _mlp_plan(cluster=str(t / "c.json"))),
    ("plan with a cluster that is no cluster", ErrorKind.BAD_PLAN, ["cluster.spec", "'banana'"],
     lambda t: _load(t, _edit(lambda d: d["cluster"].update(spec="banana"))())),
    ("plan whose parameters are null", ErrorKind.BAD_PLAN, ["field parameters should be an object", "None"],
     lambda t: _load(t, _edit(lambda d: d.update(parameters=None))())),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, tmp_path):
    _name, kind, fragments, make = case
    with pytest.raises(AutoparError) as info:
        make(str(tmp_path) if "plan file" in _name else tmp_path)()
    assert info.value.kind == kind, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_the_suite_is_large_enough():
    assert len(CASES) >= 30


def test_a_failed_save_leaves_the_old_plan_intact(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    plan = autopar.Plan.from_json(_valid_plan_text())
    plan.save(path)
    before = path.read_text()

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        plan.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left behind
