"""The layers of DESIGN.md §1, checked over every import (function-level ones too, read with
ast) of every module in autopar/, autopar/planning/, passes/ and solvers/. Modules go by their
installed names: passes/x.py is autopar.passes.x, solvers/x.py is autopar.solvers.x.

Bottom to top, each layer and what it may import from the project:

  types     autopar.{errors, units, devices, cluster,      types; no torch
            cluster_file, mesh, comm, plan, problem,
            placements, files}
  ops       autopar.passes.dtensor_ops                     types
  analysis  autopar.passes (the package) and its           types, ops, analysis; no ortools
            capture, context_parallel, cost, decompose,
            embedding_bag, expert_dispatch, expert_order, experts,
            layers, layer_recompute, memory, build_problem, sparse,
            stack_experts, stages, strategies, strategy_types,
            bag_strategies, symbolic, values
  solvers   autopar.solvers, autopar.solvers.*             types, solvers; no torch
  lowering  autopar.passes.{lower, pipeline_lower,         types, ops, analysis, lowering
            replica_lower, fuse, grad_sync, runtime,
            attention_runtime, bag_runtime, bag_lower, materialize},
            autopar.parallel
  planning  autopar.planning, autopar.planning.*           all but the face
  face      autopar (the package), autopar.{api, cli, cli_args,     anything
            cli_commands, model_files, report, plan_diff, html_report,
            profile, profile_collectives, trace}

Where the less obvious modules sit, and why:
  * autopar.parallel (ParallelModule, what lowering returns) is lowering/runtime: it is the
    lowered program's shell while training, and gathers state through passes.runtime;
  * passes.materialize (a meta-built model's weights made real one module at a time) is
    lowering/runtime: it runs at apply, reads no graph, and only lowering calls it;
  * passes.relower (the plan lowered again for other input shapes) is lowering: it captures
    the model again, so a ParallelModule is handed one (the runtime imports no capture);
  * passes.dtensor_ops ("ops") holds the DTensor helpers analysis and the training runtime
    share — placement values <-> DTensor placements, the experts' relabelling op that
    passes.expert_order checks on real values and lowering emits — so neither imports the other.

Besides: the training runtime (passes.runtime, passes.attention_runtime, autopar.parallel)
reaches no analysis module, even through others; no import cycles; ``autopar show plan.json`` loads no DTensor, torch.export
nor ortools. One named exception, :data:`EXCEPTIONS`.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import torch

import autopar
from models import MLP

ROOT = pathlib.Path(__file__).resolve().parent.parent

TYPES = {f"autopar.{m}" for m in ("errors", "units", "devices", "cluster", "cluster_file", "mesh", "comm", "plan",
                                  "plan_types", "plan_io", "problem", "placements", "files")}
OPS = {"autopar.passes.dtensor_ops", "autopar.passes.expert_mm", "autopar.passes.bag_pooling"}
ANALYSIS = {"autopar.passes"} | {f"autopar.passes.{m}" for m in (
    "capture", "context_parallel", "cost", "decompose", "embedding_bag", "graph_edit", "expert_dispatch", "expert_order", "experts", "grouped_experts", "layers", "layer_recompute", "memory",
    "build_problem", "node_memory", "problem_edges", "strategy_exchanges", "reshard_cost", "row_ops", "sample_local", "sparse", "stack_experts", "stages", "strategies", "strategy_types", "bag_strategies", "symbolic",
    "training_forward", "values", "weight_gradients")}
LOWERING = {f"autopar.passes.{m}" for m in ("lower", "pipeline_lower", "replica_lower", "fuse", "grad_sync",
                                            "runtime", "attention_runtime", "expert_runtime", "mode_ops", "bag_runtime", "bag_lower", "materialize", "recompute", "reshard", "split_loss", "relower",
                                            "prefetch", "link_probe", "place_state", "row_order_checkpoint")} | {"autopar.parallel"}
FACE = {"autopar"} | {f"autopar.{m}" for m in ("api", "checkpoint", "cli", "cli_args", "cli_commands", "model_files",
                                                "report", "plan_diff", "html_report", "profile", "profile_collectives", "profile_gpu", "timeline",
                                                "trace")}
RUNTIME = {"autopar.passes.runtime", "autopar.passes.attention_runtime", "autopar.passes.expert_runtime",
           "autopar.passes.mode_ops",
           "autopar.passes.bag_runtime", "autopar.passes.reshard",
           "autopar.passes.row_order_checkpoint", "autopar.passes.split_loss", "autopar.parallel"}  # what a training step calls

MAY_IMPORT = {
    "types": {"types"},
    "ops": {"types", "ops"},
    "analysis": {"types", "ops", "analysis"},
    "solvers": {"types", "solvers"},
    "lowering": {"types", "ops", "analysis", "lowering"},
    "planning": {"types", "ops", "analysis", "solvers", "lowering", "planning"},
    "face": {"types", "ops", "analysis", "solvers", "lowering", "planning", "face"},
}
NO_EXTERNAL = {"types": ("torch",), "solvers": ("torch",), "ops": ("ortools",), "analysis": ("ortools",)}
# the dispatch cost (passes.build_problem -> passes.expert_dispatch) counts the busiest expert owner
# in the order the planner will place: solvers.balance's, plain numbers in and out (ortools
# loaded only when it solves). Removing it means handing the order in from planning.
EXCEPTIONS = {("autopar.passes.expert_dispatch", "autopar.solvers.balance")}


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("passes", "solvers"):
        parts.insert(0, "autopar")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_name(p): p for folder in ("autopar", "passes", "solvers") for p in sorted((ROOT / folder).rglob("*.py"))}


def layer(module: str) -> str | None:
    for name, members in (("types", TYPES), ("ops", OPS), ("analysis", ANALYSIS), ("lowering", LOWERING),
                          ("face", FACE)):
        if module in members:
            return name
    for name, package in (("solvers", "autopar.solvers"), ("planning", "autopar.planning")):
        if module == package or module.startswith(package + "."):
            return name
    return None


def imports(module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``module``'s file: ``from X import y`` is
    X.y where that is a module of the project, else X; relative imports resolved."""
    path = FILES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in FILES else base) for a in node.names]
    return found


def _within(target: str) -> str | None:
    """The project module ``target`` names (its longest known prefix), or None outside it."""
    while target and target not in FILES:
        target = target.rpartition(".")[0]
    return target or None


def _where(module: str, line: int) -> str:
    return f"{FILES[module].relative_to(ROOT)}:{line} {module}"


def test_every_module_has_a_layer():
    assert [m for m in FILES if layer(m) is None] == [], "add them to a layer in this test's table"


def test_imports_go_down_the_layers():
    violations, used = [], set()
    for module in FILES:
        own = layer(module)
        for line, target in imports(module):
            banned = [b for b in NO_EXTERNAL.get(own, ()) if target == b or target.startswith(b + ".")]
            if banned:
                violations.append(f"{_where(module, line)} ({own}) imports {target}: no {banned[0]} in {own}")
            inside = _within(target)
            if (module, inside) in EXCEPTIONS:
                used.add((module, inside))
            elif inside is not None and layer(inside) not in MAY_IMPORT[own]:
                violations.append(f"{_where(module, line)} ({own}) imports {inside} ({layer(inside)})")
    assert violations == [], "\n".join(violations)
    assert used == EXCEPTIONS, f"exceptions no longer needed: {EXCEPTIONS - used}"


def _graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (not its own packages: importing
    autopar.passes.x runs autopar.passes and autopar whatever the code says)."""
    return {m: {t for _, target in imports(m) if (t := _within(target)) and t != m and not m.startswith(t + ".")}
            for m in FILES}


def test_training_runtime_reaches_no_analysis():
    graph = _graph()
    for start in RUNTIME:
        seen, todo = set(), [start]
        while todo:
            for t in graph[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        assert not {m for m in seen if layer(m) == "analysis"}, f"{start} reaches analysis: {sorted(seen)}"


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                cycle = _shortest_cycle(min(component), component, graph)
                cycles.append(f"{len(component)} modules in a cycle, e.g. " + " -> ".join(
                    f"{_where(a, _line(a, b))} imports {b}" for a, b in zip(cycle, cycle[1:])))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == [], "\n".join(cycles)


def _shortest_cycle(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest import path from ``start`` back to itself, breadth first."""
    paths = {start: [start]}
    queue = [start]
    for v in queue:
        for w in sorted(graph[v] & component):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"{start} is in no cycle")


def _line(module: str, target: str) -> int:
    return next(line for line, t in imports(module) if _within(t) == target)


def test_show_loads_no_dtensor_export_or_ortools(tmp_path):
    torch.manual_seed(0)
    autopar.plan(MLP(), (torch.randn(8, 16),), cluster="2xH100").save(tmp_path / "plan.json")
    code = ("import sys; from autopar.cli import main\n"
            "codes = [main(['show', 'plan.json', '--html', 'plan.html']), main(['show', 'plan.json', '--json'])]\n"
            "print('MODULES', *sys.modules, codes)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[-1].split()
    assert line[0] == "MODULES" and done.stdout.rstrip().endswith("[0, 0]"), done.stdout[-500:]
    loaded = [m for m in line if m.startswith(("torch.distributed.tensor", "torch.export", "ortools"))]
    assert loaded == [], loaded[:10]
