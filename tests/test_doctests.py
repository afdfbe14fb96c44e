"""Docstring examples in the types layer are tests too."""

import doctest
import importlib

import pytest

MODULES = ["autopar.cluster", "autopar.mesh", "autopar.comm", "autopar.units", "autopar.errors",
           "autopar.problem", "autopar.plan", "autopar.devices", "autopar.profile_collectives", "autopar.planning.replicas",
           "autopar.planning.options", "autopar.solvers.pipeline", "autopar.solvers.balance",
           "autopar.solvers.formulation", "autopar.cli_args", "autopar.plan_types", "autopar.plan_io",
           "autopar.passes.layer_recompute"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0
