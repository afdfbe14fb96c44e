"""The CLI's answers to usage errors and bad inputs, through its real entry point: exit 2
with the file, option or node named (the nearest option for a misspelt one), exit 1 with one
line for a planning failure or an internal error, nothing written, no torch traceback, and
quiet ends on a closed pipe. What the commands print when all is well: tests/test_cli.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from models import MLP
from test_cli import HERE, autopar


@pytest.mark.parametrize("args, message", [
    (["plan", "models:tiny_mlp"], "--cluster"),
    (["plan", "models:tiny_mlp", "--cluster", "2xH100", "--input", "x=8by16"], "bad --input"),
    (["plan", "models:nope", "--cluster", "2xH100"], "cannot import"),
    (["plan", "models:tiny_mlp", "--cluster", "banana"], "cannot parse cluster"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2(args, message):
    done = autopar(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_planning_failure_exits_1(tmp_path):
    done = autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "--memory-limit", "1000")
    assert done.returncode == 1
    assert "INFEASIBLE_MEMORY" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "bad.json").write_text("{not json")
    bad = autopar("show", str(tmp_path / "bad.json"))
    assert bad.returncode == 1 and "not valid JSON" in bad.stderr


def test_an_internal_error_is_one_line_and_exit_1_with_the_traceback_on_request(monkeypatch, capsys):
    """Below the checked boundary, a bug of ours: no traceback unless --debug / AUTOPAR_DEBUG=1."""
    from autopar import cli

    def broken(args):
        raise RuntimeError("a bug\nsecond line")

    monkeypatch.setattr(cli, "cmd_devices", broken)  # what build_parser wires to "devices"
    monkeypatch.delenv("AUTOPAR_DEBUG", raising=False)
    assert cli.main(["devices"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopar devices: internal error: RuntimeError: a bug") and "--debug" in err
    assert "Traceback" not in err and "second line" not in err
    with pytest.raises(RuntimeError):
        cli.main(["devices", "--debug"])
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main(["devices"])


BAD_FILES = {  # (files in the working folder, arguments, what the message says): exit 2, nothing written
    "factory_syntax_error": ({"broken_syntax.py": "def build(:\n    pass\n"}, ["broken_syntax:build"],
                             "syntax error in"),
    "factory_raises": ({"raising_factory.py": "def build():\n    raise ValueError('boom')\n"}, ["raising_factory:build"],
                       "raised ValueError: boom (at"),
    "module_raises": ({"raising_module.py": "raise RuntimeError('at import')\n"}, ["raising_module:build"],
                      "importing raising_module raised RuntimeError: at import"),
    "factory_not_callable": ({"constant_factory.py": "build = 3\n"}, ["constant_factory:build"],
                             "build is of type int, not a function"),
    "corrupt_pt2": ({"model.pt2": b"\x00garbage"}, ["model.pt2", "--input", "x=8x16:float32"],
                    "not a readable torch.export archive"),
    "corrupt_pt": ({"model.pt": b"\x80garbage"}, ["model.pt", "--trust-pickle", "--input", "x=8x16:float32"],
                   "not a readable torch.save file"),
    "batch_split_words": ({}, ["models:tiny_mlp", "--batch-split", "a,b"], "not a comma-separated list of row counts"),
    "output_folder_missing": ({}, ["models:tiny_mlp", "-o", "missing/plan.json"], "does not exist"),
    "output_is_a_folder": ({"out/keep.txt": "x"}, ["models:tiny_mlp", "-o", "out"], "is a folder"),
    "output_path_empty": ({}, ["models:tiny_mlp", "-o", ""], "names no file"),
    "factory_returns_none": ({"none_factory.py": "def build():\n    return None\n"}, ["none_factory:build"],
                             "returned None; autopar needs a torch.nn.Module"),
    "pt_of_a_state_dict": ({"sd.pt": "STATE_DICT"}, ["sd.pt", "--trust-pickle", "--input", "x=8x16:float32"],
                           "holds an OrderedDict (a state_dict?), not a model"),
    "factory_returns_three": ({"three_factory.py": "def build():\n    return 1, 2, 3\n"}, ["three_factory:build"],
                              "returned a 3-item tuple"),
    "factory_exits": ({"exiting_factory.py": "import sys\ndef build():\n    sys.exit(3)\n"}, ["exiting_factory:build"],
                      "called sys.exit(3)"),
    "input_beyond_memory": ({}, ["models:tiny_mlp", "--input", "x=1000000000000x1000000000000:float32"],
                            "more than half this machine's memory"),
    "input_of_zero_rows": ({}, ["models:tiny_mlp", "--input", "x=0x16:float32"], "has a dim of size 0"),
    "micro_batches_without_pipeline": ({}, ["models:tiny_mlp", "--micro-batches", "4"], "no pipeline plan is made"),
    "time_limit_1e300": ({}, ["models:tiny_mlp", "--time-limit", "1e300"], "time_limit_s must be"),
    "memory_limit_words": ({}, ["models:tiny_mlp", "--memory-limit", "abc"], "is not an amount of memory"),
    "memory_limit_minus_inf": ({}, ["models:tiny_mlp", "--memory-limit", "-inf"], "finite number of bytes, got -inf"),
    "batch_split_negative": ({}, ["models:tiny_mlp", "--batch-split", "-1,9"], "every region needs at least one row"),
    "input_unknown_dtype": ({}, ["models:tiny_mlp", "--input", "x=8x16:float99"], "'float99' is not a torch dtype"),
    "input_given_twice": ({}, ["models:tiny_mlp", "--input", "x=8x16:float32", "--input", "x=8x16:float32"],
                          "--input x is given more than once"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_model_files_factories_and_paths_exit_2_naming_them(case, tmp_path, monkeypatch, capsys):
    from autopar import cli

    files, args, message = BAD_FILES[case]
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        if content == "STATE_DICT":  # what torch.save(model.state_dict()) writes
            torch.save(MLP().state_dict(), tmp_path / name)
            continue
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(HERE)  # models:tiny_mlp
    before = sorted(p.name for p in tmp_path.rglob("*"))
    try:
        code = cli.main(["plan", *args, "--cluster", "2xH100"])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "internal error" not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*") if "__pycache__" not in p.parts) == \
        [n for n in before if n != "__pycache__"]


def test_a_batch_sweep_that_fails_writes_no_plan(tmp_path, monkeypatch):
    """The plan file is written last: a sweep that cannot be predicted leaves nothing behind."""
    from autopar import cli
    from autopar.plan import Plan

    monkeypatch.syspath_prepend(HERE)

    def refuse(self, batch_size):
        raise autopar_error(batch_size)

    monkeypatch.setattr(Plan, "predict", refuse)
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "--batch-size", "8,16",
                     "-o", str(tmp_path / "plan.json")]) == 2
    assert not (tmp_path / "plan.json").exists()


def autopar_error(batch_size: int):
    from autopar import AutoparError, ErrorKind

    return AutoparError(ErrorKind.BAD_INPUT, f"cannot predict batch {batch_size}")


def test_validate_names_placements_the_parameters_cannot_take(tmp_path, monkeypatch, capsys):
    """A plan whose placements split a dim the parameter lacks, or one that does not divide
    over its devices, no longer "matches the model" (lowering would fail on each)."""
    from autopar import cli

    monkeypatch.syspath_prepend(HERE)
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "3xH100", "-o", str(path), "--json"]) == 0
    plan = json.loads(path.read_text())
    plan["parameters"]["layers.0.weight"]["placement"] = "S(7)"
    plan["parameters"]["layers.0.bias"]["optimizer_state"] = "S(3)"
    plan["parameters"]["layers.2.bias"]["placement"] = "S(0)"  # 8 rows over 3 devices
    path.write_text(json.dumps(plan))
    capsys.readouterr()
    assert cli.main(["validate", str(path), "models:tiny_mlp", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert problems == [
        "layers.0.bias: optimizer_state 'S(3)' splits dim 3, the parameter has 1 dims (shape [32])",
        "layers.0.weight: placement 'S(7)' splits dim 7, the parameter has 2 dims (shape [32, 16])",
        "layers.2.bias: placement 'S(0)' splits dim 0 of size 8 over 3 devices, which does not divide it"], problems


def test_torch_logs_no_traceback_before_autopar_s_message(tmp_path):
    """A zip that is no export archive, and inputs the model refuses: torch logs a traceback
    before raising; the user sees autopar's one message (with torch's cause), nothing else."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "model.pt2", "w") as archive:
        archive.writestr("foo.txt", "not an archive")
    done = autopar("plan", str(tmp_path / "model.pt2"), "--cluster", "2xH100", "--input", "x=8x16:float32")
    assert done.returncode == 2 and "not in a subdirectory" in done.stderr, done.stderr
    wrong = autopar("plan", "models:tiny_mlp", "--cluster", "2xH100", "--input", "x=8x17:float32")
    assert wrong.returncode == 2 and "forward fails on the example inputs" in wrong.stderr, wrong.stderr
    (tmp_path / "data_dep.py").write_text(
        "import torch\nclass DataDep(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.lin = torch.nn.Linear(16, 16)\n    def forward(self, x):\n"
        "        return self.lin(x) if x.sum() > 0 else x\ndef build():\n    return DataDep(), (torch.randn(8, 16),)\n")
    untraceable = autopar("plan", "data_dep:build", "--cluster", "2xH100", cwd=tmp_path)
    assert untraceable.returncode == 1 and "data_dep.py:7" in untraceable.stderr, untraceable.stderr
    for result in (done, wrong, untraceable):
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) <= 3, result.stderr


def test_a_closed_pipe_ends_quietly():
    """`autopar devices --json | head -c 0`: the reader left; no internal error, SIGPIPE's status."""
    exe = shutil.which("autopar")
    cmd = [exe] if exe else [sys.executable, "-m", "autopar.cli"]
    reader = subprocess.Popen(["head", "-c", "0"], stdin=subprocess.PIPE)
    done = subprocess.run(cmd + ["devices", "--json"], stdout=reader.stdin, stderr=subprocess.PIPE, text=True,
                          cwd=HERE, timeout=600)
    reader.stdin.close()
    reader.wait()
    assert done.returncode in (0, 141) and done.stderr == "", done.stderr


def test_outputs_onto_a_symlink_and_a_fifo(tmp_path, monkeypatch, capsys):
    """A symlinked output keeps its link (its target gets the plan); a FIFO is refused, untouched."""
    from autopar import cli

    monkeypatch.syspath_prepend(HERE)
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(tmp_path / "link.json")]) == 0
    assert (tmp_path / "link.json").is_symlink() and json.loads(target.read_text())["family"] == "one_mesh"
    os.mkfifo(tmp_path / "fifo.json")
    capsys.readouterr()
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(tmp_path / "fifo.json")]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert (tmp_path / "fifo.json").is_fifo()


def test_a_batch_sweep_says_which_batches_do_not_fit(monkeypatch, capsys):
    from autopar import cli

    monkeypatch.syspath_prepend(HERE)
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "--memory-limit", "200000",
                     "--batch-size", "8,100000000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["batch_sweep"]
    assert [row["fits"] for row in rows] == [True, False]
    assert rows[1]["memory_bytes"] > 200000 > rows[0]["memory_bytes"]


def test_validate_names_node_outputs_split_on_a_dim_they_lack(tmp_path, monkeypatch, capsys):
    from autopar import cli

    monkeypatch.syspath_prepend(HERE)
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "-o", str(path), "--json"]) == 0
    plan = json.loads(path.read_text())
    plan["nodes"]["addmm"]["outputs"] = ["S(9)"]
    path.write_text(json.dumps(plan))
    capsys.readouterr()
    assert cli.main(["validate", str(path), "models:tiny_mlp", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert problems == ["node addmm: output 0 placement 'S(9)' splits dim 9, the output has 2 dims (shape [8, 32])"]


def test_a_misspelt_option_is_named_with_the_nearest_one():
    done = autopar("plan", "models:tiny_mlp", "--clustr", "2xH100")
    assert done.returncode == 2 and "unknown option --clustr: did you mean --cluster?" in done.stderr, done.stderr


def test_memory_limits_with_units_and_negative_values(monkeypatch, capsys):
    from autopar import cli

    monkeypatch.syspath_prepend(HERE)
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "--memory-limit", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit_bytes"] == [2 ** 30] * 2
    assert cli.main(["plan", "models:tiny_mlp", "--cluster", "2xH100", "--memory-limit", "-5"]) == 2
    assert "memory limit must be positive" in capsys.readouterr().err


def test_an_archive_of_fixed_shapes_says_so(tmp_path, monkeypatch, capsys):
    from autopar import cli

    model, x = MLP(), torch.randn(8, 16)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "mlp.pt2")
    assert cli.main(["plan", str(tmp_path / "mlp.pt2"), "--cluster", "2xH100", "--input", "x=64x16:float32"]) == 2
    err = capsys.readouterr().err
    assert "exported for inputs of shapes [(8, 16)] and no dynamic dims" in err and "(64, 16)" in err, err


def test_explain_and_diff_on_names_and_plans_that_do_not_match():
    import autopar as package
    from autopar.plan_diff import diff, diff_text, explain

    plan = package.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100")
    with pytest.raises(KeyError, match="similar: addmm"):
        explain(plan, "ADDMM")
    with pytest.raises(KeyError, match="'layers.0.weight' is a parameter, not an op node: its placement is"):
        explain(plan, "layers.0.weight")
    other = package.plan(torch.nn.Sequential(torch.nn.Linear(16, 4)), (torch.randn(8, 16),), cluster="2xH100")
    changes = diff(plan, other)
    assert not changes["same_model"] and changes["parameters_changed"] == {} and changes["nodes_changed"] == []
    assert "placements not compared" in diff_text(changes)
