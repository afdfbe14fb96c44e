"""Bad input gets a typed AutoparError with a specific message, never a deep traceback."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

import autopar
from autopar import AutoparError, ErrorKind
from models import MLP


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            return self.lin(x)
        return x


class NoParams(nn.Module):
    def forward(self, x):
        return x * 2


class Empty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)  # owns parameters but never uses them

    def forward(self, x):
        return x


def test_untraceable_model_names_the_source_line():
    with pytest.raises(AutoparError, match=r"(?s)cannot trace DataDependent.*test_bad_inputs.py:\d+.*x.sum\(\) > 0.*fixes") as info:
        autopar.plan(DataDependent(), (torch.randn(2, 4),), cluster="2xH100")
    assert info.value.kind is ErrorKind.UNTRACEABLE


USER_MODEL = """\
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else x
"""


@pytest.mark.parametrize("folder", ["autopar", "passes"])
def test_untraceable_names_user_file_in_a_folder_named_like_the_package(tmp_path, folder):
    """A user's project under a folder named `autopar` or `passes` is still the user's code."""
    path = tmp_path / folder / "usermodel.py"
    path.parent.mkdir()
    path.write_text(USER_MODEL)
    spec = importlib.util.spec_from_file_location(f"usermodel_in_{folder}", path)
    usermodel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(usermodel)
    with pytest.raises(AutoparError) as info:
        autopar.plan(usermodel.Branchy(), (torch.randn(2, 4),), cluster="2xH100")
    assert info.value.kind is ErrorKind.UNTRACEABLE
    assert f"at {path}:11: `return self.lin(x) if x.sum() > 0 else x`" in str(info.value)


def test_model_without_parameters():
    with pytest.raises(AutoparError, match="NoParams has no parameters") as info:
        autopar.plan(NoParams(), (torch.randn(2, 4),), cluster="2xH100")
    assert info.value.kind is ErrorKind.BAD_INPUT


def test_empty_model():
    with pytest.raises(AutoparError, match="Empty.forward performs no tensor operations"):
        autopar.plan(Empty(), (torch.randn(2, 4),), cluster="2xH100")


def test_not_a_module():
    with pytest.raises(AutoparError, match="model must be a torch.nn.Module, got function"):
        autopar.plan(lambda x: x, (torch.randn(2, 4),), cluster="2xH100")


@pytest.mark.parametrize("spec, message", [
    ("", "cannot parse cluster ''"),
    ("banana", "cannot parse cluster 'banana'"),
    ("0xH100", "has 0 devices"),
    ("4xTPU9", "unknown device 'TPU9'; known devices: "),
])
def test_bad_cluster_strings(spec, message):
    with pytest.raises(AutoparError, match=message) as info:
        autopar.plan(MLP(), (torch.randn(8, 16),), cluster=spec)
    assert info.value.kind is ErrorKind.BAD_CLUSTER


def test_memory_too_small_reports_bytes_and_fixes():
    with pytest.raises(AutoparError, match=r"needs at least \d+ bytes .* each device has 1000 bytes .*bytes over.*Fixes: 1\)") as info:
        autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100", memory_limit=1000)
    assert info.value.kind is ErrorKind.INFEASIBLE_MEMORY


def test_nonpositive_memory_limit():
    with pytest.raises(AutoparError, match="memory limit must be positive, at least 1 byte, got 0 bytes"):
        autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100", memory_limit=0)


def test_mesh_shape_that_does_not_match_the_cluster():
    with pytest.raises(AutoparError, match=r"mesh_shape \(3,\) has 3 devices but the cluster has 2"):
        autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100", mesh_shape=(3,))


def test_unknown_solver_and_optimizer():
    with pytest.raises(AutoparError, match="unknown solver 'gurobi'; available: cpsat"):
        autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100", solver="gurobi")
    with pytest.raises(AutoparError, match="unknown optimizer 'lion'"):
        autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100", optimizer="lion")


def test_non_tensor_inputs():
    with pytest.raises(AutoparError, match="example input #0 is a str"):
        autopar.plan(MLP(), ("hello",), cluster="2xH100")


def test_apply_outside_a_process_group_or_with_wrong_world_size():
    plan = autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100")
    with pytest.raises(AutoparError, match=r"apply\(\) needs an initialised process group of 2 ranks") as info:
        autopar.apply(MLP(), plan)
    assert info.value.kind is ErrorKind.WORLD_MISMATCH


def test_corrupt_and_future_plan_files(tmp_path):
    plan = autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100")
    path = tmp_path / "plan.json"
    plan.save(path)
    text = path.read_text()
    (tmp_path / "truncated.json").write_text(text[: len(text) // 2])
    with pytest.raises(AutoparError, match=r"truncated.json is not valid JSON: .* line \d+ column \d+ \(byte \d+\)") as info:
        autopar.load_plan(tmp_path / "truncated.json")
    assert info.value.kind is ErrorKind.BAD_PLAN
    future = json.loads(text)
    future["schema_version"] = 99
    (tmp_path / "future.json").write_text(json.dumps(future))
    with pytest.raises(AutoparError, match="plan schema version 99; this autopar reads version 2: upgrade autopar"):
        autopar.load_plan(tmp_path / "future.json")
    missing = json.loads(text)
    del missing["nodes"]
    (tmp_path / "missing.json").write_text(json.dumps(missing))
    with pytest.raises(AutoparError, match="field 'nodes' is missing or malformed"):
        autopar.load_plan(tmp_path / "missing.json")
    with pytest.raises(AutoparError, match="cannot read plan file"):
        autopar.load_plan(tmp_path / "absent.json")
