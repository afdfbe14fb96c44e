"""Fuzzing the input boundaries (issue 25): random and mutated cluster strings, memory limits,
cluster files and plan files get a typed AutoparError or a valid result — never another
exception type, never a hang (hypothesis' deadline bounds each example)."""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar import AutoparError
from autopar.cluster import Cluster

# derandomized: CI runs the same examples every time (a found failure is fixed, not flaky)
FAST = settings(max_examples=150, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
DEVICES = ["H100", "A100-80GB", "cpu", "h100", "H1000", "", "x", "H100-SXM"]


def _cluster_or_error(spec, limit=None):
    try:
        cluster = Cluster.from_spec(spec, memory_limit_bytes=limit)
    except AutoparError:
        return None
    assert 1 <= cluster.num_devices and cluster.memory_limit_bytes > 0
    return cluster


@FAST
@given(st.one_of(
    st.text(max_size=40),
    st.builds(lambda h, g, d, sep: f"{h}{sep}{g}{sep}{d}", st.integers(-5, 10 ** 15).map(str) | st.text("0123456789",
              max_size=30), st.integers(-5, 10 ** 15).map(str), st.sampled_from(DEVICES), st.sampled_from(["x", " x ", "X"])),
    st.builds(lambda n, d: f"{n}x{d}", st.text("0123456789", min_size=1, max_size=5000), st.sampled_from(DEVICES)),
))
def test_cluster_strings(spec):
    _cluster_or_error(spec)


@FAST
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10 ** 30, 10 ** 30),
                 st.text(max_size=8), st.booleans(), st.none()))
def test_memory_limits(limit):
    cluster = _cluster_or_error("2xH100", limit)
    if cluster is not None and limit is not None:
        assert math.isfinite(float(limit)) and cluster.memory_limit_bytes == int(limit)


_KEYS = ["device", "nodes", "per_node", "regions", "links", "devices", "intra_node", "inter_node",
         "memory_reserve_GB", "bandwidth_GBps", "latency_us", "us", "eu", "between"]
_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 10 ** 13), st.floats(allow_nan=True), st.sampled_from(DEVICES),
              st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4),
    max_leaves=12)


@FAST
@given(_VALUES, st.sampled_from(["json", "text"]))
def test_cluster_files(tmp_path_factory, data, form):
    path = tmp_path_factory.mktemp("cluster") / "cluster.yaml"
    text = json.dumps(data) if form == "json" else str(data)  # JSON is YAML; str() gives near-YAML noise
    path.write_text(text)
    _cluster_or_error(str(path))


def _plan_dict() -> dict:
    import torch

    from models import MLP

    if not hasattr(_plan_dict, "text"):
        _plan_dict.text = autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100").to_json()
    return json.loads(_plan_dict.text)


def _paths(d, prefix=()):
    """Every key path of a JSON document."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from _paths(value, prefix + (key,))


@FAST
@given(st.data())
def test_mutated_plan_files(tmp_path_factory, data):
    plan = _plan_dict()
    paths = list(_paths(plan))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        parent = plan
        try:
            for key in path[:-1]:
                parent = parent[key]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = data.draw(_VALUES)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced the way there
    file = tmp_path_factory.mktemp("plan") / "plan.json"
    file.write_text(json.dumps(plan))
    try:
        loaded = autopar.load_plan(str(file))
    except AutoparError:
        return
    from autopar.cli_commands import summary_json
    from autopar.html_report import render
    from autopar.plan_diff import explain
    from autopar.report import summary
    summary_json(loaded), summary(loaded), render(loaded)  # a plan that loads also shows
    for node in list(loaded.nodes)[:3]:
        explain(loaded, node)


_NUMBERS = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 20, 10 ** 20), st.floats(allow_nan=True),
                     st.text(max_size=6), st.lists(st.integers(-3, 9), max_size=4), st.tuples(st.integers(-3, 9)))


@FAST
@given(st.fixed_dictionaries({}, optional={name: _NUMBERS for name in (
    "time_limit_s", "micro_batches", "mesh_shape", "batch_split", "bucket_cap_mb", "prefetch_layers")}))
def test_numeric_plan_options(values):
    """autopar.plan's numeric options: accepted as what they say, or a typed error."""
    from autopar.planning import PlanOptions

    try:
        options = PlanOptions(**values)
    except AutoparError:
        return
    assert 0 < options.time_limit_s <= 7 * 24 * 3600
    for counts in (options.mesh_shape, options.batch_split):
        assert counts is None or (isinstance(counts, tuple) and all(isinstance(c, int) and c >= 1 for c in counts))
    assert options.micro_batches is None or options.micro_batches >= 1


@FAST
@given(st.one_of(
    st.text(max_size=30),
    st.builds(lambda name, dims, dtype: f"{name}={'x'.join(dims)}:{dtype}", st.sampled_from(["x", "", "tokens"]),
              st.lists(st.text("0123456789", min_size=1, max_size=14), min_size=1, max_size=4),
              st.sampled_from(["float32", "int64", "bfloat16", "float99", "Tensor", "bool"]))))
def test_input_specs(spec):
    """`--input NAME=SHAPE:DTYPE`: a tensor of that shape, or a usage error (exit 2) — never a
    tensor larger than the machine can hold, never another exception."""
    from autopar.model_files import UsageError, parse_input_spec

    try:
        tensor = parse_input_spec(spec, device="meta")
    except UsageError:
        return
    assert tensor.dim() >= 1


@FAST
@given(st.one_of(st.text(max_size=30), st.builds(
    lambda which, number, unit, latency: f"{which}={number}{unit}{latency}",
    st.sampled_from(["a-b", "inter_node", "", "x"]), st.one_of(st.floats(allow_nan=True).map(str),
                                                                st.integers(-5, 10 ** 30).map(str)),
    st.sampled_from(["GBps", "Mbps", "", "TBps"]), st.sampled_from(["", "@40ms", "@-1us", "@1e300s", "@nan s"]))))
def test_link_changes(text):
    """`autopar replan --link`: a finite, bounded link, or a typed error."""
    from autopar.cluster_file import parse_link_change

    try:
        which, bandwidth, latency = parse_link_change(text)
    except AutoparError:
        return
    assert which and 0 < bandwidth <= 1e15 and (latency is None or 0 <= latency <= 7 * 24 * 3600)


@FAST
@given(st.one_of(st.text(max_size=12), st.builds(lambda n, u: f"{n}{u}", st.floats(allow_nan=True).map(str),
                                                 st.sampled_from(["", "GB", "GiB", "gib", "XB", " MB"]))))
def test_memory_limit_flags(text):
    """`--memory-limit`: a number of bytes (its range checked like every memory limit), or
    argparse's usage error naming the forms it takes."""
    import argparse

    from autopar.cli_args import memory_bytes

    try:
        value = memory_bytes(text)
    except argparse.ArgumentTypeError as exc:
        assert "bytes per device" in str(exc)
        return
    assert isinstance(value, float)
    _cluster_or_error("2xH100", value)
