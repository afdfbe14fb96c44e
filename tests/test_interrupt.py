"""Ctrl-C (SIGINT) while planning (issue 8): the search stops at once, nothing is written,
the CLI exits with 130."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(__file__)

HARD_SEARCH = textwrap.dedent("""
    from ortools.sat.python import cp_model
    from autopar.solvers.ilp import _solve_interruptibly

    model = cp_model.CpModel()
    xs = [model.new_int_var(0, 200, f"x{i}") for i in range(120)]
    model.add_all_different(xs)
    model.maximize(sum((i * 7919 % 13) * x for i, x in enumerate(xs)) - sum(xs[::3]))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 120
    solver.parameters.num_workers = 1
    print("solving", flush=True)
    _solve_interruptibly(solver, model)
    print("finished", flush=True)
""")


def _interrupt_after(proc: subprocess.Popen, marker: str | None, delay_s: float) -> float:
    """Send SIGINT ``delay_s`` after ``marker`` appears on stdout (or after start); returns
    the seconds the process took to end after the signal."""
    if marker is not None:
        line = proc.stdout.readline()
        if marker not in line:
            proc.kill()
            raise AssertionError(f"expected {marker!r}, got {line!r}; stderr: {proc.communicate()[1][-2000:]}")
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    proc.wait(timeout=60)
    return time.perf_counter() - sent


def test_interrupt_stops_the_search_at_once():
    # cwd: not the repository root, whose autopar/ folder would shadow the installed package
    proc = subprocess.Popen([sys.executable, "-c", HARD_SEARCH], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=HERE)
    took = _interrupt_after(proc, "solving", 1.0)
    out, err = proc.communicate()
    assert "finished" not in out  # the search did not run on to its 120 s limit and return
    assert "KeyboardInterrupt" in err, err
    assert took < 10, took


def test_cli_interrupted_while_planning_writes_nothing(tmp_path):
    (tmp_path / "bigmodel.py").write_text(textwrap.dedent("""
        import torch
        from models import GPT

        def build():
            with torch.device("meta"):
                model = GPT(vocab=32000, d=2048, layers=24, heads=16, max_len=1024)
                return model, (torch.zeros(8, 1024, dtype=torch.long),)
    """))
    exe = shutil.which("autopar")
    cmd = ([exe] if exe else [sys.executable, "-m", "autopar.cli"]) + [
        "plan", "bigmodel:build", "--cluster", "8x8xH100", "-o", str(tmp_path / "plan.json")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    took = _interrupt_after(proc, None, 6.0)  # capture takes ~3 s, planning ~10 s more
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted; nothing was written" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["bigmodel.py"]
    assert took < 10, took


def test_cli_interrupted_inside_an_extension_import_says_interrupted(monkeypatch, capsys):
    """Ctrl-C while a C extension initialises (ortools' solver, imported when planning
    starts) surfaces as an ImportError raised from the KeyboardInterrupt: still an interrupt."""
    from autopar import cli

    def interrupted_import(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    for action in parser._subparsers._group_actions[0].choices.values():
        action.set_defaults(run=interrupted_import)
    assert cli.main(["plan", "bigmodel:build", "--cluster", "2xcpu", "-o", "plan.json"]) == 130
    assert "interrupted; nothing was written" in capsys.readouterr().err
