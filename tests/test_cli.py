"""The CLI through its real entry point (a subprocess), on a factory, a .pt2 and a .pt: what
each command prints and writes. Usage errors and bad inputs: tests/test_cli_errors.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

from models import MLP

HERE = os.path.dirname(__file__)


def autopar(*args, cwd=HERE):
    exe = shutil.which("autopar")
    cmd = [exe] if exe else [sys.executable, "-m", "autopar.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=cwd, timeout=600)


def test_plan_factory_json_and_show(tmp_path):
    out = tmp_path / "plan.json"
    done = autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(out), "--json", "--precision", "bf16")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    for key in ("schema_version", "status", "plan_time_s", "predicted_step_s", "devices", "mesh", "stages",
                "peak_memory_bytes", "memory_limit_bytes", "baselines", "parameters", "solver"):
        assert key in summary, key
    assert summary["status"] == "optimal" and summary["devices"] == 2
    assert set(summary["baselines"]) >= {"ddp", "fsdp", "megatron_tp"}
    assert summary["parameters"]["layers.0.weight"]["exchange"] in ("allreduce", "reduce_scatter")
    shown = autopar("show", str(out), "--json")
    assert shown.returncode == 0, shown.stderr
    again = json.loads(shown.stdout)
    assert again["predicted_step_s"] == summary["predicted_step_s"]
    assert again["mixed_precision"] == summary["mixed_precision"]
    assert again["imbalance"] == {"time": 1.0, "memory": 1.0}  # one mesh: every device runs the same program
    # the practitioners' figures: an MLP on rows has no tokens per second, but a model FLOPs utilisation
    assert summary["tokens_per_s_per_device"] is None and 0 < summary["predicted_mfu"] < 1
    assert again["predicted_mfu"] == summary["predicted_mfu"] and again["tokens_per_s_per_device"] is None
    top = again["top_nodes"]["by_time"]
    assert len(top) == 5 and top[0]["compute_s"] + top[0]["reshard_s"] >= top[-1]["compute_s"] + top[-1]["reshard_s"]
    assert [g["layers"] for g in again["layers"]] == ["layers.0", "layers.1", "layers.2"] or \
        any("-" in g["layers"] for g in again["layers"])
    table = autopar("show", str(out))
    assert f"predicted MFU {100 * summary['predicted_mfu']:.1f}%" in table.stdout
    for heading in ("mixed precision: compute, activations and weight gathers in bfloat16", "memory per device",
                    "plan vs baselines", "parameter placements per layer",
                    "top 5 nodes by time", "top 5 nodes by memory", "parameters by placement"):
        assert heading in table.stdout, heading


def test_a_hand_written_configuration_is_pinned_from_the_command_line():
    done = autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "--configuration", "fsdp", "--json")
    assert done.returncode == 0, done.stderr
    placements = {p["placement"] for p in json.loads(done.stdout)["parameters"].values()}
    assert "S(0)" in placements and placements <= {"S(0)", "R"}, placements  # FSDP: rows split, small ones whole
    refused = autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "--configuration", "zero4")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr


def test_plan_pt2_and_pt(tmp_path):
    model, x = MLP(), torch.randn(8, 16)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "mlp.pt2")
    done = autopar("plan", str(tmp_path / "mlp.pt2"), "--cluster", "2xH100", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["devices"] == 2
    torch.save(model, tmp_path / "mlp.pt")
    refused = autopar("plan", str(tmp_path / "mlp.pt"), "--cluster", "2xH100", "--input", "x=8x16:float32")
    assert refused.returncode == 2 and "--trust-pickle" in refused.stderr
    done = autopar("plan", str(tmp_path / "mlp.pt"), "--cluster", "2xH100", "--input", "x=8x16:float32",
                   "--trust-pickle", "--json")
    assert done.returncode == 0, done.stderr


def test_devices_lists_the_catalog():
    done = autopar("devices", "--json")
    assert done.returncode == 0
    names = {d["name"] for d in json.loads(done.stdout)}
    assert {"A100-80GB", "H100-SXM", "cpu"} <= names
    assert "example:" in autopar("plan", "--help").stdout


def test_diff_two_plans(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(a)).returncode == 0
    assert autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "--memory-limit", "14000",
                   "--optimizer", "sgd", "-o", str(b)).returncode == 0
    done = autopar("diff", str(a), str(b), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["same_model"] and result["memory_bytes"]["delta"] < 0
    assert result["parameters_changed"]  # the memory limit forced some parameters to shard
    text = autopar("diff", str(a), str(b)).stdout
    assert "predicted step" in text and "parameters and" in text


def test_validate_accepts_its_model_and_refuses_another(tmp_path):
    plan = tmp_path / "plan.json"
    assert autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(plan)).returncode == 0
    ok = autopar("validate", str(plan), "models:tiny_mlp", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["valid"], ok.stderr
    other = autopar("validate", str(plan), "models:MLP", "--input", "x=4x16:float32")
    assert other.returncode == 1 and "does not match" in other.stdout


def test_explain_a_node(tmp_path):
    plan = tmp_path / "plan.json"
    assert autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(plan)).returncode == 0
    done = autopar("explain", str(plan), "addmm_1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    chosen = [c for c in result["candidates"] if c["chosen"]]
    assert len(chosen) == 1 and len(result["candidates"]) > 1
    # with every other node fixed, no single alternative is cheaper and within memory
    assert all(c["slower_by_s"] >= -1e-12 or c["memory_delta_bytes"] > 0 for c in result["candidates"])
    assert "vs chosen" in autopar("explain", str(plan), "addmm_1").stdout
    missing = autopar("explain", str(plan), "addmm_99")
    assert missing.returncode == 2 and "no node 'addmm_99'" in missing.stderr


def test_profile_writes_a_cluster_file_the_planner_accepts(tmp_path):
    out = tmp_path / "cpu.yaml"
    done = autopar("profile", "--out", str(out), "--quick")
    assert done.returncode == 0, done.stderr
    assert "GFLOP/s" in done.stdout and out.exists()
    from autopar.cluster import Cluster

    cluster = Cluster.from_spec(str(out))
    assert cluster.num_devices == 2 and cluster.device.name == "cpu-local"
    assert cluster.device.flops_per_s("float32") > 1e8 and cluster.device.memory_bandwidth_Bps > 1e8
    assert 0 < cluster.intra_link.bandwidth_Bps <= cluster.device.memory_bandwidth_Bps
    # measured, not assumed: what gloo hides of each collective kind behind matmuls on this host
    assert "overlap_efficiency" in out.read_text() and 0.0 <= cluster.device.overlap_efficiency <= 1.0
    kinds = dict(cluster.device.collective_overlap)
    assert sorted(kinds) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert all(-1.0 <= eta <= 1.0 for eta in kinds.values())
    assert cluster.device.overlap_efficiency == max(0.0, min(kinds.values()))
    planned = autopar("plan", "models:tiny_mlp", "--cluster", str(out), "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["devices"] == 2


def test_plan_shows_its_phases_on_a_terminal(tmp_path):
    """On a terminal, stderr carries a spinner naming the phase (capture, each mesh's solve, the result)."""
    import pty

    leader, follower = pty.openpty()
    exe = shutil.which("autopar")
    cmd = [exe] if exe else [sys.executable, "-m", "autopar.cli"]
    proc = subprocess.Popen(cmd + ["plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(tmp_path / "p.json")],
                            stdout=subprocess.PIPE, stderr=follower, cwd=HERE)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        shown += chunk
    proc.wait(timeout=600)
    os.close(leader)
    assert proc.returncode == 0
    text = shown.decode(errors="replace")
    assert "capturing and planning MLP" in text and "plan: mesh" in text, text[-500:]


def test_every_node_of_the_readme_gpt_plan_explains_at_least_two_alternatives():
    """The README's quick-start plan: every node whose op has more than one placement lists ≥ 2
    alternatives with their costs (a view's alternatives pay the reshard its producer would
    need); the one that has none says why."""
    import sys

    import autopar as package
    from autopar.plan_diff import explain, explain_text

    sys.path.insert(0, os.path.join(HERE, os.pardir))
    from examples.gpt import build

    model, inputs = build(layers=2, d=64, vocab=64, seq=32, batch=8)
    plan = package.plan(model, inputs, cluster="4xcpu")
    single = [name for name, node in plan.nodes.items() if len(node.alternatives) < 2]
    assert [plan.nodes[name].op for name in single] == ["aten.arange.start_step"], single
    for name in plan.nodes:
        rows = explain(plan, name)["candidates"]
        assert all(r["compute_s"] >= 0 and r["reshard_s"] >= 0 for r in rows), (name, rows)
    assert "no other candidate" in explain_text(explain(plan, single[0]))
