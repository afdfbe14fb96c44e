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


def _interrupt_on(proc: subprocess.Popen, marker: str, at_marker=lambda: None) -> str:
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
                at_marker()
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


BLOCKED_WORKERS = textwrap.dedent("""
    import time
    from autopar import profile

    def worker(rank):
        time.sleep(600)  # a measurement that will not end by itself

    if __name__ == "__main__":
        profile._run_workers(worker, 2, ())
""")


def test_interrupted_profile_ends_its_workers_instead_of_waiting_for_them(tmp_path):
    """A SIGINT to the parent alone while its measuring workers run: they are ended and the
    parent stops (multiprocessing's exit handler would otherwise wait for them, here 600 s —
    the watchdog's kill would show as -9). Their PIDs are gone afterwards."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED_WORKERS)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE, env=env)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        while len(workers := _spawned_workers(proc.pid)) < 2 and proc.poll() is None:
            threading.Event().wait(0.1)
        proc.send_signal(signal.SIGINT)
        output = proc.stdout.read()
        proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    # ended by the SIGINT itself (Python re-raises it on an uncaught KeyboardInterrupt), not killed
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in output, (proc.returncode, output[-2000:])
    assert [pid for pid in workers if _state(pid) not in ("gone", "Z")] == [], workers


def _spawned_workers(parent: int) -> list[int]:
    """PIDs of ``parent``'s multiprocessing workers (not its resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                ppid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, StopIteration):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def test_profile_interrupted_ends_its_workers_and_writes_nothing(tmp_path):
    """A SIGINT to the CLI alone (not its process group) while the gloo workers measure: the
    workers are ended, not orphaned; exit 130, no cluster file."""
    exe = shutil.which("autopar")
    out = tmp_path / "cpu.yaml"
    cmd = ([exe] if exe else [sys.executable, "-m", "autopar.cli"]) + [
        "profile", "--world", "2", "--quick", "--out", str(out), "-v"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    workers: list[int] = []

    def both_started() -> None:  # a worker shows as one once it has exec'd python's spawn_main
        while len(found := _spawned_workers(proc.pid)) < 2 and proc.poll() is None:
            threading.Event().wait(0.05)
        workers.extend(found)
    output = _interrupt_on(proc, "measuring collectives between 2 worker processes", both_started)
    assert len(workers) == 2, (output, workers)
    assert proc.returncode == 130, output
    assert "interrupted; nothing was written" in output and not out.exists()
    assert [pid for pid in workers if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"] == [], output


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return "gone"
