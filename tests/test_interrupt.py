"""Ctrl-C (SIGINT) while planning (issue 8): the search stops at once, nothing is written,
the CLI exits with 130."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

HERE = os.path.dirname(__file__)

HARD_SEARCH = textwrap.dedent("""
    from ortools.sat.python import cp_model
    from autopar.solvers.ilp import _solve_interruptibly

    model = cp_model.CpModel()
    xs = [model.new_int_var(0, 200, f"x{i}") for i in range(120)]
    model.add_all_different(xs)
    model.maximize(sum((i * 7919 % 13) * x for i, x in enumerate(xs)) - sum(xs[::3]))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 600
    solver.parameters.num_workers = 1
    solver.parameters.log_search_progress = True
    solver.parameters.log_to_stdout = False
    # CP-SAT's own log says when presolve is over and the search proper runs (in its thread)
    solver.log_callback = lambda line: line.startswith("Starting search") and print("searching", flush=True)
    _solve_interruptibly(solver, model)
    print("finished", flush=True)
""")


def _interrupt_on(proc: subprocess.Popen, marker: str) -> str:
    """Send SIGINT once a line of proc's output (stdout with stderr merged in) contains ``marker``
    — the process says it got there, rather than the test guessing how long that takes — and
    return all its output. The watchdog only keeps a hung process from hanging the test suite."""
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                proc.send_signal(signal.SIGINT)
                break
        else:
            raise AssertionError(f"{marker!r} never appeared; output: {''.join(seen)[-3000:]}")
        output = "".join(seen) + proc.stdout.read()
        proc.wait()
        return output
    finally:
        watchdog.cancel()
        proc.kill()  # a no-op once it has ended
        proc.wait()


def test_interrupt_stops_the_search_at_once():
    # cwd: not the repository root, whose autopar/ folder would shadow the installed package
    proc = subprocess.Popen([sys.executable, "-c", HARD_SEARCH], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=HERE)
    output = _interrupt_on(proc, "searching")
    assert "finished" not in output  # the search did not end quietly (CP-SAT's own SIGINT handler) and return
    assert "KeyboardInterrupt" in output, output


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
        "plan", "bigmodel:build", "--cluster", "8x8xH100", "-o", str(tmp_path / "plan.json"), "-v"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=env)
    output = _interrupt_on(proc, ": solving (")  # -v logs "autopar.planner: mesh [8, 8]: solving (...)"
    assert proc.returncode == 130, output
    assert "interrupted; nothing was written" in output
    assert "Traceback" not in output
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["bigmodel.py"]


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
